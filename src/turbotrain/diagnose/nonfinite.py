"""Find the first module where a training step goes inf/NaN, and say why and what to change.

``nonfinite_flag`` is the cheap always-on check (no host sync) the Engine runs when
``Config(nan_check=True)``; when it trips, ``find_nonfinite`` replays the step with hooks:

1. parameters already non-finite -> the module holding them;
2. the batch non-finite -> the data;
3. forward: hooks on every module, in execution order; the first module whose output goes
   non-finite from finite inputs (or the parent whose own code did it) is the origin;
4. backward: tensor hooks on every module's inputs, outputs and parameters; the first gradient
   to go non-finite while the module's output gradients are finite names the origin.

The origin is then replayed op by op (see causes.py) for the cause and the fix. The backward
replay uses ``torch.autograd.grad``, so ``.grad`` of the parameters is left as it was.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..utils import local_shard
from .causes import Diagnosis, FirstNonfiniteOp, diagnose_op, module_finite_in_fp32
from .stats import TensorStats, all_finite, floating_tensors, map_floating, split_batch

__all__ = ["NonFiniteReport", "find_nonfinite", "nonfinite_flag"]

LOSS_FN = "<loss_fn>"
ROOT = "<model>"


def nonfinite_flag(loss: torch.Tensor, grads=None) -> torch.Tensor:
    """0-d bool tensor, True when the loss or any gradient holds inf/NaN. No host sync.

    The gradients are reduced with one foreach max-|x| per (device, dtype) group, so the cost is
    a handful of kernels whatever the parameter count; max-|x| (not a sum) cannot overflow on its own.
    A DTensor (a sharded gradient) is read as this rank's shard: the flag is local, and a sharded
    caller agrees it across ranks (the Engine MAX-reduces it).

    >>> import torch
    >>> bool(nonfinite_flag(torch.tensor(1.0), [torch.ones(3), torch.tensor([0.0, float("nan")])]))
    True
    """
    values = [local_shard(loss.detach()).reshape(-1).float()]
    groups: dict = {}
    for g in grads or ():
        if g is not None:
            groups.setdefault((g.device, g.dtype), []).append(local_shard(g.detach()))
    for group in groups.values():
        maxima = torch._foreach_norm(group, float("inf"))
        values.append(torch.stack(maxima).float().to(loss.device, non_blocking=True))
    return ~torch.isfinite(torch.cat(values)).all()


@dataclass
class NonFiniteReport:
    """Where a step first went inf/NaN. ``bool(report)`` is True when something was found."""

    found: bool
    phase: str | None = None
    """'parameters', 'input', 'forward', 'loss' or 'backward'."""
    module_path: str | None = None
    module_class: str | None = None
    dtype: str | None = None
    op: str | None = None
    """The aten op where the first inf/NaN was born, found by replay."""
    cause: str | None = None
    """One of turbotrain.diagnose.CAUSES."""
    explanation: str = ""
    fix: str = ""
    inputs: TensorStats | None = None
    outputs: TensorStats | None = None
    grad_outputs: TensorStats | None = None
    grad_inputs: TensorStats | None = None
    fp32_max_abs: float | None = None
    """Max |output| of the bad op recomputed in FP32 (None when that is not finite either)."""
    nonfinite_parameters: tuple[str, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return self.found

    def __str__(self) -> str:
        if not self.found:
            return "No inf/NaN: parameters, forward outputs and gradients are all finite."
        lines = [f"inf/NaN first appears in {self.phase} at {self.module_path} ({self.module_class}, {self.dtype})"]
        if self.op:
            lines.append(f"  first bad op : {self.op}")
        lines.append(f"  cause        : {self.cause} - {self.explanation}")
        lines.append(f"  fix          : {self.fix}")
        for label in ("inputs", "outputs", "grad_outputs", "grad_inputs"):
            stats = getattr(self, label)
            if stats is not None:
                lines.append(f"  {label:<13}: {stats}")
        if self.fp32_max_abs is not None:
            lines.append(f"  same op in FP32: max |x| = {self.fp32_max_abs:.4g}")
        if self.nonfinite_parameters:
            lines.append("  non-finite parameters: " + ", ".join(self.nonfinite_parameters))
        return "\n".join(lines)


class _Call:
    """One call of one module during the traced forward."""

    def __init__(self, path, module, args, kwargs, parent):
        self.path, self.module, self.args, self.kwargs, self.parent = path, module, args, kwargs, parent
        self.output = None
        self.grad_outputs: dict[int, torch.Tensor] = {}


class _Tracer:
    def __init__(self, model: nn.Module):
        self.model = model
        self.paths = {m: (n or ROOT) for n, m in model.named_modules()}
        self.stack: list[_Call] = []
        self.calls: list[_Call] = []
        self.sites: dict = {}  # autograd identity of a tensor -> roles it plays
        self.forward_culprit: _Call | None = None
        self.backward_culprit = None  # (_Call or LOSS_FN, offending gradient)
        self.grad_handles = []

    @contextlib.contextmanager
    def hooks(self):
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # forward -------------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        parent = self.stack[-1] if self.stack else None
        call = _Call(self.paths.get(module, type(module).__name__), module, args, kwargs, parent)
        if self.forward_culprit is None and parent is not None and not all_finite((args, kwargs)):
            # Finite-in/finite-out children so far, yet this input is bad: the parent's own code made it.
            self.forward_culprit = parent
        self.stack.append(call)
        self.calls.append(call)
        for t in floating_tensors((args, kwargs)):
            self._watch(t, ("in", call))
        for name, p in module.named_parameters(recurse=False):
            self._watch(p, ("param", call))

    def _post(self, module, args, kwargs, output):
        call = self.stack.pop()
        call.output = output
        if self.forward_culprit is None and not all_finite(output):
            self.forward_culprit = call
        for i, t in enumerate(floating_tensors(output)):
            self._watch(t, ("out", call, i))

    # backward ------------------------------------------------------------------------------
    def _watch(self, t: torch.Tensor, role):
        if not t.requires_grad:
            return
        key = (t.grad_fn, t.output_nr) if t.grad_fn is not None else ("leaf", id(t))
        roles = self.sites.get(key)
        if roles is None:
            roles = self.sites[key] = [t]  # keep t alive so id(t) stays unique
            self.grad_handles.append(t.register_hook(lambda grad, roles=roles: self._on_grad(roles, grad)))
        roles.append(role)

    def _on_grad(self, roles, grad):
        if self.backward_culprit is not None:
            return
        if grad.numel() == 0 or bool(torch.isfinite(grad).all()):
            for role in roles[1:]:
                if role[0] == "out":
                    role[1].grad_outputs[role[2]] = grad
            return
        consumers = [r[1] for r in roles[1:] if r[0] in ("in", "param")]
        if consumers:
            culprit = consumers[-1]  # the innermost (last entered) module that consumed the tensor
        else:
            producer = next(r[1] for r in roles[1:] if r[0] == "out")
            culprit = producer.parent or LOSS_FN  # functional code in the parent, or the loss
        self.backward_culprit = (culprit, grad)


def _describe_module(path, module, dtype):
    return dict(module_path=path, module_class=type(module).__name__, dtype=dtype)


def _out_dtype(tree) -> str | None:
    t = next(iter(floating_tensors(tree)), None)
    return None if t is None else str(t.dtype).removeprefix("torch.")


def _report(phase, diagnosis: Diagnosis, **fields) -> NonFiniteReport:
    return NonFiniteReport(found=True, phase=phase, cause=diagnosis.cause, explanation=diagnosis.explanation,
                           fix=diagnosis.fix, op=diagnosis.op, fp32_max_abs=diagnosis.fp32_max_abs, **fields)


def _weights_report(model: nn.Module) -> NonFiniteReport | None:
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    if not bad:
        return None
    path = bad[0].rpartition(".")[0] or ROOT
    module = model.get_submodule("" if path == ROOT else path)
    param = model.get_parameter(bad[0])
    diagnosis = Diagnosis("nonfinite-weights", f"parameter {bad[0]} already holds inf/NaN before the step runs",
                          "fix the weights: reload the last good checkpoint; the update that broke them was too "
                          "large, so lower the learning rate, set Config(clip_grad_norm=1.0), and keep "
                          "Config(nan_check=True) to stop at the first bad step")
    return _report("parameters", diagnosis, outputs=TensorStats.of(param), nonfinite_parameters=tuple(bad),
                   **_describe_module(path, module, str(param.dtype).removeprefix("torch.")))


def _replay_forward(call: _Call, autocast) -> FirstNonfiniteOp:
    mode = FirstNonfiniteOp()
    with torch.no_grad(), autocast(), mode:
        call.module(*call.args, **call.kwargs)
    return mode


def _replay_backward(fn, args, kwargs, grad_outputs: dict, autocast, loss_scale=1.0) -> FirstNonfiniteOp:
    """Re-run fn's forward on detached inputs, then its backward under the op tracer."""
    module = fn if isinstance(fn, nn.Module) else None

    def detach(tree):
        # The loss is replayed from the model output, which must require grad to be differentiated.
        return map_floating(tree, lambda t: t.detach().requires_grad_(t.requires_grad or module is None))

    args, kwargs = detach(args), detach(kwargs)
    leaves = [t for t in floating_tensors((args, kwargs)) if t.requires_grad]
    leaves += [p for p in (module.parameters() if module is not None else ()) if p.requires_grad]
    mode = FirstNonfiniteOp()
    with torch.enable_grad():
        with autocast():
            out = fn(*args, **kwargs)
        outs = [t for t in floating_tensors(out) if t.requires_grad]
        grads = [grad_outputs.get(i, torch.zeros_like(t)) for i, t in enumerate(floating_tensors(out))
                 if t.requires_grad]
        if module is None:  # the loss: backward starts from the (scaled) scalar
            outs, grads = [outs[0] * loss_scale], None
        if outs and leaves:
            with mode:
                torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return mode


