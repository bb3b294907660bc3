"""fuse(model): find fusable sites, swap in fused modules, verify each one, roll back failures.

Sites are found from data flow when an example input is given (the model is run once on it, see
probe.py), else from module names. Each site is verified before the real model is touched: the
site's unit is deep-copied (and cast to ``dtype`` when given), run stock and fused under one seed
on the inputs it received in that run (or, without an example, on a sample made from its shapes),
and the outputs, the input grads and every parameter grad are compared. Only then is the real unit
rebuilt, with the same deterministic build. A failing site is left as it was and reported.

>>> mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
>>> report = fuse(mlp, patterns=("linear_act",))
>>> [(s.path, s.pattern) for s in report.fused]
[('0', 'linear_act')]
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..config import FUSION_PATTERNS
from ..errors import FusionError, check_choice
from ..utils import sqnr_db as sqnr
from .patterns import Site, find_sites
from .probe import probe

__all__ = ["fuse", "FusionReport", "FusedSite", "RolledBackSite", "ExcludedSite",
           "TOLERANCES", "sqnr"]

#: Patterns fuse() accepts but leaves to others: the linear+cross-entropy head is the Engine's loss
#: path (fusion/loss_head.py), so ``Config(fuse='all')`` can name every pattern.
_NOT_FUSED_HERE = ("linear_cross_entropy",)

#: How close a fused site must be to the stock one, per verification dtype.
#: ("rel", r): max |fused - stock| <= r * max |stock|, for each output and gradient.
#: ("sqnr", dB): signal-to-quantisation-noise ratio of fused vs stock, where bf16/fp16 rounding of
#: GEMM outputs in a different order makes elementwise bounds meaningless.
TOLERANCES = {
    torch.float64: ("rel", 1e-10),
    # fp32: the fused ops sum in another order (chunked CE, bias grad inside the epilogue); 1e-4 of
    # the largest value is ~1000x float32 epsilon and still catches any real error.
    torch.float32: ("rel", 1e-4),
    # bf16 keeps 8 mantissa bits, one rounding alone is ~48 dB; fused and stock round at different
    # points (fused keeps FP32 between the GEMM and the epilogue), so allow a few roundings.
    torch.bfloat16: ("sqnr", 30.0),
    torch.float16: ("sqnr", 40.0),
}


@dataclass
class FusedSite:
    path: str
    pattern: str
    max_abs_error: dict = field(default_factory=dict)
    """Per compared quantity ('output', 'output1', 'grad:input0', 'grad:param3'): max |fused - stock|."""
    min_sqnr_db: float = math.inf


@dataclass
class RolledBackSite:
    path: str
    pattern: str
    reason: str


@dataclass
class ExcludedSite:
    """A site ``filter_fn`` said no to; its modules are left as they are."""

    path: str
    pattern: str


@dataclass
class FusionReport:
    """What fuse() did. ``param_map`` maps each replaced Parameter to its new Parameter, or to
    ``(new Parameter, row slice)`` where weights were concatenated (QKV, SwiGLU gate/up). It keeps
    the replaced tensors alive while it is held; the Engine hands it to its plan and empties it in
    ``engine.fusion_report``."""

    fused: list[FusedSite] = field(default_factory=list)
    rolled_back: list[RolledBackSite] = field(default_factory=list)
    excluded: list[ExcludedSite] = field(default_factory=list)
    param_map: dict = field(default_factory=dict)
    verified_dtype: Optional[torch.dtype] = None
    found_by: str = "names"
    """'data flow' when sites were found by probing an example, 'names' for the name-table fallback."""

    def rows(self) -> list[tuple[str, str, str, str]]:
        out = []
        for s in self.fused:
            err = max(s.max_abs_error.values(), default=float("nan"))
            out.append((s.path, s.pattern, "fused", f"max err {err:.2e}, sqnr {s.min_sqnr_db:.1f} dB"))
        out.extend((s.path, s.pattern, "rolled back", s.reason) for s in self.rolled_back)
        out.extend((s.path, s.pattern, "excluded", "by filter_fn") for s in self.excluded)
        return out

    def summary(self, more_fused: int = 0, more_rolled_back: int = 0) -> str:
        """The counts line; ``more_*``: sites fused or rolled back outside this rewrite (the loss head)."""
        return (f"{len(self.fused) + more_fused} fused, {len(self.rolled_back) + more_rolled_back} rolled back, "
                f"{len(self.excluded)} excluded; sites found by {self.found_by}")

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"fusion ({self.summary()})")
        for col in ("site", "pattern", "result", "detail"):
            table.add_column(col)
        for row in self.rows():
            table.add_row(*row)
        return table

    def __str__(self) -> str:
        return self.format()

    def format(self, extra_rows: tuple = ()) -> str:
        """The report as text; ``extra_rows``: (site, pattern, result, detail) of sites fused outside
        this rewrite (the loss head), listed and counted with the others."""
        results = [r[2] for r in extra_rows]
        rows = [("site", "pattern", "result", "detail")] + self.rows() + list(extra_rows)
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"fusion: {self.summary(results.count('fused'), results.count('rolled back'))}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\n".join(lines)


class _VerificationFailed(Exception):
    pass


def _fresh(sample: tuple) -> tuple:
    """A copy of (args, kwargs) for one run: new leaf tensors, and copies of stateful objects (a KV
    cache the probe recorded) so the stock run cannot change what the fused run sees."""
    def copy_leaf(a):
        if isinstance(a, torch.Tensor):
            return a.detach().clone().requires_grad_(a.requires_grad)
        try:
            return copy.deepcopy(a)
        except Exception:
            return a
    return pytree.tree_map(copy_leaf, sample)


def _float_tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _seeded_run(site: Site, unit: nn.Module, args: tuple, kwargs: dict):
    """Outputs and grads (wrt the float inputs and all parameters) of one run under a fixed seed."""
    cuda = sorted({p.device.index for p in unit.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # manual_seed seeds every device: restore those in use
        torch.manual_seed(0)
        out = site.run(unit, *args, **kwargs)
    outs = _float_tensors(out)
    if not outs:
        raise _VerificationFailed(f"the unit returned {type(out).__name__}, with no floating-point tensor in it")
    inputs = [t for t in _float_tensors((args, kwargs)) if t.requires_grad]
    params = [p for p in unit.parameters() if p.requires_grad]
    differentiable = [o for o in outs if o.requires_grad]
    g = torch.Generator().manual_seed(3)
    upstream = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in differentiable]
    grads = (torch.autograd.grad(differentiable, inputs + params, upstream, allow_unused=True)
             if differentiable and inputs + params else [None] * (len(inputs) + len(params)))
    return [o.detach() for o in outs], grads[: len(inputs)], dict(zip(params, grads[len(inputs):]))


def _compare(name: str, ref, new, dtype, errors: dict, sqnrs: list) -> None:
    if new is None:
        raise _VerificationFailed(f"{name} got no gradient from the fused module")
    if ref is None:
        ref = torch.zeros_like(new)
    if ref.shape != new.shape:
        raise _VerificationFailed(f"{name}: shape {tuple(new.shape)} instead of {tuple(ref.shape)}")
    if not torch.isfinite(new).all():
        raise _VerificationFailed(f"{name} is not finite")
    err = (ref.double() - new.double()).abs().max().item() if ref.numel() else 0.0
    errors[name] = max(err, errors.get(name, 0.0))  # the worse of the two modes
    ratio = sqnr(ref, new)
    sqnrs.append(ratio)
    kind, bound = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    scale = ref.abs().max().item() if ref.numel() else 0.0
    if kind == "rel" and err > bound * max(scale, 1e-12):
        raise _VerificationFailed(f"{name} differs by {err:.3g} (allowed {bound:g} x max |stock| = {bound * scale:.3g})")
    if kind == "sqnr" and ratio < bound:
        raise _VerificationFailed(f"{name} has SQNR {ratio:.1f} dB (needs >= {bound} dB)")


def _verify(site: Site, dtype: Optional[torch.dtype]) -> FusedSite:
    """Stock and fused unit on the site's sample, outputs and every gradient compared, in the unit's
    mode and then in the other one: what a forward does only in training (a functional dropout) or
    only in eval is seen whichever mode the model was in when it was fused."""
    errors, sqnrs = {}, []
    for training in (site.unit.training, not site.unit.training):
        try:
            _verify_in_mode(site, dtype, training, errors, sqnrs)
        except _VerificationFailed as exc:
            if training == site.unit.training:
                raise
            raise _VerificationFailed(f"in {'train' if training else 'eval'} mode, {exc}") from None
    return FusedSite(site.path, site.pattern, errors, min(sqnrs, default=math.inf))


def _verify_in_mode(site: Site, dtype: Optional[torch.dtype], training: bool, errors: dict, sqnrs: list) -> None:
    stock = copy.deepcopy(site.unit).train(training)
    if dtype is not None:
        stock.to(dtype)
    first = next(iter(stock.parameters()), None)
    run_dtype = dtype or (first.dtype if first is not None else torch.float32)
    device = first.device if first is not None else torch.device("cpu")
    sample = site.sample(run_dtype, device)
    stock_inputs, fused_inputs = _fresh(sample), _fresh(sample)
    out_ref, in_ref, param_ref = _seeded_run(site, stock, *stock_inputs)
    stock_params = list(param_ref)
    trial, pmap = site.build(stock)  # may edit the copy in place: its stock results are taken
    out_new, in_new, param_new = _seeded_run(site, trial, *fused_inputs)
    if len(out_new) != len(out_ref):
        raise _VerificationFailed(f"the fused unit returned {len(out_new)} tensors instead of {len(out_ref)}")
    for i, (r, n) in enumerate(zip(out_ref, out_new)):
        _compare(f"output{i}" if i else "output", r, n, run_dtype, errors, sqnrs)
    for i, (r, n) in enumerate(zip(in_ref, in_new)):
        if r is None and n is None:
            continue  # an input the unit does not use (a recorded argument its forward ignores)
        _compare(f"grad:input{i}", r, n, run_dtype, errors, sqnrs)
    unused = set()  # parameters the unit's sample run does not reach in stock either (o_proj for qkv)
    for i, p in enumerate(stock_params):
        target = pmap.get(p, p)
        new_param, rows = target if isinstance(target, tuple) else (target, None)
        if new_param not in param_new:
            raise _VerificationFailed(f"parameter #{i} is not used by the fused module")
        if param_ref[p] is None:
            unused.add(new_param)
            continue
        grad = param_new[new_param]
        _compare(f"grad:param{i}", param_ref[p], None if grad is None else grad[rows] if rows else grad,
                 run_dtype, errors, sqnrs)
    for p, grad in param_new.items():
        if grad is None and p not in unused:
            raise _VerificationFailed("a parameter of the fused module got no gradient")


def fuse(model: nn.Module, patterns=FUSION_PATTERNS, verify: bool = True, dtype: Optional[torch.dtype] = None,
         *, example: Optional[tuple] = None,
         filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> FusionReport:
    """Swap fused modules into ``model`` in place for every site of the named patterns.

    ``example`` is ``(args, kwargs)`` as the model is called, e.g. ``((input_ids,), {})`` or
    ``((), {"input_ids": ids, "attention_mask": mask})``: the model is run once on it (grad on,
    random state and buffers restored) and sites are found from which module's output feeds which,
    whatever the modules are called, then verified on the inputs they received. Without it, sites
    are found by the names in patterns.py and verified on random inputs.
    ``filter_fn(module, fqn)`` is asked about each site (the module at the site's path: the Linear
    or LayerNorm of a pair, the module holding q/k/v, the SwiGLU MLP); False leaves it unfused and
    lists it in ``report.excluded``.
    ``verify`` checks each site before installing it (in ``dtype``, default the site's own
    parameter dtype); a site that fails is left unfused and listed with the reason.
    "linear_cross_entropy" is accepted and left to the Engine's loss path.
    Parameters that were concatenated are NEW objects: create the optimizer after fuse(), or let
    the Engine bind it (``turbotrain.optim_layout.bind_optimizer`` with the report's param_map).
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    for name in patterns:
        check_choice("fusion pattern", name, FUSION_PATTERNS)
    patterns = tuple(p for p in patterns if p not in _NOT_FUSED_HERE)
    trace = probe(model, example) if example is not None and patterns else None
    report = FusionReport(verified_dtype=dtype if verify else None,
                          found_by="names" if example is None else "data flow")
    try:
        _fuse_sites(model, find_sites(model, patterns, trace), report, filter_fn, dtype, verify)
    finally:
        if trace is not None:
            trace.release()
    return report


def _fuse_sites(model, sites, report, filter_fn, dtype, verify) -> None:
    for site in sites:
        if filter_fn is not None and not filter_fn(model.get_submodule(site.path), site.path):
            report.excluded.append(ExcludedSite(site.path, site.pattern))
            continue
        if site.problem is not None:
            report.rolled_back.append(RolledBackSite(site.path, site.pattern, site.problem))
            continue
        try:
            result = _verify(site, dtype) if verify else FusedSite(site.path, site.pattern)
        except _VerificationFailed as exc:
            report.rolled_back.append(RolledBackSite(site.path, site.pattern, f"verification failed: {exc}"))
            continue
        except Exception as exc:  # the user's forward may not run on our sample; say so, leave it
            report.rolled_back.append(RolledBackSite(
                site.path, site.pattern, f"could not run the site on a sample ({type(exc).__name__}: {exc})"))
            continue
        new_unit, pmap = site.build(site.unit)
        site.install(new_unit)
        report.param_map.update(pmap)
        report.fused.append(result)
