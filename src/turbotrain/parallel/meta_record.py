"""How an init is written down on the meta model and replayed into one parameter at a time.

The machinery under meta_init.py (which says what it is for): stand-ins for the model's meta
tensors that record the in-place ops reaching them (``Recorder``), the steps they write (``Step``:
the op, its arguments with the tensor's own views as ``View`` and each draw as the generator state
before it, ``Draw``), and ``Target.replay``, which runs one tensor's steps on a whole-size CPU tensor.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import MetaInitError

__all__ = ["View", "Draw", "Step", "Target", "Stand", "Recorder", "whole_calls_recorded", "stand_in", "stand_down",
           "covers", "prune", "storage_key"]

#: In-place ops that set every element they write without reading it: what counts as initialising.
_OVERWRITES = frozenset({"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "exponential_", "cauchy_",
                         "log_normal_", "geometric_", "bernoulli_", "_no_grad_trunc_normal_"})
#: torch.nn.init's helpers that read the values they draw (torch 2.13's trunc_normal_ samples by rejection,
#: redrawing until every value falls inside [a, b]): recorded and replayed as one call each, on a scratch
#: tensor with the generator's state, since the stand-ins have no values to decide with.
_WHOLE_CALLS = ("_no_grad_trunc_normal_",)
#: Random ops whose schema has no ``generator`` argument (they draw from the default one).
_RANDOM_WITHOUT_GENERATOR = frozenset({"rand_like", "randn_like", "randint_like"})
#: Ops that make a new tensor from another's dtype and shape alone: on a stand-in they make a real CPU tensor,
#: as they would have in the eager build (orthogonal_'s scratch), drawing from the generator if random.
_CREATES_LIKE = frozenset({"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like",
                           "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"})


class View(NamedTuple):
    """A view of the tensor being initialised, by its geometry within that tensor."""

    size: tuple
    stride: tuple
    offset: int


class Draw(NamedTuple):
    """The generator of a random op, by the state it had just before the op."""

    state: torch.Tensor


class Step(NamedTuple):
    func: object
    """The aten op (an OpOverload), or one of torch.nn.init's _WHOLE_CALLS."""
    args: tuple
    kwargs: dict


@dataclass
class Target:
    """One parameter or buffer to initialise, and the ops that write it, in order."""

    key: int
    """The meta tensor's storage: views of it (``weight[0]``, ``weight.data``) share it."""
    name: str
    kind: str
    """'parameter' or 'buffer'."""
    size: torch.Size
    stride: tuple
    offset: int
    """Its storage offset: views are recorded relative to it."""
    dtype: torch.dtype
    steps: list = field(default_factory=list)

    def scratch(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="cpu")

    def nbytes(self) -> int:
        return self.size.numel() * self.dtype.itemsize

    def replay(self) -> torch.Tensor:
        """The tensor's recorded value, computed alone on a whole-size CPU tensor (under torch.no_grad())."""
        full = self.scratch()
        for step in self.steps:
            step.func(*_realise(step.args, full), **_realise(step.kwargs, full))
        return full


def _realise(template, scratch: torch.Tensor, generator: Optional[torch.Generator] = None):
    """args/kwargs of a step with its views made on ``scratch`` and its draw given a generator."""

    def one(x):
        if isinstance(x, View):
            return scratch.as_strided(x.size, x.stride, x.offset)
        if isinstance(x, Draw):
            return generator if generator is not None else torch.Generator().set_state(x.state)
        return x

    return tree_map(one, template, is_leaf=lambda x: isinstance(x, (View, Draw)))


def _op_name(func) -> str:
    """An aten op's name (``normal_``), or a recorded Python function's (``_no_grad_trunc_normal_``)."""
    packet = getattr(func, "_overloadpacket", None)
    return packet.__name__ if packet is not None else func.__name__


def _is_random(func) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments) or _op_name(func) in _RANDOM_WITHOUT_GENERATOR


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's ``(a!)`` arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def storage_key(t: torch.Tensor) -> int:
    """The tensor's storage: its views (``weight[0]``, ``weight.data``) share it."""
    return t.untyped_storage()._cdata


