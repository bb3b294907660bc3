"""residual + dropout(x + bias) as one op (the end of every transformer sub-block).

Stock PyTorch makes four passes (bias add, draw, dropout, residual add); here the uniforms are drawn
and then one compiled pass thresholds, scales and adds, and only a 1-byte mask is saved.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import FusionError
from ._kernels import epilogue

__all__ = ["bias_dropout_residual", "bias_dropout_residual_reference"]


def _biased(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.float() + bias.float() if bias is not None else x.float()


@epilogue
def _forward_uniform(x: Tensor, bias: Optional[Tensor], residual: Tensor, uniform: Tensor, p: float):
    keep = uniform >= p
    out = residual.float() + torch.where(keep, _biased(x, bias) / (1.0 - p), 0.0)
    return out.to(residual.dtype), keep


@epilogue
def _forward_masked(x: Tensor, bias: Optional[Tensor], residual: Tensor, keep: Tensor, p: float):
    out = residual.float() + torch.where(keep, _biased(x, bias) / (1.0 - p), 0.0)
    return out.to(residual.dtype)


@epilogue
def _forward_no_dropout(x: Tensor, bias: Optional[Tensor], residual: Tensor):
    return (residual.float() + _biased(x, bias)).to(residual.dtype)


@epilogue
def _backward(grad: Tensor, keep: Tensor, p: float):
    gx = torch.where(keep, grad.float() / (1.0 - p), 0.0)
    return gx.to(grad.dtype), gx.reshape(-1, grad.shape[-1]).sum(0)


@torch.library.custom_op("turbotrain::bias_dropout_residual", mutates_args=())
def _op(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float,
        mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    if p == 0.0:
        return _forward_no_dropout(x, bias, residual), x.new_empty(0, dtype=torch.bool)
    if mask is None:
        # The uniforms come from eager torch.rand: its vectorised generator is ~2x faster here than
        # the per-element RNG Inductor compiles into a CPU kernel, and it follows torch.manual_seed.
        return _forward_uniform(x, bias, residual, torch.rand_like(x, dtype=torch.float32), p)
    keep = mask.to(torch.bool, copy=True)  # a copy: a custom op's outputs may not alias its inputs
    return _forward_masked(x, bias, residual, keep, p), keep


@_op.register_fake
def _(x, bias, residual, p, mask):
    keep = x.new_empty(0 if p == 0.0 else x.shape, dtype=torch.bool)
    return torch.empty_like(residual), keep


@torch.library.custom_op("turbotrain::bias_dropout_residual_backward", mutates_args=())
def _op_backward(grad: Tensor, keep: Tensor, p: float) -> tuple[Tensor, Tensor]:
    return _backward(grad, keep, p)


@_op_backward.register_fake
def _(grad, keep, p):
    return torch.empty_like(grad), grad.new_empty(grad.shape[-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.p = inputs[3]
    ctx.bias_dtype = inputs[1].dtype if inputs[1] is not None else None


def _autograd_backward(ctx, grad, grad_mask):
    (keep,) = ctx.saved_tensors
    if ctx.p == 0.0:  # no mask: the input grad is the output grad itself
        gx, gb = grad, grad.reshape(-1, grad.shape[-1]).float().sum(0)
    else:
        gx, gb = torch.ops.turbotrain.bias_dropout_residual_backward(grad.contiguous(), keep, ctx.p)
    gb = gb.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return gx, gb, grad, None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def bias_dropout_residual(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float = 0.0,
                          training: bool = True, mask: Optional[Tensor] = None) -> Tensor:
    """residual + dropout(x + bias, p). ``mask`` (True = keep) replaces the random draw, for tests.

    >>> x, r = torch.randn(2, 4), torch.randn(2, 4)
    >>> torch.allclose(bias_dropout_residual(x, None, r, 0.0), r + x)
    True
    """
    if not 0.0 <= p < 1.0:
        raise FusionError(f"dropout p={p} is not valid; it must be in [0, 1)")
    if x.shape != residual.shape:
        raise FusionError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    return _op(x.contiguous(), bias, residual.contiguous(), p if training else 0.0, mask)[0]


def bias_dropout_residual_reference(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float = 0.0,
                                    training: bool = True, mask: Optional[Tensor] = None) -> Tensor:
    """Plain PyTorch twin of :func:`bias_dropout_residual`."""
    h = x + bias if bias is not None else x
    if mask is not None and training and p > 0.0:
        return residual + h * mask / (1.0 - p)
    return residual + F.dropout(h, p, training)