def find_nonfinite(model: nn.Module, loss_fn, batch, *, autocast=None, loss_scale: float = 1.0) -> NonFiniteReport:
    """Run one forward and backward with hooks and report where inf/NaN first appears.

    ``autocast``: a callable returning the forward context (``engine.autocast``) so the replay runs
    in the same precision as training; ``loss_scale``: the fp16 loss scale the step used.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    >>> with torch.no_grad(): net[1].weight[0, 0] = float("inf")
    >>> find_nonfinite(net, torch.nn.functional.mse_loss, (torch.randn(2, 4), torch.randn(2, 1))).module_path
    '1'
    """
    autocast = autocast or contextlib.nullcontext
    report = _weights_report(model)
    if report is not None:
        return report
    inputs, targets = split_batch(batch)
    if not all_finite(inputs):
        return _report("input", Diagnosis("nonfinite-input", "the batch itself contains inf/NaN",
                                          "fix the data: check the loader, normalisation and any division "
                                          "in preprocessing"),
                       module_path="<batch>", module_class=type(inputs).__name__,
                       dtype=_out_dtype(inputs), inputs=TensorStats.of(inputs))

    tracer = _Tracer(model)
    try:
        return _traced_step(tracer, model, loss_fn, inputs, targets, autocast, loss_scale)
    finally:
        for handle in tracer.grad_handles:  # hooks on parameters would outlive this call otherwise
            handle.remove()


