"""Run a model once on an example and record, call by call, which tensors each module got and gave.

Fusion finds its sites from this record instead of from module names: two modules are connected
when the tensor object one returned is the tensor object the other received, and a module belongs
to a call of its parent when the parent's forward was running when it was called.

>>> import torch
>>> from torch import nn
>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU())
>>> trace = probe(mlp, ((torch.randn(2, 4),), {}))
>>> fc, act = trace.calls_of(mlp[0])[0], trace.calls_of(mlp[1])[0]
>>> act.args[0] is fc.output and act.parent.module is mlp
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import FusionError
from ..utils import leaves_no_trace

__all__ = ["Call", "Trace", "probe", "check_example"]


@dataclass(eq=False)
class Call:
    """One call of one module during the probe."""

    module: nn.Module
    parent: Optional["Call"]
    """The innermost module call that was running when this one started (None for the model's)."""
    args: tuple
    kwargs: dict
    output: Any = None
    children: list["Call"] = field(default_factory=list)
    """The calls made while this one ran, directly (not those of its children), in call order."""
    saved: Optional[tuple[tuple, dict]] = None
    """Detached copies of (args, kwargs), taken as the call started: the values a unit can be
    verified on later. Kept for the first call of each module that has children."""

    def tensor_input(self) -> Optional[torch.Tensor]:
        """The input when the call took exactly one tensor, positionally; otherwise None."""
        if len(self.args) == 1 and not self.kwargs and isinstance(self.args[0], torch.Tensor):
            return self.args[0]
        return None


@dataclass
class Trace:
    calls: list[Call]

    def __post_init__(self):
        self._by_module: dict[int, list[Call]] = {}
        for call in self.calls:
            self._by_module.setdefault(id(call.module), []).append(call)

    def calls_of(self, module: nn.Module) -> list[Call]:
        return self._by_module.get(id(module), [])

    def release(self) -> None:
        """Drop every recorded value and link. A call and its parent refer to each other, so a trace
        is a reference cycle that holds every module's inputs and outputs (with their autograd graphs:
        all the activations of one batch) until Python's cyclic collector runs, which a training loop
        may not make it do for a long time (HF Llama at B=8, T=256: ~540 MB)."""
        for call in self.calls:
            call.parent, call.children, call.output, call.saved = None, [], None, None
            call.args, call.kwargs = (), {}
        self.calls = []
        self._by_module = {}


def check_example(example) -> tuple[tuple, dict]:
    """``example`` as (args, kwargs), or a FusionError that says what was expected."""
    if (not isinstance(example, (tuple, list)) or len(example) != 2 or not isinstance(example[0], (tuple, list))
            or not isinstance(example[1], dict)):
        raise FusionError("example must be (args, kwargs) as the model is called, e.g. ((input_ids,), {}) "
                          f"or ((), {{'input_ids': ids, 'attention_mask': mask}}); got {type(example).__name__}")
    return tuple(example[0]), dict(example[1])


def _detached_copy(tree):
    """Tensors copied off the graph (still marked as needing grad where they did); the rest as is."""
    return pytree.tree_map(
        lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, tree)


def probe(model: nn.Module, example) -> Trace:
    """Call ``model(*args, **kwargs)`` once, with grad enabled, and return every module call.

    The model is run in its current mode; the random state and the buffers are restored afterwards,
    so the probe leaves no trace in the model or in a seeded run. Pass a small example (one short
    batch): the record holds every module's inputs and outputs until sites are found; call
    ``Trace.release()`` when done with it.
    """
    args, kwargs = check_example(example)
    calls: list[Call] = []
    stack: list[Call] = []
    seen_children: set[int] = set()

    def before(module, margs, mkwargs):
        parent = stack[-1] if stack else None
        call = Call(module, parent, margs, mkwargs)
        if module._modules and id(module) not in seen_children:
            seen_children.add(id(module))
            call.saved = (_detached_copy(margs), _detached_copy(mkwargs))
        if parent is not None:
            parent.children.append(call)
        calls.append(call)
        stack.append(call)

    def after(module, margs, mkwargs, output):
        if stack and stack[-1].module is module:
            stack.pop().output = output

    handles = []
    try:
        for module in {id(m): m for m in model.modules()}.values():
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
        with leaves_no_trace(model), torch.enable_grad():
            try:
                model(*args, **kwargs)
            except Exception as exc:
                raise FusionError(f"the model could not run on the example given to fuse() "
                                  f"({type(exc).__name__}: {exc})") from exc
    finally:
        for handle in handles:
            handle.remove()
    return Trace(calls)
