"""A fused AdamW: one kernel updates every parameter instead of a loop of small ops per tensor."""

from __future__ import annotations

import warnings

import torch

from ..errors import FusionError

__all__ = ["fused_adamw"]

_WARNED: set[str] = set()


def _fused_supported(params: list[torch.Tensor]) -> tuple[bool, str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    for p in params:
        if p.device.type not in devices:
            return False, f"device {p.device.type!r} has no fused AdamW kernel"
        if not torch.is_floating_point(p):
            return False, f"fused AdamW needs floating-point parameters, got {p.dtype}"
    return True, ""


def fused_adamw(params, **kwargs) -> torch.optim.AdamW:
    """torch.optim.AdamW(fused=True) where every parameter's device has the fused kernel.

    Otherwise the multi-tensor ``foreach`` implementation, with a one-time warning saying why.
    ``params`` may be an iterable of tensors or of param-group dicts, as for any optimizer.

    >>> opt = fused_adamw(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    >>> opt.defaults["fused"] or opt.defaults["foreach"]
    True
    """
    if "fused" in kwargs or "foreach" in kwargs:
        raise FusionError("fused_adamw chooses fused/foreach itself; call torch.optim.AdamW to set them")
    groups = list(params)
    flat = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    ok, why = _fused_supported(flat)
    if ok:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"fused_adamw: {why}; using foreach AdamW instead", stacklevel=2)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)
