"""Bounded dynamic loss scaling with hysteresis.

fp16 has a 5-bit exponent: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
scale lifts them into range; an overflow (inf/NaN in any gradient) skips the step and shrinks the
scale. The scale lives in [min_scale, max_scale]: pinned at the floor, a model that still
overflows makes inf/NaN on its own and no scale will save it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..errors import LossScaleError
from .config import LossScaleConfig

__all__ = ["DynamicLossScaler", "unscale_and_check_"]


def unscale_and_check_(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply ``grads`` in place by ``inv_scale``; return a 0-d float tensor, 1.0 if any is non-finite.

    One fused kernel per (device, dtype) group, accumulated on device: no per-tensor host sync.
    """
    if not grads:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    found = []
    for (device, _), tensors in groups.items():
        found_inf = torch.zeros(1, device=device)
        inv = torch.full((1,), inv_scale, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv)
        found.append(found_inf)
    first = found[0].device
    return torch.stack([f.to(first) for f in found]).amax().reshape(())


class DynamicLossScaler:
    """Dynamic loss scale: grow after ``growth_interval`` clean steps, back off after overflows.

    >>> s = DynamicLossScaler(LossScaleConfig(init_scale=1024.0, min_scale=1.0, growth_interval=2))
    >>> s.update(found_inf=True), s.scale
    (True, 512.0)
    >>> s.update(found_inf=False), s.update(found_inf=False), s.scale
    (False, False, 1024.0)
    """

    def __init__(self, config: LossScaleConfig | None = None):
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.init_scale)
        self._growth_tracker = 0
        self._hysteresis_left = self.config.hysteresis
        self._floor_overflows = 0
        self.overflows = 0
        """Optimizer steps skipped because of inf/NaN gradients, over the whole run."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Unscale gradients in place (FP32 master grads, so no precision is lost) and flag inf/NaN."""
        return unscale_and_check_(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> bool:
        """Advance the scale after one optimizer step; return True when that step must be skipped."""
        cfg = self.config
        if not found_inf:
            self._floor_overflows = 0
            self._growth_tracker += 1
            if self._growth_tracker >= cfg.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_left = cfg.hysteresis
                self.scale = min(self.scale * cfg.growth_factor, cfg.max_scale)
            return False
        self.overflows += 1
        self._growth_tracker = 0
        if self.scale <= cfg.min_scale:
            self._floor_overflows += 1
            if self._floor_overflows >= cfg.max_floor_overflows:
                raise LossScaleError(
                    f"the loss scale has sat at its floor ({cfg.min_scale:g}) for "
                    f"{self._floor_overflows} overflowing steps in a row: the model makes inf/NaN "
                    "regardless of scaling. Find the first module that does with "
                    "turbotrain.diagnose.find_nonfinite(model, loss_fn, batch) or "
                    "`turbotrain diagnose nan`, then keep it FP32 or use bf16."
                )
        self._hysteresis_left -= 1
        if self._hysteresis_left <= 0:
            self._hysteresis_left = cfg.hysteresis
            self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
        return True

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
            "floor_overflows": self._floor_overflows,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._floor_overflows = int(state["floor_overflows"])
        self.overflows = int(state["overflows"])
