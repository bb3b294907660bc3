"""torch.compile with few shapes: sequence-length buckets, and a watch on recompiles.

Every new sequence length makes a ``dynamic=False`` compile build a new graph, and after
``torch._dynamo.config.recompile_limit`` graphs for one function Dynamo gives up and runs it
eagerly. Padding batches up to a few bucket lengths bounds the graphs at ``len(buckets)``.

>>> bucket_length(100, (64, 128, 256))
128
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .ops._kernels import epilogue_frames

__all__ = ["bucket_length", "pad_batch", "compile_model", "recompile_count", "recompile_limit",
           "check_recompile_budget"]

_WARNED = [False]
#: Warn when this fraction of the recompile limit is used up.
_WARN_FRACTION = 0.75


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``length``."""
    fitting = [b for b in sorted(buckets) if b >= length]
    if not fitting:
        raise ConfigError(f"sequence length {length} is longer than every seq_bucket {tuple(buckets)}; "
                          f"add a bucket >= {length} to Config(seq_buckets=...)")
    return fitting[0]


def pad_batch(batch, buckets: Sequence[int], pad_id: int = 0, ignore_index: int = -100):
    """Pad ``(inputs, targets)`` on the right, along dim 1, up to the bucket length.

    Inputs get ``pad_id`` and targets ``ignore_index``, so for a causal LM (which never looks right)
    the mean loss over the real tokens is exactly unchanged. Targets without a sequence dimension
    (one label per sample) are left as they are.
    """
    inputs, targets = batch
    length = inputs.shape[1]
    size = bucket_length(length, buckets)
    if size == length:
        return inputs, targets
    extra = size - length

    def pad(t, value):
        spec = [0, 0] * (t.dim() - 2) + [0, extra]  # F.pad lists the last dimension first
        return F.pad(t, spec, value=value)

    inputs = pad(inputs, pad_id)
    if targets.dim() >= 2 and targets.shape[1] == length:
        targets = pad(targets, ignore_index)
    return inputs, targets


def compile_model(model: nn.Module, dynamic: bool = False, **kwargs) -> nn.Module:
    """torch.compile(model, dynamic=dynamic, **kwargs).

    ``dynamic=False`` by default: with seq_buckets the shapes are few, and static shapes give the
    fastest kernels; pass ``dynamic=True`` for workloads whose lengths cannot be bucketed.
    """
    return torch.compile(model, dynamic=dynamic, **kwargs)


def recompile_count() -> int:
    """Graphs Dynamo has compiled in this process for user code (turbotrain's own fused-op
    epilogues, which compile once per dtype, are not counted)."""
    from torch._dynamo.utils import counters

    return max(0, counters["stats"]["unique_graphs"] - epilogue_frames())


def recompile_limit() -> int:
    """Dynamo's per-function graph limit (``recompile_limit``, ``cache_size_limit`` before torch 2.6)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


def check_recompile_budget(count: int | None = None) -> bool:
    """Warn once when the compiled graphs approach the recompile limit; True when it warned now.

    The limit is per function while the count is for the process, so this errs on the early side
    for a model with graph breaks, which is the right side to err on.
    """
    count = recompile_count() if count is None else count
    limit = recompile_limit()
    if _WARNED[0] or count < _WARN_FRACTION * limit:
        return False
    _WARNED[0] = True
    warnings.warn(
        f"{count} graphs compiled so far, and torch.compile stops recompiling a function after "
        f"{limit} (torch._dynamo.config.recompile_limit) and then runs it uncompiled. Varying "
        "sequence lengths are the usual cause: set Config(seq_buckets=(...)) so batches are padded "
        "to a few lengths, or compile with dynamic=True.",
        stacklevel=2,
    )
    return True
