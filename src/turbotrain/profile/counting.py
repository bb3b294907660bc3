"""FLOPs and bytes per aten op for one step, counted exactly from the tensors that flow through.

FLOPs use PyTorch's own formulas (``torch.utils.flop_counter``: 2 FLOPs per multiply-add; matmul,
convolution and attention only, so elementwise ops count 0). Bytes are the logical sizes of each
op's tensor inputs read plus outputs written (views move nothing); caches are ignored, so this
is the traffic an op needs at least once per call. Ops re-run by activation checkpointing are
counted apart (``recompute_flops``, ``recompute_calls``) so model FLOPs, and MFU, exclude
recomputation.

This is turbotrain's one op counter: the profiler's op table, the benchmark's FLOPs per step and
its ATen ops per step all come from it. Its FLOPs equal ``FlopCounterMode``'s total (the same
formula table) on every built-in workload.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..memory import is_recomputing

__all__ = ["OpCounts", "StepCounts", "OpCounter"]


@dataclass
class OpCounts:
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    dtypes: set = field(default_factory=set)


@dataclass
class StepCounts:
    ops: dict = field(default_factory=lambda: defaultdict(OpCounts))
    """'aten::name' -> OpCounts."""
    recompute_flops: float = 0.0
    recompute_calls: int = 0
    """ATen calls re-run by activation checkpointing (not in ``ops``)."""

    @property
    def flops(self) -> float:
        """Model FLOPs: every counted op, recomputation excluded."""
        return sum(c.flops for c in self.ops.values())

    @property
    def calls(self) -> int:
        """ATen calls dispatched, recomputation included: the work the step really launched."""
        return sum(c.calls for c in self.ops.values()) + self.recompute_calls


def _tensors(tree):
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _ptr(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
        return None


class OpCounter(TorchDispatchMode):
    """Accumulates a StepCounts while active."""

    def __init__(self):
        super().__init__()
        self.counts = StepCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        if is_recomputing():
            self.counts.recompute_flops += flops
            self.counts.recompute_calls += 1
            return out
        inputs = list(_tensors((args, kwargs)))
        in_ptrs = {_ptr(t) for t in inputs}
        outputs = list(_tensors(out))
        inplace = packet.__name__.endswith("_")
        if not inplace and outputs and all(_ptr(t) in in_ptrs for t in outputs):
            moved = 0  # a view: no data moves
        else:
            moved = sum(t.numel() * t.element_size() for t in inputs)
            moved += sum(t.numel() * t.element_size() for t in outputs)
        c = self.counts.ops[f"aten::{packet.__name__}"]
        c.calls += 1
        c.flops += flops
        c.bytes += moved
        c.dtypes.update(str(t.dtype).removeprefix("torch.") for t in inputs if t.is_floating_point())
        return out