class Stand(torch.Tensor):
    """A meta parameter or buffer (or a view of one, or a tensor computed from one) while the init runs.

    It says it is a CPU tensor, so that torch.nn.init's shortcuts for meta tensors (trunc_normal_, dirac_,
    orthogonal_ and sparse_ return at once on one) do not skip it, and every op on it reaches the recorder.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: torch.Tensor, recorder: "Recorder"):
        out = torch.Tensor._make_wrapper_subclass(cls, meta.size(), strides=meta.stride(),
                                                  storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                  device=torch.device("cpu"), requires_grad=meta.requires_grad)
        out.meta, out.recorder = meta, recorder
        return out

    def __repr__(self) -> str:
        return f"<a {tuple(self.shape)} tensor of the meta model, being initialised>"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        recorder = next(x.recorder for x in tree_leaves((args, kwargs)) if isinstance(x, Stand))
        return recorder.dispatch(func, args, kwargs or {})


def _real_like(x):
    if not isinstance(x, Stand):
        return x
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu")


class Recorder:
    """Writes down the in-place ops that reach the model's meta tensors (see the module docstring)."""

    def __init__(self, targets: dict[int, Target]):
        self.targets = targets
        self.refusal: Optional[MetaInitError] = None

    def dispatch(self, func, args, kwargs):
        if _op_name(func) in _CREATES_LIKE:
            if _op_name(func).startswith("new_"):  # only self's dtype matters: no scratch of its size
                args = (torch.empty(0, dtype=args[0].dtype), *args[1:])
            return func(*tree_map(_real_like, args), **tree_map(_real_like, kwargs))
        written = [t for t in _written(func, args, kwargs) if isinstance(t, Stand)]
        hit = {self.targets[k].name: self.targets[k] for t in written if (k := storage_key(t.meta)) in self.targets}
        if len(hit) > 1:
            self._refuse(f"{func} writes {', '.join(hit)} in one op; initialise each on its own")
        if hit:
            self._record(next(iter(hit.values())), func, args, kwargs)
        elif _is_random(func):
            self._refuse(f"{func} draws random numbers into a tensor computed from the model's (no parameter or buffer "
                         "of it), which cannot be replayed per parameter; draw into the parameter itself, or into a "
                         "new tensor (torch.empty_like(p)) and copy_ it")
        unwrap = (lambda x: x.meta if isinstance(x, Stand) else x)
        try:
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        except (RuntimeError, NotImplementedError) as exc:
            if "meta" not in str(exc):
                raise
            first = str(exc).splitlines()[0]  # .item(), nonzero(): a meta tensor has no values
            self._refuse(f"{func} needs the values of a tensor of the model, which do not exist on the meta device "
                         f"({type(exc).__name__}: {first}). An init that reads values back (a Python `if` on a "
                         "tensor, rejection sampling) cannot be recorded; compute such values on a CPU tensor and "
                         "copy_ them in (held until the shards are made)")
        return tree_map(lambda x: Stand(x, self) if isinstance(x, torch.Tensor) and x.is_meta else x, out)

    def call(self, function, tensor, args, kwargs):
        """One call of a torch.nn.init helper that reads what it draws (_WHOLE_CALLS), on a stand-in."""
        target = self.targets.get(storage_key(tensor.meta))
        if target is None:
            self._refuse(f"{function.__name__} on a tensor computed from the model's (no parameter or buffer of it); "
                         "call it on the parameter itself")
        view = View(tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset() - target.offset)
        step = self._draw(target, Step(function, (view, *args), dict(kwargs)), kwargs.get("generator"))
        target.steps.append(step)
        return tensor

    def _refuse(self, why: str) -> None:
        error = MetaInitError(f"init_weights on the meta model: {why}")
        self.refusal = self.refusal or error
        raise error

    def _record(self, target: Target, func, args, kwargs) -> None:
        def template(x):
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, Stand):
                if x.is_meta:
                    self._refuse(f"{func} writes {target.kind} {target.name} from a meta tensor of no model (made on "
                                 "the meta device); make it on the CPU")
                return x.detach().clone()  # a constant (RoPE's frequencies): held until materialised
            if storage_key(x.meta) == target.key:
                return View(tuple(x.size()), tuple(x.stride()), x.storage_offset() - target.offset)
            other = self.targets.get(storage_key(x.meta))
            source = f"{other.kind} {other.name}" if other is not None else "a tensor computed from the model's"
            self._refuse(f"{func} writes {target.kind} {target.name} from {source}; each parameter and buffer is "
                         "replayed on its own, so it may read only itself, constants and real tensors")

        step = Step(func, tree_map(template, args), tree_map(template, kwargs))
        if _is_random(func):
            step = self._draw(target, step, kwargs.get("generator"))
        target.steps.append(step)

    def _draw(self, target: Target, step: Step, generator: Optional[torch.Generator]) -> Step:
        # Advance the generator as the eager build did, on a scratch tensor of the same geometry.
        generator = generator if generator is not None else torch.default_generator
        if generator.device.type != "cpu":
            self._refuse(f"{step.func} on {target.name} draws from a {generator.device.type} generator; the init "
                         "runs on the CPU (as a model built on the CPU before .to(device)): use the CPU generator")
        state = generator.get_state()
        scratch = target.scratch()
        step.func(*_realise(step.args, scratch), **_realise({**step.kwargs, "generator": Draw(state)}, scratch,
                                                            generator))
        return Step(step.func, step.args, {**step.kwargs, "generator": Draw(state)})


