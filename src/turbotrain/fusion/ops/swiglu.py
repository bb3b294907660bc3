"""SwiGLU MLP: down(silu(x @ Wg^T) * (x @ Wu^T)), with gate and up as ONE GEMM.

The gate and up weights live in one (2*hidden, d) matrix, so the input is read once and one large
GEMM replaces two. The epilogue silu(g) * u is one compiled pass; only the GEMM output is saved and
silu(g) is recomputed in the backward (stock autograd saves g, u and silu(g)).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._kernels import epilogue, use_triton

__all__ = ["swiglu", "swiglu_reference", "swiglu_mlp", "swiglu_mlp_reference"]


@epilogue
def _forward(gate_up: Tensor) -> Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(gate_up.dtype)


@epilogue
def _backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    grad = grad.float()
    d_gate = grad * u * s * (1.0 + g * (1.0 - s))
    d_up = grad * g * s
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


@torch.library.custom_op("turbotrain::swiglu", mutates_args=())
def _swiglu(gate_up: Tensor) -> Tensor:
    if use_triton(gate_up):
        from . import _triton_kernels

        return _triton_kernels.swiglu_forward(gate_up)
    return _forward(gate_up)


@_swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("turbotrain::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    if use_triton(gate_up):
        from . import _triton_kernels

        return _triton_kernels.swiglu_backward(grad, gate_up)
    return _backward(grad, gate_up)


@_swiglu_backward.register_fake
def _(grad, gate_up):
    return torch.empty_like(gate_up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _autograd_backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.turbotrain.swiglu_backward(grad.contiguous(), gate_up)


_swiglu.register_autograd(_autograd_backward, setup_context=_setup_context)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(g) * u where ``gate_up = cat([g, u], -1)``.

    >>> gu = torch.randn(4, 16)
    >>> torch.allclose(swiglu(gu), swiglu_reference(gu), atol=1e-6)
    True
    """
    return _swiglu(gate_up.contiguous())


def swiglu_reference(gate_up: Tensor) -> Tensor:
    """Plain PyTorch twin of :func:`swiglu`."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_mlp(x: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
               gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None) -> Tensor:
    """The whole SwiGLU MLP with the concatenated (2*hidden, d) gate/up weight."""
    return F.linear(swiglu(F.linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)


def swiglu_mlp_reference(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor,
                         gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
                         down_bias: Optional[Tensor] = None) -> Tensor:
    """Plain PyTorch twin of :func:`swiglu_mlp`, with separate gate and up weights."""
    hidden = F.silu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)
    return F.linear(hidden, down_weight, down_bias)
