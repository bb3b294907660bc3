"""The benchmark workloads: three transformers on real text and two synthetic vision/tabular jobs.

``get_workload(name, **overrides)`` is the one entry point; overrides are the fields of that
workload's settings dataclass (``GPTSettings``, ``LlamaSettings``, ``BertSettings``,
``ResNetSettings``, ``MLPSettings``).

>>> wl = get_workload("gpt", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.unit, wl.items_per_batch
('tokens', 64)
"""

from __future__ import annotations

from dataclasses import fields

from ..errors import ConfigError, UnknownWorkloadError
from . import bert, gpt, llama, mlp, resnet
from .base import Batch, Workload, cross_entropy_loss
from .bert import BertSettings
from .data import Corpus, load_corpus, text_batches
from .gpt import GPTSettings
from .llama import LlamaSettings
from .mlp import MLPSettings
from .resnet import ResNetSettings

__all__ = [
    # choosing a workload
    "WORKLOADS",
    "get_workload",
    "settings_class",
    # the contract
    "Workload",
    "Batch",
    "cross_entropy_loss",
    # settings per workload
    "GPTSettings",
    "LlamaSettings",
    "BertSettings",
    "ResNetSettings",
    "MLPSettings",
    # the real-text corpus
    "Corpus",
    "load_corpus",
    "text_batches",
]

_REGISTRY = {
    "gpt": (GPTSettings, gpt.make_workload),
    "llama": (LlamaSettings, llama.make_workload),
    "bert": (BertSettings, bert.make_workload),
    "resnet": (ResNetSettings, resnet.make_workload),
    "mlp": (MLPSettings, mlp.make_workload),
}
WORKLOADS = tuple(_REGISTRY)

#: What each settings annotation accepts as an override (bool is rejected for numbers below).
_ACCEPTS = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "tuple[int, ...]": (tuple, list),
}


def settings_class(name: str) -> type:
    """The settings dataclass of workload ``name`` (its fields are the valid overrides)."""
    if name not in _REGISTRY:
        raise UnknownWorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return _REGISTRY[name][0]


def get_workload(name: str, **overrides) -> Workload:
    """Workload ``name`` with settings ``overrides`` (e.g. ``d=64, T=32``).

    Unknown names raise UnknownWorkloadError; unknown keys or ill-typed values raise ConfigError
    listing the valid keys; out-of-range values raise ConfigError from the settings class.
    """
    cls = settings_class(name)
    _check_overrides(name, cls, overrides)
    return _REGISTRY[name][1](cls(**overrides))


def _check_overrides(name: str, cls: type, overrides: dict) -> None:
    by_name = {f.name: f for f in fields(cls)}
    valid = ", ".join(by_name)
    for key, value in overrides.items():
        if key not in by_name:
            raise ConfigError(f"{name} has no setting {key!r}; valid settings: {valid}")
        accepted = _ACCEPTS[str(by_name[key].type)]
        if isinstance(value, bool) or not isinstance(value, accepted):
            kind = str(by_name[key].type)
            raise ConfigError(f"{name} setting {key}={value!r} must be {kind}; valid settings: {valid}")
