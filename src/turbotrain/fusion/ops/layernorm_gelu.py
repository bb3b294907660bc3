"""LayerNorm followed by GELU (or another activation) as one op.

Stock PyTorch runs the norm, writes its output, and the activation reads it back and saves it for
its own backward. Here one compiled pass normalises and activates; only the input and the per-row
mean and 1/std are saved, and the backward recomputes the normalised value in registers. That is
one activation-sized tensor less kept for backward and two fewer passes over memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._activations import activation, activation_grad, activation_reference, check_activation
from ._kernels import epilogue, use_triton

__all__ = ["layernorm_act", "layernorm_act_reference"]


@epilogue
def _forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, act: str):
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    centered = xf - mean
    rstd = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
    z = centered * rstd
    if weight is not None:
        z = z * weight.float()
    if bias is not None:
        z = z + bias.float()
    return activation(z, act).to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


@epilogue
def _backward(grad: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
              mean: Tensor, rstd: Tensor, act: str):
    rstd = rstd.unsqueeze(-1)
    xhat = (x.float() - mean.unsqueeze(-1)) * rstd
    z = xhat * weight.float() if weight is not None else xhat
    if bias is not None:
        z = z + bias.float()
    dz = grad.float() * activation_grad(z, act)
    dxhat = dz * weight.float() if weight is not None else dz
    dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dz * xhat).sum(0), dz.sum(0)


@torch.library.custom_op("turbotrain::layernorm_act", mutates_args=())
def _layernorm_act(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   act: str) -> tuple[Tensor, Tensor, Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x):
        from . import _triton_kernels

        y, mean, rstd = _triton_kernels.layernorm_act_forward(x2, weight, bias, eps, act)
    else:
        y, mean, rstd = _forward(x2, weight, bias, eps, act)
    return y.view(x.shape), mean, rstd


@_layernorm_act.register_fake
def _(x, weight, bias, eps, act):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("turbotrain::layernorm_act_backward", mutates_args=())
def _layernorm_act_backward(grad: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            mean: Tensor, rstd: Tensor, act: str) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    args = (grad.reshape(-1, n), x.reshape(-1, n), weight, bias, mean, rstd, act)
    if use_triton(x):
        from . import _triton_kernels

        dx, dw, db = _triton_kernels.layernorm_act_backward(*args)
    else:
        dx, dw, db = _backward(*args)
    return dx.view(x.shape), dw, db


@_layernorm_act_backward.register_fake
def _(grad, x, weight, bias, mean, rstd, act):
    n = x.shape[-1]
    return torch.empty_like(x), x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, act = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.act = act


def _autograd_backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.turbotrain.layernorm_act_backward(grad_y, x, weight, bias, mean, rstd, ctx.act)
    dw = dw.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    db = db.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    return dx if ctx.needs_input_grad[0] else None, dw, db, None, None


_layernorm_act.register_autograd(_autograd_backward, setup_context=_setup_context)


def layernorm_act(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5,
                  act: str = "gelu") -> Tensor:
    """act(layer_norm(x over its last dim)) as one op; 'gelu' is the exact erf GELU.

    >>> x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    >>> torch.allclose(layernorm_act(x, w, b), layernorm_act_reference(x, w, b), atol=1e-5)
    True
    """
    check_activation(act)
    return _layernorm_act(x, weight, bias, eps, act)[0]


def layernorm_act_reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            eps: float = 1e-5, act: str = "gelu") -> Tensor:
    """Plain PyTorch twin of :func:`layernorm_act`."""
    return activation_reference(F.layer_norm(x, (x.shape[-1],), weight, bias, eps), act)
