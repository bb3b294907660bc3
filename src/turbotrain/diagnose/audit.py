"""Which layers does low precision hurt? Per-module SQNR of a mixed-precision forward against FP32.

Two errors per module:

* **local** (what flags a layer): the module is fed the *FP32 reference input* and run in the low
  precision, so the figure is that module's own error, not what it inherited from upstream;
* **in the run**: the module's output in the full low-precision forward, errors of every earlier
  layer included (what training actually sees).

A module is flagged as a 'keep FP32' candidate when its local SQNR is below the threshold and
none of its children is flagged (a parent that merely contains a fragile child is not itself
the problem). SQNR = 10*log10(sum(ref^2) / sum((out - ref)^2)) dB; 20 dB means the error is a tenth
of the signal's magnitude. bf16 rounding alone gives ~45-55 dB for a well-scaled layer.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..utils import sqnr_db
from .stats import floating_tensors, map_floating, precision_run, split_batch

__all__ = ["precision_audit", "AuditReport", "AuditRow", "sqnr_db"]


def _rel_error(reference, actual) -> float:
    ref = reference.detach().double()
    diff = float((actual.detach().double() - ref).norm())
    scale = float(ref.norm())
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


@dataclass(frozen=True)
class AuditRow:
    path: str
    module_class: str
    dtype: str
    sqnr_db: float
    """Local SQNR: the module alone, fed the FP32 input."""
    rel_error: float
    sqnr_run_db: float
    """SQNR of the module's output in the full low-precision run (upstream errors included)."""
    rel_error_run: float
    flagged: bool
    contains_flagged: bool


@dataclass
class AuditReport:
    precision: str
    threshold_db: float
    rows: list[AuditRow] = field(default_factory=list)

    @property
    def keep_fp32(self) -> list[str]:
        """Paths of the modules to keep in FP32, in execution order."""
        return [r.path for r in self.rows if r.flagged]

    def to_rows(self) -> list[dict]:
        return [r.__dict__.copy() for r in self.rows]

    def __str__(self) -> str:
        header = f"{'module':<32} {'class':<18} {'dtype':<9} {'SQNR dB':>8} {'rel err':>9} {'run dB':>8}  verdict"
        lines = [f"Precision audit: {self.precision} vs FP32 (flag below {self.threshold_db:g} dB local SQNR)",
                 header, "-" * len(header)]
        for r in self.rows:
            verdict = "keep FP32" if r.flagged else ("(contains flagged)" if r.contains_flagged else "ok")
            lines.append(f"{r.path:<32} {r.module_class:<18} {r.dtype:<9} {r.sqnr_db:>8.1f} {r.rel_error:>9.2e} "
                         f"{r.sqnr_run_db:>8.1f}  {verdict}")
        if self.keep_fp32:
            lines.append("Keep in FP32: " + ", ".join(self.keep_fp32))
        else:
            lines.append("No layer falls below the threshold.")
        return "\n".join(lines)


def _capture(model: nn.Module, paths: dict, record_inputs: bool):
    """Context manager that records (path, args, kwargs, outputs) of every module call."""
    calls = []
    handles = []

    def clone(tree):
        return map_floating(tree, lambda t: t.detach().clone())

    def pre(module, args, kwargs):
        calls.append([paths[module], clone((args, kwargs)) if record_inputs else None, None])
        module._turbotrain_audit_stack = getattr(module, "_turbotrain_audit_stack", []) + [len(calls) - 1]

    def post(module, args, kwargs, output):
        calls[module._turbotrain_audit_stack.pop()][2] = clone(output)

    @contextlib.contextmanager
    def active():
        for module in paths:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        try:
            yield calls
        finally:
            for h in handles:
                h.remove()
            for module in paths:
                module.__dict__.pop("_turbotrain_audit_stack", None)

    return active()


def _compare(reference, actual) -> tuple[float, float]:
    refs, acts = floating_tensors(reference), floating_tensors(actual)
    if not refs or len(refs) != len(acts):
        return math.nan, math.nan
    ref = torch.cat([t.reshape(-1).float() for t in refs])
    act = torch.cat([t.reshape(-1).float() for t in acts])
    return sqnr_db(ref, act), _rel_error(ref, act)


def precision_audit(model: nn.Module, batch, precision: str, *, threshold_db: float = 20.0) -> AuditReport:
    """Per-module error of ``precision`` (a Config.precision string) against FP32 on one batch.

    The caller's model is not modified (its train/eval mode is restored; '-master' runs a copy).
    Runs in eval mode so dropout draws the same mask in both runs.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> precision_audit(net, torch.randn(4, 8), "bf16-mixed").keep_fp32
    []
    """
    inputs, _ = split_batch(batch)
    was_training = model.training
    reference_model = model if all(p.dtype == torch.float32 for p in model.parameters()) else copy.deepcopy(model).float()
    reference_model.eval()
    try:
        return _audit(reference_model, inputs, precision, threshold_db)
    finally:
        model.train(was_training)
        reference_model.train(was_training)


def _audit(reference_model, inputs, precision, threshold_db) -> AuditReport:
    ref_paths = {m: (n or "<model>") for n, m in reference_model.named_modules()}
    with torch.no_grad(), _capture(reference_model, ref_paths, record_inputs=True) as ref_calls:
        reference_model(inputs)
    run = precision_run(reference_model, precision)
    run.model.eval()
    run_paths = {m: (n or "<model>") for n, m in run.model.named_modules()}
    with torch.no_grad(), _capture(run.model, run_paths, record_inputs=False) as run_calls, run.autocast():
        run.model(run.inputs(inputs))

    by_path: dict[str, list] = {}
    low_modules = {p: m for m, p in run_paths.items()}
    for i, (path, (args, kwargs), ref_out) in enumerate(ref_calls):
        module = low_modules[path]
        with torch.no_grad(), run.autocast():
            local_out = module(*run.inputs(args), **run.inputs(kwargs))
        local = _compare(ref_out, local_out)
        in_run = _compare(ref_out, run_calls[i][2]) if i < len(run_calls) and run_calls[i][0] == path else (math.nan,) * 2
        dtype = next((str(t.dtype).removeprefix("torch.") for t in floating_tensors(local_out)), "-")
        by_path.setdefault(path, []).append((local, in_run, dtype, type(module).__name__))

    rows = []
    children = {p: [c for c in by_path if c != p and _is_child(p, c)] for p in by_path}
    flagged: set[str] = set()
    # Innermost first, so a parent knows whether one of its children is already flagged.
    for path in sorted(by_path, key=lambda p: -_depth(p)):
        worst_local = min(by_path[path], key=lambda c: _nan_last(c[0][0]))
        if worst_local[0][0] < threshold_db and not any(c in flagged for c in children[path]):
            flagged.add(path)
    for path, results in by_path.items():  # execution order (dicts keep first-call order)
        (s, r), (s_run, r_run), dtype, cls = min(results, key=lambda c: _nan_last(c[0][0]))
        rows.append(AuditRow(path, cls, dtype, s, r, s_run, r_run, path in flagged,
                             any(c in flagged for c in children[path])))
    return AuditReport(precision, threshold_db, rows)


def _depth(path: str) -> int:
    return -1 if path == "<model>" else path.count(".")


def _is_child(parent: str, child: str) -> bool:
    """True when ``child`` is a direct or deeper submodule path of ``parent``."""
    return parent == "<model>" or child.startswith(parent + ".")


def _nan_last(value: float) -> float:
    return math.inf if math.isnan(value) else value
