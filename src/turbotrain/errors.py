"""Errors turbotrain raises on bad input.

Every error names the problem and the fix, so a user never has to read the source to recover.
"""

__all__ = [
    "TurbotrainError",
    "ConfigError",
    "UnknownWorkloadError",
    "CheckpointError",
    "HardwareError",
    "DistributedError",
    "LossScaleError",
    "FusionError",
]


class TurbotrainError(Exception):
    """Base class of every error turbotrain raises on purpose."""


class ConfigError(TurbotrainError, ValueError):
    """A configuration value is invalid; the message lists the valid choices."""


class UnknownWorkloadError(ConfigError):
    """A workload or benchmark config name is not registered."""


class CheckpointError(TurbotrainError):
    """A checkpoint cannot be written or read."""


class HardwareError(TurbotrainError):
    """A feature was asked for that the current device or backend cannot run."""


class DistributedError(TurbotrainError):
    """torch.distributed is set up wrongly (missing variables, mismatched ranks)."""


class LossScaleError(TurbotrainError):
    """The dynamic loss scale sits at its floor and the model still overflows."""


class FusionError(TurbotrainError):
    """A fusion pattern or fused module was asked for in a way that cannot work."""


def check_choice(name: str, value, choices) -> None:
    """Raise ConfigError naming ``name`` and the valid choices when ``value`` is not one of them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {listed}")


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    """Raise ConfigError when a numeric setting is not (strictly) positive."""
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value!r} is not valid; it must be a number {bound}")
