"""The registry of benchmark configs: every row of the ladder is one named recipe.

A config is a ``build(workload, device) -> Trainer`` function. The Trainer owns its model and
optimizer and exposes ``step(batch) -> loss``, ``eval_loss(batches) -> float``, ``model`` and
``compute_dtype`` ('fp32', 'bf16' or 'fp16': the dtype the matmuls run in, which picks the peak
MFU is divided by). Each config runs in its own worker process, so a build may do anything
(compile, patch modules) without leaking into the next row.

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
    "CONFIG_MODULES",
    "COMPUTE_DTYPES",
    "BASELINE",
]

#: Modules whose import registers configs; load_config_modules() imports them (and the plugins).
CONFIG_MODULES = ("turbotrain.bench.peers", "turbotrain.bench.tt")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
#: The row speed-ups and val-loss deltas are relative to.
BASELINE = "fp32-eager"

#: One set of AdamW hyper-parameters for every row, so losses differ only by the config under test.
#: The learning rate is constant (no warm-up or decay): the ladder runs tens of steps to compare
#: configs on one trajectory, not to train well, and a schedule is one more thing each trainer
#: (and Engine) would have to step identically.
OPTIMIZER_SETTINGS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_optimizer(params, **extra) -> torch.optim.AdamW:
    """AdamW with OPTIMIZER_SETTINGS; ``extra`` only for implementation choices such as fused=True."""
    return torch.optim.AdamW(params, **OPTIMIZER_SETTINGS, **extra)


class Trainer(Protocol):
    """What a config's build returns."""

    model: torch.nn.Module
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

    def is_default_on(self, device: str) -> bool:
        return self.default if isinstance(self.default, bool) else device in self.default

    def dtype_on(self, device: str) -> str:
        return self.dtype if isinstance(self.dtype, str) else dict(self.dtype)[device]


_REGISTRY: dict[str, BenchConfig] = {}


def register_config(name: str, description: str, build: Callable | None = None, *,
                    default: bool | tuple[str, ...] = True, group: str = "turbotrain", replace: bool = False,
                    dtype: str | dict[str, str] = "fp32", fp32_twin: str | None = None):
    """Register a config; without ``build`` it returns a decorator. Names are unique unless ``replace``.

    ``dtype`` is the matmul dtype ('fp32', 'bf16', 'fp16', or {device: dtype}); ``fp32_twin`` names
    the row that stands in for this one where that dtype is slower than fp32 (see BenchConfig).
    """
    if build is None:
        return lambda fn: register_config(name, description, fn, default=default, group=group, replace=replace,
                                          dtype=dtype, fp32_twin=fp32_twin)
    if not name or any(c in name for c in " ,"):
        raise ConfigError(f"config name {name!r} must be non-empty without spaces or commas (--configs splits on ',')")
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
    _REGISTRY[name] = BenchConfig(name, description, build, default, group, dtype, fp32_twin)
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
    """The config called ``name``; UnknownWorkloadError lists the valid names otherwise."""
    load_config_modules()
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
        get_config(name)
        if name not in out:
            out.append(name)
    return out
