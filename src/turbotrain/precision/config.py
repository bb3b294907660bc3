"""Configuration of the dynamic loss scaler."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_positive

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
        for name in ("init_scale", "min_scale", "max_scale", "growth_factor"):
            check_positive(name, getattr(self, name))
        if not (self.min_scale <= self.init_scale <= self.max_scale):
            raise ConfigError(
                f"loss scale bounds must satisfy min_scale <= init_scale <= max_scale; got "
                f"{self.min_scale} <= {self.init_scale} <= {self.max_scale}"
            )
        if self.growth_factor <= 1.0:
            raise ConfigError(f"growth_factor={self.growth_factor} must be > 1")
        if not (0.0 < self.backoff_factor < 1.0):
            raise ConfigError(f"backoff_factor={self.backoff_factor} must be in (0, 1)")
        for name in ("growth_interval", "hysteresis", "max_floor_overflows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
