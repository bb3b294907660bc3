"""The registry of benchmark configs: every row of the ladder is one named recipe.

A config is a ``build(workload, device) -> Trainer`` function. The Trainer owns its model and
optimizer and exposes ``step(batch) -> loss``, ``eval_loss(batches) -> float``, ``model``,
``optimizer`` and ``compute_dtype`` ('fp32', 'bf16' or 'fp16': the dtype the matmuls run in, which
picks the peak MFU is divided by). Each config runs in its own long-lived worker process, so a
build may do anything (compile, patch modules) without leaking into another row.

Every row builds its optimizer with ``make_optimizer``: one AdamW implementation (fused) and one
set of hyper-parameters for the whole ladder, so no row is credited with another's optimizer.
Each row also declares the val-loss tolerance it must stay within of the fp32 row
(``loss_tolerance``, by default ``LOSS_TOLERANCE`` of its compute dtype); a row outside it is
marked FAILED in the report.

Adding a row takes one call in any module listed in CONFIG_MODULES (or named in the
TURBOTRAIN_BENCH_PLUGINS environment variable, comma-separated, for configs outside turbotrain):

>>> from turbotrain.bench.configs import register_config, make_optimizer
>>> @register_config("my-row", "my trick on top of fp32", default=False, group="example")
... def build_my_row(workload, device):
...     from turbotrain.bench.peers import PeerTrainer
...     return PeerTrainer(workload, device)
>>> get_config("my-row").group
'example'
>>> unregister_config("my-row")
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from ..errors import ConfigError, UnknownWorkloadError

__all__ = [
    "Trainer",
    "BenchConfig",
    "register_config",
    "unregister_config",
    "get_config",
    "list_configs",
    "default_configs",
    "load_config_modules",
    "resolve_names",
    "make_optimizer",
    "OPTIMIZER_SETTINGS",
    "OPTIMIZER_IMPLEMENTATION",
    "CONFIG_MODULES",
    "COMPUTE_DTYPES",
    "LOSS_TOLERANCE",
    "BASELINE",
    "REFERENCE",
    "INSTANCE_MARK",
    "config_of",
]

#: Modules whose import registers configs; load_config_modules() imports them (and the plugins).
#: turbotrain.tune.row: rows built from a whole Config (tune candidates, ``bench --config-file``).
CONFIG_MODULES = ("turbotrain.bench.peers", "turbotrain.bench.tt", "turbotrain.tune.row")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
#: The fp32 row: speed-ups, val-loss deltas and every row's loss check are relative to it.
BASELINE = "fp32-eager"
#: The strongest peer (torch.compile over the training step): every row's ratio_vs_ref, with its
#: bootstrap interval, is taken against it, and it runs twice (the A/A pair) to show the noise.
REFERENCE = "torch-compile-step"
#: The row ``bench --config-file`` adds with the Config of a file (turbotrain tune's choice).
TUNED_ROW = "tt-tuned"
#: Separates a config name from an instance number in a row name: ``torch-compile-step#2`` is the
#: second worker of that config (the A/A row). Reserved, so no config name may contain it.
INSTANCE_MARK = "#"

#: Val-loss tolerance per compute dtype, in percent of the fp32 row's val loss. fp32 rows differ
#: from fp32-eager only by summation order (fused kernels, compiled graphs): after tens of steps
#: that moves the loss by ~1e-4 relative, so 0.2% leaves room without hiding a bug. bf16 keeps 8
#: mantissa bits: rounding the activations (and, in the master-weight modes, the weights) moves the
#: short-run loss by a few tenths of a percent, so 1% is the bar. fp16 has 3 more mantissa bits
#: than bf16 but a loss scale that may skip steps; the same 1%.
LOSS_TOLERANCE = {"fp32": 0.2, "bf16": 1.0, "fp16": 1.0}

#: One set of AdamW hyper-parameters for every row, so losses differ only by the config under test.
#: The learning rate is constant (no warm-up or decay): the ladder runs tens of steps to compare
#: configs on one trajectory, not to train well, and a schedule is one more thing each trainer
#: (and Engine) would have to step identically.
OPTIMIZER_SETTINGS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


#: The implementation every row's AdamW uses. fused=True is one kernel over params, grads and both
#: moments (CPU and CUDA, fp32/bf16/fp16 params since torch 2.4) and is what a careful user picks;
#: the ladder used to give it to some rows and foreach to others, which credited those rows with
#: the optimizer's speed. Now no row can: make_optimizer takes no implementation arguments.
OPTIMIZER_IMPLEMENTATION = {"fused": True}


def make_optimizer(params) -> torch.optim.AdamW:
    """The ladder's AdamW: OPTIMIZER_SETTINGS with OPTIMIZER_IMPLEMENTATION, for every row."""
    return torch.optim.AdamW(params, **OPTIMIZER_SETTINGS, **OPTIMIZER_IMPLEMENTATION)


def config_of(row: str) -> str:
    """The registered config a ladder row runs: ``'torch-compile-step#2'`` -> ``'torch-compile-step'``."""
    return row.split(INSTANCE_MARK, 1)[0]


class Trainer(Protocol):
    """What a config's build returns."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    compute_dtype: str

    def step(self, batch) -> torch.Tensor:
        """One optimizer step on ``batch``; returns the (unscaled, detached) loss."""

    def eval_loss(self, batches) -> float:
        """Mean loss over ``batches`` without gradients, in the config's precision."""


