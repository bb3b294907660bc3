"""Linear head + cross-entropy (mean or sum; label smoothing and class weights as F.cross_entropy takes
them) without ever holding the full FP32 logits.

The rows (tokens) are processed in chunks. For each chunk the logits are computed in the compute
dtype (bf16 under bf16 training), the log-sum-exp and the softmax gradient in FP32 inside one
compiled kernel, and the gradients wrt the hidden states and the weight are accumulated right
there, in the forward. The backward only scales the stored gradients by the incoming grad. Peak
memory is one chunk of logits instead of (tokens x vocab) FP32 logits plus their softmax and grad.

Why the stored gradients are FP32: under fp16 the incoming grad is the loss scale (2**16 by
default, which is inf in fp16), and the whole point of that scale is to lift gradients like
softmax/n_valid out of fp16's underflow range. So the low-precision chunk gradient is never
divided by n_valid (it stays O(1)); each GEMM output is upcast, scaled by 1/n_valid in FP32 and
kept in FP32; the backward multiplies by the incoming grad in FP32 and rounds once, to the input
dtypes. The price: the hidden-state grad (tokens x dim) and the weight grad (vocab x dim, already
accumulated in FP32) are held in FP32 rather than the compute dtype until the backward.

Targets equal to ``ignore_index`` (-100, the padding convention of workloads.base) add neither
loss nor gradient, and the mean is over the other targets (weighted by their class weights where
there are any), exactly as F.cross_entropy does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ...errors import FusionError
from ._kernels import epilogue, use_triton

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "default_chunk_rows"]


def default_chunk_rows(rows: int, vocab: int, dim: int, device: str = "cpu") -> int:
    """Rows per chunk: about 4M logits per chunk and at least 512 rows on CPU, about 128M (with >= 1024
    rows) on CUDA.

    CPU (measured): smaller chunks save little more memory but make the weight-grad GEMMs thin
    (their inner dimension is the chunk) and re-read the FP32 weight-grad accumulator once per
    chunk, a cost per chunk that grows with the vocabulary as the GEMM work does; on the CPU here
    128-row chunks ran ~2x slower than 512-row ones at vocab 8192, and at GPT-2's vocab (50257,
    d768, 2048 rows) the op took 2.76 s with 64-row chunks (what 4M logits gave), 1.67 s with 512
    (benchmarks/2026-12-07-user-code-patterns-3.md). Hence the 512-row floor: the memory it
    saves is then at least rows/512 times a chunk's logits.

    CUDA (reasoned, not yet measured; scripts/gpu-check.sh runs the op so it can be): each chunk
    reads and writes the (vocab x dim) FP32 weight-grad accumulator plus the chunk's
    low-precision GEMM output, ~12 bytes per weight, against 2 * chunk FLOPs per weight of GEMM.
    A GPU that does ~300 FLOPs per byte of HBM traffic (H100/H200 bf16) needs chunk >= ~1800 rows
    for that GEMM to stay compute-bound, hence a 1024-row floor and a 128M-logit target
    (vocab 50k: 2048 rows, 400 MB of bf16 logits and grad). Powers of two keep GEMM shapes friendly.
    """
    if device == "cuda":
        target = max(1024, (1 << 27) // max(1, vocab))
    else:
        target = max(512, (1 << 22) // max(1, vocab))
    return min(1 << (target.bit_length() - 1), max(32, rows))


@epilogue
def _ce_chunk(logits: Tensor, targets: Tensor, ignore_index: int, with_bias: bool, smoothing: float = 0.0,
              class_weight: Optional[Tensor] = None):
    """(summed loss, its gradient wrt the logits in the logits dtype, that gradient's FP32 column sums);
    ignored rows are 0.

    Plain cross-entropy's gradient is softmax - onehot. With label smoothing ``s`` and class weights
    ``w`` (all ones when None; ``W`` their sum) the row's loss is F.cross_entropy's
    ``(1-s) w_t (lse - z_t) + s/V (W lse - sum_c w_c z_c)`` and its gradient
    ``(1-s) w_t (softmax - onehot) + s/V (W softmax - w)``. Not divided by the mean's denominator:
    that scale is applied in FP32 by the caller (see the module docstring).
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    target_logit = lf.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    onehot = torch.arange(lf.shape[-1], device=lf.device).unsqueeze(0) == safe.unsqueeze(-1)
    softmax = torch.exp(lf - lse.unsqueeze(-1))
    if smoothing == 0.0 and class_weight is None:
        row_loss = lse - target_logit
        grad = softmax - onehot.float()
    else:
        vocab = lf.shape[-1]
        w = class_weight.float() if class_weight is not None else lf.new_ones(vocab)
        w_t, total_w = w[safe], w.sum()
        row_loss = ((1.0 - smoothing) * w_t * (lse - target_logit)
                    + smoothing / vocab * (total_w * lse - (lf * w).sum(-1)))
        grad = ((1.0 - smoothing) * w_t.unsqueeze(-1) * (softmax - onehot.float())
                + smoothing / vocab * (total_w * softmax - w))
    loss_sum = torch.where(valid, row_loss, 0.0).sum()
    grad = grad * valid.unsqueeze(-1)
    grad_bias = grad.sum(0) if with_bias else grad.new_zeros(0)
    return loss_sum, grad.to(logits.dtype), grad_bias


@epilogue
def _accumulate(total: Tensor, part: Tensor) -> None:
    """``total += part`` into the FP32 ``total`` in one pass over both.

    Eager PyTorch first upcasts a low-precision ``part`` into a temporary; on the AVX512-BF16 EPYC
    that made each chunk's weight-gradient accumulation (8192 x 512) 2.1 ms against 0.3 ms compiled.
    """
    total.add_(part.float())


def _chunk_loss_and_grad(logits, targets, ignore_index, with_bias, smoothing, class_weight):
    if use_triton(logits):
        from . import _triton_kernels

        return _triton_kernels.cross_entropy_chunk(logits, targets, ignore_index, with_bias, smoothing, class_weight)
    return _ce_chunk(logits, targets, ignore_index, with_bias, smoothing, class_weight)


def _check_targets(targets: Tensor, vocab: int, ignore_index: int) -> None:
    """FusionError naming the first target outside [0, vocab) that is not ``ignore_index``.

    The kernels do not report a bad target: the Triton one masks the read and would give a wrong
    loss silently; on CPU the compiled gather fails with an index error that surfaces as a compile
    failure. This check costs one host sync per call on CUDA, the price of an error that names the
    value instead of a silently wrong loss.
    """
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise FusionError(
            f"target {value} is outside the vocabulary [0, {vocab}) and is not ignore_index={ignore_index}; "
            "fix the labels (padding must use ignore_index)"
        )


@torch.library.custom_op("turbotrain::linear_cross_entropy", mutates_args=())
def _lce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, ignore_index: int,
         chunk_rows: int, need_h: bool, need_w: bool, mean: bool = True, label_smoothing: float = 0.0,
         class_weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    _check_targets(t, weight.shape[0], ignore_index)
    # 1/n_valid (1/sum of the valid targets' class weights) stays a tensor: no host sync; with every
    # target ignored it is inf and the loss NaN, as F.cross_entropy gives (its sum is then 0, with zero
    # gradients: scale 1 here too).
    valid = t != ignore_index
    if not mean:
        scale = 1.0
    elif class_weight is None:
        scale = 1.0 / valid.sum().float()
    else:
        scale = 1.0 / torch.where(valid, class_weight.float()[torch.where(valid, t, 0)], 0.0).sum()
    f32 = dict(dtype=torch.float32, device=hidden.device)
    loss_sum = torch.zeros((), **f32)
    grad_h = torch.empty(h2.shape, **f32) if need_h else h2.new_empty(0, dtype=torch.float32)
    grad_w = None  # the first chunk's product starts it: no zeros to add to
    grad_b = torch.zeros(weight.shape[0], **f32) if bias is not None else None
    for start in range(0, h2.shape[0], chunk_rows):
        hc, tc = h2[start:start + chunk_rows], t[start:start + chunk_rows]
        logits = torch.addmm(bias, hc, weight.t()) if bias is not None else torch.mm(hc, weight.t())
        loss_c, grad_logits, grad_bias_c = _chunk_loss_and_grad(logits, tc, ignore_index, bias is not None,
                                                                label_smoothing, class_weight)
        loss_sum += loss_c
        if need_h:  # a GEMM of O(1) values in the compute dtype; 1/n_valid applied in FP32
            rows_h = grad_h[start:start + chunk_rows]
            if grad_logits.dtype == torch.float32:
                torch.mm(grad_logits, weight, out=rows_h)
            else:
                rows_h.copy_(torch.mm(grad_logits, weight))
            rows_h.mul_(scale)
        if need_w:
            if grad_logits.dtype == torch.float32:
                if grad_w is None:
                    grad_w = torch.mm(grad_logits.t(), hc)
                else:
                    grad_w.addmm_(grad_logits.t(), hc)
            else:  # low-precision GEMM, FP32 accumulation across chunks
                part = torch.mm(grad_logits.t(), hc)
                if grad_w is None:
                    grad_w = part.float()
                elif grad_w.is_cuda:  # one mixed-dtype kernel there already
                    grad_w += part
                else:
                    _accumulate(grad_w, part)
        if grad_b is not None:
            grad_b += grad_bias_c
    if need_w and grad_w is None:  # no rows
        grad_w = torch.zeros(weight.shape, **f32)
    grad_w = grad_w.mul_(scale) if need_w else weight.new_empty(0, dtype=torch.float32)
    grad_b = grad_b.mul_(scale) if bias is not None else weight.new_empty(0, dtype=torch.float32)
    return loss_sum * scale, grad_h.view(hidden.shape) if need_h else grad_h, grad_w, grad_b


@_lce.register_fake
def _(hidden, weight, bias, targets, ignore_index, chunk_rows, need_h, need_w, mean=True, label_smoothing=0.0,
      class_weight=None):
    f32 = torch.float32  # the saved gradients are FP32 whatever the inputs (module docstring)
    loss = hidden.new_empty((), dtype=f32)
    grad_h = torch.empty_like(hidden, dtype=f32) if need_h else hidden.new_empty(0, dtype=f32)
    grad_w = torch.empty_like(weight, dtype=f32) if need_w else weight.new_empty(0, dtype=f32)
    grad_b = torch.empty_like(bias, dtype=f32) if bias is not None else weight.new_empty(0, dtype=f32)
    return loss, grad_h, grad_w, grad_b


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    hidden, weight, bias = inputs[:3]
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
    ctx.need_h, ctx.need_w = inputs[6], inputs[7]


def _autograd_backward(ctx, grad_loss, *unused):
    saved = ctx.saved_tensors
    needed = (ctx.need_h, ctx.need_w, ctx.dtypes[2] is not None)
    # FP32 product, one rounding: grad_loss may be a loss scale that fp16 cannot hold (2**16 is inf).
    grad_loss = grad_loss.float()
    grads = tuple((g * grad_loss).to(dtype) if need else None
                  for g, dtype, need in zip(saved, ctx.dtypes, needed))
    return (*grads, None, None, None, None, None, None, None, None)


_lce.register_autograd(_autograd_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.turbotrain.linear_cross_entropy)
def _lce_flops(h_shape, w_shape, b_shape, t_shape, ignore_index, chunk_rows, need_h, need_w, mean=True, *args,
               **kw) -> int:
    # The logits GEMM plus the gradient GEMMs, which this op runs in its forward.
    gemm = 2 * math.prod(h_shape[:-1]) * w_shape[0] * w_shape[1]
    return gemm * (1 + int(need_h) + int(need_w))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                         ignore_index: int = -100, chunk_rows: Optional[int] = None, reduction: str = "mean",
                         label_smoothing: float = 0.0, class_weight: Optional[Tensor] = None) -> Tensor:
    """Mean (or, with ``reduction="sum"``, summed) cross-entropy of ``hidden @ weight^T + bias`` against
    ``targets``, in chunks of rows; ``label_smoothing`` and ``class_weight`` are F.cross_entropy's
    ``label_smoothing`` and ``weight``, with its meaning (a weighted mean divides by the valid targets'
    summed class weights).

    >>> h, w, t = torch.randn(6, 8), torch.randn(20, 8), torch.tensor([1, 2, -100, 4, 5, 6])
    >>> torch.allclose(linear_cross_entropy(h, w, None, t), linear_cross_entropy_reference(h, w, None, t))
    True
    """
    if hidden.shape[:-1] != targets.shape:
        raise FusionError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match; "
            "targets must have the hidden shape without its last (feature) dimension"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise FusionError(f"targets must be integer class indices, got {targets.dtype}")
    if reduction not in ("mean", "sum"):
        raise FusionError(f"reduction={reduction!r}: the fused cross-entropy reduces by 'mean' or 'sum'")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise FusionError(f"label_smoothing={label_smoothing} must be between 0.0 and 1.0, as F.cross_entropy's")
    if class_weight is not None:
        if class_weight.shape != (weight.shape[0],) or not class_weight.is_floating_point():
            raise FusionError(f"class_weight of shape {tuple(class_weight.shape)} and dtype {class_weight.dtype}: "
                              f"it must be a floating 1-d tensor with one weight per class ({weight.shape[0]})")
        if class_weight.requires_grad:
            raise FusionError("class_weight requires grad; F.cross_entropy's weight= is not trained either, so "
                              "pass it detached")
    rows = targets.numel()
    chunk = chunk_rows or default_chunk_rows(rows, weight.shape[0], weight.shape[1], hidden.device.type)
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    if bias is not None and grad_on and not bias.requires_grad:
        bias = bias.detach()
    out = _lce(hidden.contiguous(), weight, bias, targets.long(), ignore_index, chunk, need_h, need_w,
               reduction == "mean", float(label_smoothing),
               None if class_weight is None else class_weight.contiguous())
    return out[0]


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                   targets: Tensor, ignore_index: int = -100, reduction: str = "mean",
                                   label_smoothing: float = 0.0, class_weight: Optional[Tensor] = None) -> Tensor:
    """Plain PyTorch twin: full logits, cast to FP32, then F.cross_entropy (as workloads.base does)."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing,
                           weight=None if class_weight is None else class_weight.float())
