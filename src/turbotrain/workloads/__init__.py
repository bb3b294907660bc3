"""The benchmark workloads: transformers on real text, synthetic vision/tabular jobs, and foreign models.

``get_workload(name, **overrides)`` is the one entry point; overrides are the fields of that
workload's settings dataclass (``GPTSettings``, ``LlamaSettings``, ``BertSettings``,
``ResNetSettings``, ``MLPSettings``, ``HFSettings``, ``HFBertSettings``, ``HFAutoSettings``).

Foreign workloads are models turbotrain was not shaped around: ``user-gpt`` (a GPT in a user's
own naming, with its own loss function) and ``hf-llama``/``hf-gpt2``/``hf-bert`` (transformers
models with dict batches and their own ``labels=`` loss; transformers is imported when one is
built, ``pip install 'turbotrain[hf]'``). ``hf:<model_type>`` (``hf:qwen2``, ``hf:mistral``,
``hf:roberta``, ...) builds any transformers causal- or masked-LM family from its own config at the
same shape fields (``HFAutoSettings``).

>>> wl = get_workload("gpt", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.unit, wl.items_per_batch
('tokens', 64)
"""

from __future__ import annotations

from dataclasses import fields

from ..errors import ConfigError, UnknownWorkloadError
from . import bert, gpt, hf, llama, mlp, resnet, user_gpt
from .base import Batch, Workload, cross_entropy_loss, user_loss
from .bert import BertSettings
from .data import Corpus, load_corpus, text_batches
from .gpt import GPTSettings
from .hf import HFAutoSettings, HFBertSettings, HFSettings
from .llama import LlamaSettings
from .mlp import MLPSettings
from .resnet import ResNetSettings

__all__ = [
    # choosing a workload
    "WORKLOADS",
    "NATIVE_WORKLOADS",
    "FOREIGN_WORKLOADS",
    "get_workload",
    "settings_class",
    # the contract
    "Workload",
    "Batch",
    "cross_entropy_loss",
    "user_loss",
    # settings per workload
    "GPTSettings",
    "LlamaSettings",
    "BertSettings",
    "ResNetSettings",
    "MLPSettings",
    "HFSettings",
    "HFBertSettings",
    "HFAutoSettings",
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
    "user-gpt": (GPTSettings, user_gpt.make_workload),
    "hf-llama": (HFSettings, hf.make_llama),
    "hf-gpt2": (HFSettings, hf.make_gpt2),
    "hf-bert": (HFBertSettings, hf.make_bert),
}
WORKLOADS = tuple(_REGISTRY)
#: Written with turbotrain's module names in mind (the passes' home ground).
NATIVE_WORKLOADS = ("gpt", "llama", "bert", "resnet", "mlp")
#: Models turbotrain was not shaped around: a user's own GPT and Hugging Face models.
FOREIGN_WORKLOADS = ("user-gpt", *hf.HF_WORKLOADS)

#: What each settings annotation accepts as an override (bool is rejected for numbers below).
_ACCEPTS = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "tuple[int, ...]": (tuple, list),
}


def settings_class(name: str) -> type:
    """The settings dataclass of workload ``name`` (its fields are the valid overrides)."""
    if name.startswith(hf.AUTO_PREFIX) and name != hf.AUTO_PREFIX:
        return HFAutoSettings
    if name not in _REGISTRY:
        raise UnknownWorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}, "
                                   f"or {hf.AUTO_PREFIX}<model_type> for any transformers language model "
                                   f"(e.g. {hf.AUTO_PREFIX}qwen2)")
    return _REGISTRY[name][0]


def get_workload(name: str, **overrides) -> Workload:
    """Workload ``name`` with settings ``overrides`` (e.g. ``d=64, T=32``).

    Unknown names raise UnknownWorkloadError; unknown keys or ill-typed values raise ConfigError
    listing the valid keys; out-of-range values raise ConfigError from the settings class.
    """
    cls = settings_class(name)
    _check_overrides(name, cls, overrides)
    if cls is HFAutoSettings:
        return hf.make_auto(name[len(hf.AUTO_PREFIX):], cls(**overrides))
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
