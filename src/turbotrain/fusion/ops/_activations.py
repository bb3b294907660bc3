"""Activations and their derivatives written out, so one compiled kernel can compute both.

Every function upcasts to FP32 and casts back: Inductor does the same inside a kernel, and writing
it out keeps the eager path (TURBOTRAIN_FUSION_KERNELS=eager) numerically identical to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...errors import FusionError

__all__ = ["ACTIVATIONS", "activation", "activation_grad", "check_activation", "activation_of_module"]

#: Names fused ops accept: 'gelu' is the exact (erf) GELU, 'gelu_tanh' the tanh approximation.
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)  # the constant of the tanh GELU approximation
_TANH_C = 0.044715


def check_activation(act: str) -> None:
    if act not in ACTIVATIONS:
        raise FusionError(f"activation {act!r} cannot be fused; use one of {', '.join(ACTIVATIONS)}")


def activation(z: torch.Tensor, act: str) -> torch.Tensor:
    """act(z) in FP32 (the caller casts)."""
    z = z.float()
    if act == "relu":
        return torch.relu(z)
    if act == "gelu":
        return 0.5 * z * (1.0 + torch.erf(z * _SQRT_HALF))
    if act == "gelu_tanh":
        return 0.5 * z * (1.0 + torch.tanh(_TANH_K * (z + _TANH_C * z * z * z)))
    return z * torch.sigmoid(z)  # silu


def activation_grad(z: torch.Tensor, act: str) -> torch.Tensor:
    """d act / dz at z, in FP32."""
    z = z.float()
    if act == "relu":
        return (z > 0).float()
    if act == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _SQRT_HALF))
        return cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    if act == "gelu_tanh":
        t = torch.tanh(_TANH_K * (z + _TANH_C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _TANH_K * (1.0 + 3.0 * _TANH_C * z * z)
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def activation_reference(z: torch.Tensor, act: str) -> torch.Tensor:
    """The stock PyTorch activation, the oracle the fused ops are tested against."""
    if act == "relu":
        return F.relu(z)
    if act == "gelu":
        return F.gelu(z)
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return F.silu(z)


def activation_of_module(module) -> str | None:
    """The fused-op name of an activation module (nn.ReLU/GELU/SiLU), or None if it has none."""
    if type(module) is torch.nn.ReLU:
        return "relu"
    if type(module) is torch.nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if type(module) is torch.nn.SiLU:
        return "silu"
    return None
