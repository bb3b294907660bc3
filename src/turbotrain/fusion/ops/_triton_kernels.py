"""Triton kernels for the CUDA paths of the fused ops (imported only when a tensor is on CUDA).

Each wrapper takes and returns the same tensors as the compiled CPU epilogue it replaces, so the
ops' autograd code is shared. Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors, which
is how tests/test_fusion_triton.py checks them on a machine without a GPU.

Every launch runs under ``_on(tensor)``: Triton launches on the *current* CUDA device, which need
not be the one the tensors live on (a model on cuda:1 in a process whose current device is 0).
"""

from __future__ import annotations

import contextlib

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - only reached on CUDA without triton
    from ...errors import HardwareError

    raise HardwareError(
        "the fused ops need Triton on CUDA: pip install triton (it ships with the CUDA builds of "
        "torch), or set TURBOTRAIN_FUSION_KERNELS=eager to run them without kernels"
    ) from exc

import torch

from ...errors import FusionError

__all__ = ["layernorm_act_forward", "layernorm_act_backward", "swiglu_forward", "swiglu_backward",
           "cross_entropy_chunk"]

_ACT_IDS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_TANH_K = 0.7978845608028654
_TANH_C = 0.044715


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 0:
        y = tl.where(z > 0, z, 0.0)
    elif ACT == 1:
        y = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT_HALF))
    elif ACT == 2:
        y = 0.5 * z * (1.0 + _tanh(_TANH_K * (z + _TANH_C * z * z * z)))
    else:
        y = z * tl.sigmoid(z)
    return y


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    if ACT == 0:
        d = tl.where(z > 0, 1.0, 0.0)
    elif ACT == 1:
        d = 0.5 * (1.0 + tl.math.erf(z * _SQRT_HALF)) + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    elif ACT == 2:
        t = _tanh(_TANH_K * (z + _TANH_C * z * z * z))
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _TANH_K * (1.0 + 3.0 * _TANH_C * z * z)
    else:
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    return d