@contextlib.contextmanager
def whole_calls_recorded():
    """torch.nn.init's _WHOLE_CALLS, while the init runs, record one step when given a stand-in. They are
    module functions its public ones call by name, so callers holding torch.nn.init.trunc_normal_ itself (as
    transformers.initialization does) reach them too."""
    import torch.nn.init as init

    originals = {name: getattr(init, name) for name in _WHOLE_CALLS if hasattr(init, name)}

    def recorded(original):
        @functools.wraps(original)
        def call(tensor, *args, **kwargs):
            if not isinstance(tensor, Stand):
                return original(tensor, *args, **kwargs)
            return tensor.recorder.call(original, tensor, args, kwargs)

        return call

    try:
        for name, original in originals.items():
            setattr(init, name, recorded(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(init, name, original)


def stand_in(model: nn.Module, recorder: Recorder) -> dict[int, torch.Tensor]:
    """Put a stand-in (one for a tensor held in two places, as tied weights are) in every meta slot; the
    stand-ins' ids -> the meta tensors they stand for."""
    originals: dict[int, torch.Tensor] = {}
    stands: dict[int, Stand] = {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, tensor in slots.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in stands:
                    stand = Stand(tensor, recorder)
                    stand._is_param = isinstance(tensor, nn.Parameter)  # isinstance(stand, nn.Parameter) as before
                    stands[id(tensor)], originals[id(stand)] = stand, tensor
                slots[name] = stands[id(tensor)]
    return originals


def stand_down(model: nn.Module, originals: dict[int, torch.Tensor]) -> dict[tuple, torch.Tensor]:
    """Put the meta tensors back; (kind, qualified name) -> whatever else the init left in a slot that held one."""
    replaced = {}
    for prefix, module in model.named_modules():
        for kind, slots in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in slots.items():
                if id(tensor) in originals:
                    slots[name] = originals[id(tensor)]
                elif tensor is not None and not tensor.is_meta:
                    replaced[kind, f"{prefix}.{name}" if prefix else name] = tensor
    return replaced


def defines(step: Step, target: Target) -> bool:
    """The step sets every element of the target without reading it (its value no longer depends on before)."""
    written, *rest = tree_leaves((step.args, step.kwargs), is_leaf=lambda x: isinstance(x, (View, Draw)))
    return (_op_name(step.func) in _OVERWRITES and isinstance(written, View)
            and torch.Size(written.size).numel() == target.size.numel()
            and not any(isinstance(x, View) for x in rest))


def prune(target: Target) -> None:
    """Drop the steps before the last that defines the target: they set nothing that lasts (the resets a
    model's own init overwrites), and each draw holds a generator state (5 KB) until it is replayed."""
    last = max((i for i, step in enumerate(target.steps) if defines(step, target)), default=0)
    target.steps = target.steps[last:]


def covers(target: Target) -> bool:
    """Every element of the target is written by some step (an empty tensor needs none)."""
    if target.size.numel() == 0 or any(defines(step, target) for step in target.steps):
        return True
    views = [s.args[0] for s in target.steps if _op_name(s.func) in _OVERWRITES and isinstance(s.args[0], View)]
    if not views:
        return False
    span = 1 + sum((n - 1) * st for n, st in zip(target.size, target.stride))  # the elements it spans
    written = torch.zeros(span, dtype=torch.bool)  # partial writes (rows, slices): do they add up?
    for v in views:
        written.as_strided(v.size, v.stride, v.offset).fill_(True)
    return bool(written.as_strided(target.size, target.stride, 0).all())
