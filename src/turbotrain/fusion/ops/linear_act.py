"""Linear + bias + activation as one op: y = act(x @ W^T + b).

Forward: the bias rides inside the GEMM (addmm) and the activation runs as one compiled pass.
Backward: one compiled pass computes dz = g * act'(z) *and* the bias gradient sum(dz) together, then
two GEMMs give dx and dW. The pre-activation z is the one tensor saved, as in stock autograd.
"""

from __future__ import annotations

from math import prod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ._activations import activation, activation_grad, activation_reference, check_activation
from ._kernels import epilogue

__all__ = ["linear_act", "linear_act_reference"]


@epilogue
def _act_forward(z: Tensor, act: str) -> Tensor:
    return activation(z, act).to(z.dtype)


@epilogue
def _act_backward(grad: Tensor, z: Tensor, act: str) -> tuple[Tensor, Tensor]:
    dz = grad.float() * activation_grad(z, act)
    return dz.to(z.dtype), dz.sum(0)


@torch.library.custom_op("turbotrain::linear_act", mutates_args=())
def _linear_act(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: str) -> tuple[Tensor, Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    z = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
    y = _act_forward(z, act)
    out_shape = (*x.shape[:-1], weight.shape[0])
    return y.view(out_shape), z.view(out_shape)


@_linear_act.register_fake
def _(x, weight, bias, act):
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return out, torch.empty_like(out)


@torch.library.custom_op("turbotrain::linear_act_backward", mutates_args=())
def _linear_act_backward(
    grad: Tensor, x: Tensor, weight: Tensor, pre: Tensor, act: str, need_x: bool, need_w: bool
) -> tuple[Tensor, Tensor, Tensor]:
    n = weight.shape[0]
    dz, db = _act_backward(grad.reshape(-1, n), pre.reshape(-1, n), act)
    x2 = x.reshape(-1, x.shape[-1])
    dx = torch.mm(dz, weight).view(x.shape) if need_x else x.new_empty(0)
    dw = torch.mm(dz.t(), x2) if need_w else weight.new_empty(0)
    return dx, dw, db.to(weight.dtype)


@_linear_act_backward.register_fake
def _(grad, x, weight, pre, act, need_x, need_w):
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    dw = torch.empty_like(weight) if need_w else weight.new_empty(0)
    return dx, dw, weight.new_empty(weight.shape[0])


def _setup_context(ctx, inputs, output):
    x, weight, bias, act = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.act = act
    ctx.has_bias = bias is not None


def _backward(ctx, grad_y, grad_pre):
    # grad_pre is always None/zero: the pre-activation is internal and never handed to the user.
    x, weight, pre = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw, db = torch.ops.turbotrain.linear_act_backward(grad_y, x, weight, pre, ctx.act, need_x, need_w)
    return (dx if need_x else None, dw if need_w else None, db if ctx.has_bias else None, None)


_linear_act.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.turbotrain.linear_act)
def _linear_act_flops(x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * prod(x_shape[:-1]) * w_shape[0] * w_shape[1]  # 2 FLOPs per multiply-add


@register_flop_formula(torch.ops.turbotrain.linear_act_backward)
def _linear_act_backward_flops(grad_shape, x_shape, w_shape, pre_shape, act, need_x, need_w, **kw) -> int:
    gemm = 2 * prod(x_shape[:-1]) * w_shape[0] * w_shape[1]
    return gemm * (int(need_x) + int(need_w))


def linear_act(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: str) -> Tensor:
    """act(x @ weight^T + bias) as one fused op.

    >>> x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    >>> torch.allclose(linear_act(x, w, b, "relu"), linear_act_reference(x, w, b, "relu"), atol=1e-5)
    True
    """
    check_activation(act)
    return _linear_act(x, weight, bias, act)[0]


def linear_act_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: str) -> Tensor:
    """Plain PyTorch twin of :func:`linear_act`."""
    return activation_reference(F.linear(x, weight, bias), act)