@triton.jit
def _ln_act_fwd(X, W, B, Y, Mean, Rstd, N, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    z = xc * rstd
    if HAS_W:
        z = z * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        z = z + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, _act(z, ACT).to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _ln_act_bwd(DY, X, W, B, Mean, Rstd, DX, DWp, DBp, M, N, rows_per_prog, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else tl.where(mask, 1.0, 0.0)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32) if HAS_B else tl.zeros([BLOCK_N], tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_N], tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 row offsets: rows * N may pass 2**31
    end = tl.minimum(start + rows_per_prog, M)
    for r64 in range(start, end):
        x = tl.load(X + r64 * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + r64)
        xhat = tl.where(mask, (x - tl.load(Mean + r64)) * rstd, 0.0)
        dz = tl.where(mask, dy * _act_grad(xhat * w + b, ACT), 0.0)
        dxhat = dz * w
        c_mean = tl.sum(dxhat, axis=0) / N
        c_proj = tl.sum(dxhat * xhat, axis=0) / N
        dx = rstd * (dxhat - c_mean - xhat * c_proj)
        tl.store(DX + r64 * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dz * xhat
        db_acc += dz
    tl.store(DWp + pid * N + cols, dw_acc, mask=mask)
    tl.store(DBp + pid * N + cols, db_acc, mask=mask)


def _act_id(act: str) -> int:
    return _ACT_IDS[act]


def _on(t: torch.Tensor):
    """Make ``t``'s GPU the current device for a launch (nothing to do for the interpreter on CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


_MAX_ROW_BLOCK = 65536  # one program holds a whole row; wider rows would not fit its registers


def _row_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel whose program holds ``n`` values of one row.

    Triton's default of 4 warps gives each thread BLOCK/128 values to keep in registers; past ~16
    per thread they spill. So the warps grow with the block: 2048 -> 8, 8192 -> 16, 32768 -> 32
    (the most a block can have), keeping ~8-16 values per thread.
    """
    block = triton.next_power_of_2(n)
    if block > _MAX_ROW_BLOCK:
        raise FusionError(
            f"rows of {n} features are wider than the Triton kernels' {_MAX_ROW_BLOCK}; set "
            "TURBOTRAIN_FUSION_KERNELS=eager or do not fuse this layer"
        )
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def layernorm_act_forward(x, weight, bias, eps, act):
    m, n = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    dummy = x  # stands in for an absent weight/bias; the kernel never reads it
    block, warps = _row_block(n)
    with _on(x):
        _ln_act_fwd[(m,)](x, weight if weight is not None else dummy, bias if bias is not None else dummy,
                          y, mean, rstd, n, eps, HAS_W=weight is not None, HAS_B=bias is not None,
                          ACT=_act_id(act), BLOCK_N=block, num_warps=warps)
    return y, mean, rstd


def layernorm_act_backward(grad, x, weight, bias, mean, rstd, act):
    m, n = x.shape
    # A few hundred programs each own a stripe of rows and keep their dw/db partials in registers.
    programs = max(1, min(m, 4 * _sm_count(x.device)))
    rows_per_prog = triton.cdiv(m, programs)
    # The kernel reads and writes row-major; empty_like of a transposed x would keep its strides
    # and the row-major dx written into it would be read back in the wrong order.
    x = x.contiguous()
    dx = torch.empty_like(x)
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db_partial = torch.empty_like(dw_partial)
    dummy = x
    block, warps = _row_block(n)
    with _on(x):
        _ln_act_bwd[(programs,)](grad.contiguous(), x,
                                 weight if weight is not None else dummy, bias if bias is not None else dummy,
                                 mean, rstd, dx, dw_partial, db_partial, m, n, rows_per_prog,
                                 HAS_W=weight is not None, HAS_B=bias is not None, ACT=_act_id(act),
                                 BLOCK_N=block, num_warps=warps)
    return dx, dw_partial.sum(0), db_partial.sum(0)


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter on CPU: any small number will do


@triton.jit
def _swiglu_fwd(GU, OUT, total, H, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    row, col = offs // H, offs % H
    g = tl.load(GU + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, GU, DGU, total, H, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    row, col = offs // H, offs % H
    g = tl.load(GU + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DGU + row * 2 * H + col, (dy * u * s * (1.0 + g * (1.0 - s))).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * 2 * H + H + col, (dy * g * s).to(DGU.dtype.element_ty), mask=mask)


_ELEMENTWISE_BLOCK = 1024


def swiglu_forward(gate_up):
    h = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], h))
    total = out.numel()
    with _on(gate_up):
        _swiglu_fwd[(triton.cdiv(total, _ELEMENTWISE_BLOCK),)](gate_up.contiguous(), out, total, h,
                                                              BLOCK=_ELEMENTWISE_BLOCK)
    return out


def swiglu_backward(grad, gate_up):
    h = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    dgu = torch.empty_like(gate_up)  # contiguous, as the kernel writes it
    total = grad.numel()
    with _on(gate_up):
        _swiglu_bwd[(triton.cdiv(total, _ELEMENTWISE_BLOCK),)](grad.contiguous(), gate_up, dgu,
                                                              total, h, BLOCK=_ELEMENTWISE_BLOCK)
    return dgu


@triton.jit
def _ce_chunk_kernel(Logits, Targets, Grad, Loss, Lse, Weight, TotalW, V, ignore_index, smoothing,
                     BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    # With label smoothing s and class weights w (ones without; total_w their sum) the row's loss is
    # (1-s) w_t (lse - z_t) + s/V (total_w lse - sum_c w_c z_c), its gradient
    # (1-s) w_t (softmax - onehot) + s/V (total_w softmax - w): F.cross_entropy's.
    row = tl.program_id(0).to(tl.int64)
    total_w = V * 1.0
    if HAS_WEIGHT:
        total_w = tl.load(TotalW)
    base = Logits + row * V
    target = tl.load(Targets + row)
    # Pass 1: online max and sum of exponentials, so the row is never held whole.
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    wz = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)  # sum_c w_c z_c, for label smoothing
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if SMOOTH:
            xz = tl.where(cols < V, x, 0.0)
            if HAS_WEIGHT:
                xz = xz * tl.load(Weight + cols, mask=cols < V, other=0.0).to(tl.float32)
            wz += tl.sum(xz, axis=0)
    lse = m + tl.log(s)
    valid = target != ignore_index
    # The wrapper's caller has checked the targets; the mask only keeps a bad one from reading
    # outside the row.
    safe_target = tl.where(valid & (target >= 0) & (target < V), target, 0)
    keep = tl.where(valid, 1.0, 0.0)
    target_logit = tl.load(base + safe_target).to(tl.float32)
    w_t = 1.0
    if HAS_WEIGHT:
        w_t = tl.load(Weight + safe_target).to(tl.float32)
    row_loss = (1.0 - smoothing) * w_t * (lse - target_logit)
    if SMOOTH:
        row_loss += smoothing / V * (total_w * lse - wz)
    tl.store(Loss + row, tl.where(valid, row_loss, 0.0))
    tl.store(Lse + row, lse)
    # Pass 2: the gradient, O(1) values; the caller scales by the mean's 1/denominator in FP32.
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = (1.0 - smoothing) * w_t * (p - tl.where(cols == safe_target, 1.0, 0.0))
        if SMOOTH:
            w = 1.0
            if HAS_WEIGHT:
                w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
            g += smoothing / V * (total_w * p - w)
        tl.store(Grad + row * V + cols, (g * keep).to(Grad.dtype.element_ty), mask=mask)


@triton.jit
def _ce_bias_grad_kernel(Logits, Lse, Targets, GradBias, Weight, TotalW, R, V, ignore_index, smoothing,
                         BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr):
    # Column sums of the row gradients (as _ce_chunk_kernel's), recomputed in FP32 from the logits:
    # summing the stored gradient instead would add up values already rounded to bf16/fp16.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    w_c = tl.zeros([BLOCK_V], tl.float32) + 1.0
    total_w = V * 1.0
    if HAS_WEIGHT:
        w_c = tl.load(Weight + cols, mask=col_ok, other=0.0).to(tl.float32)
        total_w = tl.load(TotalW)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        target = tl.load(Targets + rows, mask=rows < R, other=ignore_index)
        lse = tl.load(Lse + rows, mask=rows < R, other=0.0)
        ok = ((rows < R) & (target != ignore_index))[:, None] & col_ok[None, :]
        x = tl.load(Logits + rows[:, None] * V + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        g = p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        if HAS_WEIGHT:
            valid_t = (rows < R) & (target != ignore_index)
            safe_t = tl.where(valid_t & (target >= 0) & (target < V), target, 0)
            g = g * tl.load(Weight + safe_t, mask=rows < R, other=0.0).to(tl.float32)[:, None]
        g = (1.0 - smoothing) * g
        if SMOOTH:
            g += smoothing / V * (total_w * p - w_c[None, :])
        acc += tl.sum(tl.where(ok, g, 0.0), axis=0)
    tl.store(GradBias + cols, acc, mask=col_ok)


_CE_BLOCK_V = 4096  # vocab values per step of the online softmax; larger vocabularies loop
_BIAS_BLOCK = (16, 128)  # rows x columns of one step of the bias-grad column sums


def cross_entropy_chunk(logits, targets, ignore_index, with_bias, smoothing=0.0, class_weight=None):
    rows, vocab = logits.shape
    logits, targets = logits.contiguous(), targets.contiguous()
    grad = torch.empty_like(logits)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    smooth, has_weight = smoothing != 0.0, class_weight is not None
    # Triton takes no None pointer: without class weights the kernels read none (HAS_WEIGHT=False).
    weight = class_weight.float().contiguous() if has_weight else loss
    total_w = weight.sum().reshape(1) if has_weight else loss  # read on the device: no host sync
    block, warps = _row_block(min(_CE_BLOCK_V, vocab))
    with _on(logits):
        _ce_chunk_kernel[(rows,)](logits, targets, grad, loss, lse, weight, total_w, vocab, ignore_index,
                                  float(smoothing), BLOCK_V=block, SMOOTH=smooth, HAS_WEIGHT=has_weight, num_warps=warps)
        if with_bias:
            grad_bias = torch.empty(vocab, dtype=torch.float32, device=logits.device)
            block_r, block_v = _BIAS_BLOCK
            _ce_bias_grad_kernel[(triton.cdiv(vocab, block_v),)](
                logits, lse, targets, grad_bias, weight, total_w, rows, vocab, ignore_index, float(smoothing),
                BLOCK_R=block_r, BLOCK_V=block_v, SMOOTH=smooth, HAS_WEIGHT=has_weight)
        else:
            grad_bias = grad.new_zeros(0, dtype=torch.float32)
    return loss.sum(), grad, grad_bias