def _traced_step(tracer, model, loss_fn, inputs, targets, autocast, loss_scale) -> NonFiniteReport:
    with tracer.hooks():
        with autocast():
            out = model(inputs)
            if tracer.forward_culprit is None:
                loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
    if tracer.forward_culprit is not None:
        return _forward_report(tracer.forward_culprit, autocast)
    loss_args = (out.detach() if isinstance(out, torch.Tensor) else out, targets)
    if not all_finite(loss):
        mode = FirstNonfiniteOp()
        with torch.no_grad(), autocast(), mode:
            loss_fn(*loss_args)
        return _report("loss", diagnose_op(mode, LOSS_FN, "forward"), module_path=LOSS_FN,
                       module_class=getattr(loss_fn, "__name__", type(loss_fn).__name__),
                       dtype=_out_dtype(loss), inputs=TensorStats.of(loss_args), outputs=TensorStats.of(loss))

    leaves = [p for p in model.parameters() if p.requires_grad]
    leaves += [t for t in floating_tensors(inputs) if t.requires_grad]
    if leaves:
        torch.autograd.grad(loss * loss_scale, leaves, allow_unused=True)
    if tracer.backward_culprit is None:
        return NonFiniteReport(found=False)
    return _backward_report(*tracer.backward_culprit, loss_fn, loss_args, autocast, loss_scale)


def _forward_report(call: _Call, autocast) -> NonFiniteReport:
    mode = _replay_forward(call, autocast)
    dtype = _out_dtype(call.output) or _out_dtype(call.args)
    low = dtype in ("float16", "bfloat16")
    fp32_finite = low and mode.func is not None and module_finite_in_fp32(call.module, call.args, call.kwargs)
    diagnosis = diagnose_op(mode, call.path, "forward", fp32_module_finite=fp32_finite)
    return _report("forward", diagnosis, inputs=TensorStats.of((call.args, call.kwargs)),
                   outputs=TensorStats.of(call.output), **_describe_module(call.path, call.module, dtype))


def _backward_report(culprit, grad, loss_fn, loss_args, autocast, loss_scale) -> NonFiniteReport:
    if culprit == LOSS_FN:
        mode = _replay_backward(loss_fn, loss_args, {}, {}, autocast, loss_scale)
        return _report("backward", diagnose_op(mode, LOSS_FN, "backward"), module_path=LOSS_FN,
                       module_class=getattr(loss_fn, "__name__", type(loss_fn).__name__),
                       dtype=_out_dtype(loss_args), inputs=TensorStats.of(loss_args), grad_inputs=TensorStats.of(grad))
    mode = _replay_backward(culprit.module, culprit.args, culprit.kwargs, culprit.grad_outputs, autocast)
    dtype = _out_dtype(grad)
    return _report("backward", diagnose_op(mode, culprit.path, "backward"),
                   inputs=TensorStats.of((culprit.args, culprit.kwargs)), outputs=TensorStats.of(culprit.output),
                   grad_outputs=TensorStats.of(list(culprit.grad_outputs.values())),
                   grad_inputs=TensorStats.of(grad), **_describe_module(culprit.path, culprit.module, dtype))
