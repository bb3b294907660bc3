"""Errors turbotrain raises on bad input.

Every error names the problem and the fix, so a user never has to read the source to recover.
The ``check_*`` helpers test a setting's type before its value, so a wrong type gets the same
clear ConfigError as a wrong value instead of a TypeError from a comparison.
"""

import numbers

__all__ = [
    "TurbotrainError",
    "ConfigError",
    "UnknownWorkloadError",
    "CheckpointError",
    "HardwareError",
    "DistributedError",
    "LossScaleError",
    "FusionError",
    "MetaInitError",
    "CheckpointWarning",
    "check_choice",
    "check_bool",
    "check_number",
    "check_positive",
]


class TurbotrainError(Exception):
    """Base class of every error turbotrain raises on purpose."""


class ConfigError(TurbotrainError, ValueError):
    """A configuration value is invalid; the message lists the valid choices."""


class UnknownWorkloadError(ConfigError):
    """A workload or benchmark config name is not registered."""


class CheckpointError(TurbotrainError):
    """A checkpoint cannot be written or read."""


class CheckpointWarning(UserWarning):
    """A checkpoint was read, but without a guarantee it would normally carry (e.g. no content hash)."""


class HardwareError(TurbotrainError):
    """A feature was asked for that the current device or backend cannot run."""


class DistributedError(TurbotrainError):
    """torch.distributed is set up wrongly (missing variables, mismatched ranks)."""


class LossScaleError(TurbotrainError):
    """The dynamic loss scale sits at its floor and the model still overflows."""


class FusionError(TurbotrainError):
    """A fusion pattern or fused module was asked for in a way that cannot work."""


class MetaInitError(ConfigError):
    """A model built on the meta device cannot be materialised as asked (docs/parallel.md, "Building on the
    meta device")."""


def check_choice(name: str, value, choices) -> None:
    """Raise ConfigError naming ``name`` and the valid choices when ``value`` is not one of them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {listed}")


def check_bool(name: str, value) -> None:
    """Raise ConfigError unless ``value`` is a real bool: ``"no"`` or ``1`` would switch a flag on silently.

    >>> check_bool("nan_check", True)
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not valid; it must be True or False (got {type(value).__name__})")


def check_number(name: str, value, *, integer: bool = False, minimum=None, maximum=None,
                 exclusive: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a number (not a bool or a string) within the bounds.

    ``exclusive`` makes both bounds strict. NaN fails every bound.

    >>> check_number("accumulate", 4, integer=True, minimum=1)
    """
    kind = "an integer" if integer else "a number"
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if exclusive else '>='} {minimum}")
    if maximum is not None:
        bounds.append(f"{'<' if exclusive else '<='} {maximum}")
    wanted = f"{kind} {' and '.join(bounds)}".rstrip()
    numeric = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise ConfigError(f"{name}={value!r} is not valid; it must be {wanted} (got {type(value).__name__})")
    if exclusive:
        ok = (minimum is None or value > minimum) and (maximum is None or value < maximum)
    else:
        ok = (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        raise ConfigError(f"{name}={value!r} is not valid; it must be {wanted}")


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    """Raise ConfigError when a numeric setting is not (strictly) positive."""
    check_number(name, value, minimum=0, exclusive=not allow_zero)
