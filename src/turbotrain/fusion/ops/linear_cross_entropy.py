"""Linear head + mean cross-entropy without ever holding the full FP32 logits.

The rows (tokens) are processed in chunks. For each chunk the logits are computed in the compute
dtype (bf16 under bf16 training), the log-sum-exp and the softmax gradient in FP32 inside one
compiled kernel, and the gradients wrt the hidden states and the weight are accumulated right
there, in the forward. The backward only scales the stored gradients by the incoming grad. Peak
memory is one chunk of logits instead of (tokens x vocab) FP32 logits plus their softmax and grad.

Targets equal to ``ignore_index`` (-100, the padding convention of workloads.base) add neither
loss nor gradient, and the mean is over the other targets, exactly as F.cross_entropy does.
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


def default_chunk_rows(rows: int, vocab: int, dim: int) -> int:
    """Rows per chunk so one chunk of logits holds about 4M values (16 MB in FP32).

    Smaller chunks save little more memory but make the weight-grad GEMMs thin (their inner
    dimension is the chunk) and re-read the FP32 weight-grad accumulator once per chunk; on the
    CPU here 128-row chunks ran ~2x slower than 512-row ones at vocab 8192. A power of two keeps
    GEMM shapes friendly, and at least 32 rows.
    """
    target = max(32, (1 << 22) // max(1, vocab))
    return min(1 << (target.bit_length() - 1), max(32, rows))


@epilogue
def _ce_chunk(logits: Tensor, targets: Tensor, ignore_index: int, scale: Tensor, with_bias: bool):
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    target_logit = lf.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
    onehot = torch.arange(lf.shape[-1], device=lf.device).unsqueeze(0) == safe.unsqueeze(-1)
    row_scale = torch.where(valid, scale, 0.0).unsqueeze(-1)
    grad = (torch.exp(lf - lse.unsqueeze(-1)) - onehot.float()) * row_scale
    grad_bias = grad.sum(0) if with_bias else grad.new_zeros(0)
    return loss_sum, grad.to(logits.dtype), grad_bias


def _chunk_loss_and_grad(logits, targets, ignore_index, scale, with_bias):
    if use_triton(logits):
        from . import _triton_kernels

        return _triton_kernels.cross_entropy_chunk(logits, targets, ignore_index, scale, with_bias)
    return _ce_chunk(logits, targets, ignore_index, scale, with_bias)


@torch.library.custom_op("turbotrain::linear_cross_entropy", mutates_args=())
def _lce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, ignore_index: int,
         chunk_rows: int, need_h: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    # 1/n_valid stays a tensor: no host sync; with every target ignored it is inf and the loss NaN,
    # as F.cross_entropy gives.
    scale = 1.0 / (t != ignore_index).sum().float()
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(h2) if need_h else h2.new_empty(0)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias is not None else None
    for start in range(0, h2.shape[0], chunk_rows):
        hc, tc = h2[start:start + chunk_rows], t[start:start + chunk_rows]
        logits = torch.addmm(bias, hc, weight.t()) if bias is not None else torch.mm(hc, weight.t())
        loss_c, grad_logits, grad_bias_c = _chunk_loss_and_grad(logits, tc, ignore_index, scale, bias is not None)
        loss_sum += loss_c
        if need_h:
            torch.mm(grad_logits, weight, out=grad_h[start:start + chunk_rows])
        if need_w:
            if grad_w.dtype == grad_logits.dtype:
                grad_w.addmm_(grad_logits.t(), hc)
            else:  # low-precision GEMM, FP32 accumulation across chunks
                grad_w += torch.mm(grad_logits.t(), hc)
        if grad_b is not None:
            grad_b += grad_bias_c
    grad_w = grad_w.to(weight.dtype) if need_w else weight.new_empty(0)
    grad_b = grad_b.to(bias.dtype) if bias is not None else weight.new_empty(0)
    return loss_sum * scale, grad_h.view(hidden.shape) if need_h else grad_h, grad_w, grad_b


@_lce.register_fake
def _(hidden, weight, bias, targets, ignore_index, chunk_rows, need_h, need_w):
    loss = hidden.new_empty((), dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    grad_w = torch.empty_like(weight) if need_w else weight.new_empty(0)
    grad_b = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return loss, grad_h, grad_w, grad_b


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.has_bias = inputs[2] is not None
    ctx.need_h, ctx.need_w = inputs[6], inputs[7]


def _autograd_backward(ctx, grad_loss, *unused):
    grad_h, grad_w, grad_b = ctx.saved_tensors
    scale = lambda g: g * grad_loss.to(g.dtype)  # noqa: E731 - the backward is only this scaling
    return (
        scale(grad_h) if ctx.need_h else None,
        scale(grad_w) if ctx.need_w else None,
        scale(grad_b) if ctx.has_bias else None,
        None, None, None, None, None,
    )


_lce.register_autograd(_autograd_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.turbotrain.linear_cross_entropy)
def _lce_flops(h_shape, w_shape, b_shape, t_shape, ignore_index, chunk_rows, need_h, need_w, **kw) -> int:
    # The logits GEMM plus the gradient GEMMs, which this op runs in its forward.
    gemm = 2 * math.prod(h_shape[:-1]) * w_shape[0] * w_shape[1]
    return gemm * (1 + int(need_h) + int(need_w))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                         ignore_index: int = -100, chunk_rows: Optional[int] = None) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight^T + bias`` against ``targets``, in chunks of rows.

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
    rows = targets.numel()
    chunk = chunk_rows or default_chunk_rows(rows, weight.shape[0], weight.shape[1])
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    if bias is not None and grad_on and not bias.requires_grad:
        bias = bias.detach()
    out = _lce(hidden.contiguous(), weight, bias, targets.long(), ignore_index, chunk, need_h, need_w)
    return out[0]


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                   targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Plain PyTorch twin: full logits, cast to FP32, then F.cross_entropy (as workloads.base does)."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