@dataclass(frozen=True)
class BenchConfig:
    """One registered row."""

    name: str
    description: str
    """One line shown in the report."""
    build: Callable
    """build(workload, device: str) -> Trainer."""
    default: bool | tuple[str, ...] = True
    """In the default ladder: True, False, or the device types ('cpu', 'cuda') where it is."""
    group: str = "turbotrain"
    """'peer' for plain-PyTorch recipes, 'turbotrain' for Engine rows, or a feature's name."""
    dtype: str | tuple[tuple[str, str], ...] = "fp32"
    """The dtype its matmuls run in: one name, or ((device, dtype), ...) where it depends on the device."""
    fp32_twin: str | None = None
    """The row the default ladder runs instead where this row's dtype is slower than fp32 (a CPU
    without native bf16 matmul); None when an fp32 row already covers it."""
    loss_tolerance: float | None = None
    """Percent of the fp32 row's val loss this row's val loss may differ by before it is FAILED;
    None for LOSS_TOLERANCE of its compute dtype."""

    def is_default_on(self, device: str) -> bool:
        return self.default if isinstance(self.default, bool) else device in self.default

    def dtype_on(self, device: str) -> str:
        return self.dtype if isinstance(self.dtype, str) else dict(self.dtype)[device]

    def tolerance_on(self, device: str) -> float:
        """The val-loss tolerance (percent of the fp32 row's) this row declares on ``device``."""
        return self.loss_tolerance if self.loss_tolerance is not None else LOSS_TOLERANCE[self.dtype_on(device)]


_REGISTRY: dict[str, BenchConfig] = {}


def register_config(name: str, description: str, build: Callable | None = None, *,
                    default: bool | tuple[str, ...] = True, group: str = "turbotrain", replace: bool = False,
                    dtype: str | dict[str, str] = "fp32", fp32_twin: str | None = None,
                    loss_tolerance: float | None = None):
    """Register a config; without ``build`` it returns a decorator. Names are unique unless ``replace``.

    ``dtype`` is the matmul dtype ('fp32', 'bf16', 'fp16', or {device: dtype}); ``fp32_twin`` names
    the row that stands in for this one where that dtype is slower than fp32; ``loss_tolerance``
    overrides the dtype's val-loss tolerance (see BenchConfig).
    """
    if build is None:
        return lambda fn: register_config(name, description, fn, default=default, group=group, replace=replace,
                                          dtype=dtype, fp32_twin=fp32_twin, loss_tolerance=loss_tolerance)
    if not name or any(c in name for c in (" ", ",", INSTANCE_MARK)):
        raise ConfigError(f"config name {name!r} must be non-empty without spaces, commas (--configs splits on ',') "
                          f"or {INSTANCE_MARK!r} (it numbers a config's second worker, as in A/A rows)")
    if loss_tolerance is not None and (isinstance(loss_tolerance, bool) or not isinstance(loss_tolerance, (int, float))
                                       or loss_tolerance <= 0):
        raise ConfigError(f"loss_tolerance={loss_tolerance!r} of config {name!r} must be a percentage > 0 (or None)")
    if name in _REGISTRY and not replace:
        raise ConfigError(f"benchmark config {name!r} is already registered; pick another name or pass replace=True")
    if not isinstance(default, bool):
        default = tuple(default)
        for d in default:
            if d not in ("cpu", "cuda"):
                raise ConfigError(f"default device {d!r} of config {name!r} must be 'cpu' or 'cuda'")
    for d in ([dtype] if isinstance(dtype, str) else dtype.values()):
        if d not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype {d!r} of config {name!r} must be one of {', '.join(COMPUTE_DTYPES)}")
    dtype = dtype if isinstance(dtype, str) else tuple(sorted(dtype.items()))
    _REGISTRY[name] = BenchConfig(name, description, build, default, group, dtype, fp32_twin, loss_tolerance)
    return build


def unregister_config(name: str) -> None:
    """Remove a config (tests and notebooks that register throw-away rows)."""
    _REGISTRY.pop(name, None)


def load_config_modules() -> None:
    """Import CONFIG_MODULES and $TURBOTRAIN_BENCH_PLUGINS so every config is registered."""
    plugins = [m.strip() for m in os.environ.get("TURBOTRAIN_BENCH_PLUGINS", "").split(",") if m.strip()]
    for module in (*CONFIG_MODULES, *plugins):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"benchmark config module {module!r} cannot be imported ({exc}); "
                              "fix it or remove it from TURBOTRAIN_BENCH_PLUGINS") from exc


def list_configs(group: str | None = None) -> list[BenchConfig]:
    """Registered configs in registration order (the ladder's order), optionally of one group."""
    load_config_modules()
    return [c for c in _REGISTRY.values() if group is None or c.group == group]


def get_config(name: str) -> BenchConfig:
    """The config called ``name`` (or run by row ``name``, e.g. an A/A ``...#2``); UnknownWorkloadError
    lists the valid names otherwise."""
    load_config_modules()
    name = config_of(name)
    if name not in _REGISTRY:
        raise UnknownWorkloadError(f"unknown benchmark config {name!r}; valid configs: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def default_configs(device: str) -> list[str]:
    """Names of the configs the ladder runs on ``device`` when --configs is not given."""
    return [c.name for c in list_configs() if c.is_default_on(device)]


def resolve_names(names: Iterable[str]) -> list[str]:
    """Validate a --configs list (duplicates dropped, order kept)."""
    out: list[str] = []
    for name in names:
        name = get_config(name).name  # a row name ('...#2') names its config
        if name not in out:
            out.append(name)
    return out
