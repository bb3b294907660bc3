"""Configuration of the dynamic loss scaler."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_number

__all__ = ["LossScaleConfig", "PRECISIONS"]

#: Every value ``Config(precision=...)`` accepts.
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "auto")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (bf16 has fp32's exponent range and needs none)."""

    init_scale: float = 2.0**16
    """Scale at the first step: large enough that small fp16 gradients do not flush to zero."""
    min_scale: float = 2.0**10
    """Floor. A model that still overflows here makes inf/NaN whatever the scale."""
    max_scale: float = 2.0**24
    """Ceiling, so long runs without overflow cannot grow the scale until the loss itself overflows."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier on overflow (once hysteresis is used up)."""
    growth_interval: int = 2000
    """Clean optimizer steps in a row before the scale grows."""
    hysteresis: int = 1
    """Overflows tolerated (step still skipped) before the scale backs off; 1 backs off at once."""
    max_floor_overflows: int = 10
    """Consecutive overflows at ``min_scale`` before LossScaleError is raised."""

    def __post_init__(self):
        # Every field's type and range first, so the bounds check below compares numbers only.
        for name in ("init_scale", "min_scale", "max_scale"):
            check_number(name, getattr(self, name), minimum=0, exclusive=True)
        check_number("growth_factor", self.growth_factor, minimum=1, exclusive=True)
        check_number("backoff_factor", self.backoff_factor, minimum=0, maximum=1, exclusive=True)
        for name in ("growth_interval", "hysteresis", "max_floor_overflows"):
            check_number(name, getattr(self, name), integer=True, minimum=1)
        if not (self.min_scale <= self.init_scale <= self.max_scale):
            raise ConfigError(
                f"loss scale bounds must satisfy min_scale <= init_scale <= max_scale; got "
                f"{self.min_scale} <= {self.init_scale} <= {self.max_scale}"
            )
