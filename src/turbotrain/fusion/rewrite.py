"""fuse(model): find fusable sites, swap in fused modules, verify each one, roll back failures.

Each site is verified before the real model is touched: the site's unit is deep-copied (and cast
to ``dtype`` when given), run stock and fused on a sample made from its shapes under one seed, and
the output, the input grads and every parameter grad are compared. Only then is the real unit
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
from typing import Optional

import torch
from torch import nn

from ..config import FUSION_PATTERNS
from ..errors import FusionError, check_choice
from .patterns import Site, find_sites

__all__ = ["fuse", "FusionReport", "FusedSite", "RolledBackSite", "rebuild_optimizer", "TOLERANCES", "sqnr"]

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


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - test|^2) in dB; inf when they are equal."""
    ref, err = reference.double(), (reference.double() - test.double())
    noise = err.pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0.0 else -math.inf


@dataclass
class FusedSite:
    path: str
    pattern: str
    max_abs_error: dict = field(default_factory=dict)
    """Per compared quantity ('output', 'grad:input0', 'grad:<param>'): max |fused - stock|."""
    min_sqnr_db: float = math.inf


@dataclass
class RolledBackSite:
    path: str
    pattern: str
    reason: str


@dataclass
class FusionReport:
    """What fuse() did. ``param_map`` maps each replaced Parameter to its new Parameter, or to
    ``(new Parameter, row slice)`` where weights were concatenated (QKV, SwiGLU gate/up)."""

    fused: list[FusedSite] = field(default_factory=list)
    rolled_back: list[RolledBackSite] = field(default_factory=list)
    param_map: dict = field(default_factory=dict)
    verified_dtype: Optional[torch.dtype] = None

    def rows(self) -> list[tuple[str, str, str, str]]:
        out = []
        for s in self.fused:
            err = max(s.max_abs_error.values(), default=float("nan"))
            out.append((s.path, s.pattern, "fused", f"max err {err:.2e}, sqnr {s.min_sqnr_db:.1f} dB"))
        out.extend((s.path, s.pattern, "rolled back", s.reason) for s in self.rolled_back)
        return out

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"fusion ({len(self.fused)} fused, {len(self.rolled_back)} rolled back)")
        for col in ("site", "pattern", "result", "detail"):
            table.add_column(col)
        for row in self.rows():
            table.add_row(*row)
        return table

    def __str__(self) -> str:
        rows = [("site", "pattern", "result", "detail")] + self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"fusion: {len(self.fused)} fused, {len(self.rolled_back)} rolled back"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\n".join(lines)


class _VerificationFailed(Exception):
    pass


def _seeded_run(site: Site, unit: nn.Module, args: tuple):
    """Output and grads (wrt the float inputs and all parameters) of one run under a fixed seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = site.run(unit, *args)
    if not isinstance(out, torch.Tensor):
        raise _VerificationFailed(f"the unit returned {type(out).__name__}, not a tensor")
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [p for p in unit.parameters() if p.requires_grad]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, inputs + params, upstream, allow_unused=True)
    return out.detach(), grads[: len(inputs)], dict(zip(params, grads[len(inputs):]))


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
    errors[name] = err
    ratio = sqnr(ref, new)
    sqnrs.append(ratio)
    kind, bound = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    scale = ref.abs().max().item() if ref.numel() else 0.0
    if kind == "rel" and err > bound * max(scale, 1e-12):
        raise _VerificationFailed(f"{name} differs by {err:.3g} (allowed {bound:g} x max |stock| = {bound * scale:.3g})")
    if kind == "sqnr" and ratio < bound:
        raise _VerificationFailed(f"{name} has SQNR {ratio:.1f} dB (needs >= {bound} dB)")


def _verify(site: Site, dtype: Optional[torch.dtype]) -> FusedSite:
    stock = copy.deepcopy(site.unit)
    if dtype is not None:
        stock.to(dtype)
    first = next(iter(stock.parameters()), None)
    run_dtype = dtype or (first.dtype if first is not None else torch.float32)
    device = first.device if first is not None else torch.device("cpu")
    args = site.sample(run_dtype, device)
    out_ref, in_ref, param_ref = _seeded_run(site, stock, args)
    stock_params = list(param_ref)
    trial, pmap = site.build(stock)  # may edit the copy in place: its stock results are taken
    args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    out_new, in_new, param_new = _seeded_run(site, trial, args)
    errors, sqnrs = {}, []
    _compare("output", out_ref, out_new, run_dtype, errors, sqnrs)
    for i, (r, n) in enumerate(zip(in_ref, in_new)):
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
    return FusedSite(site.path, site.pattern, errors, min(sqnrs, default=math.inf))


def fuse(model: nn.Module, patterns=FUSION_PATTERNS, verify: bool = True,
         dtype: Optional[torch.dtype] = None, *, head: Optional[str] = None) -> FusionReport:
    """Swap fused modules into ``model`` in place for every site of the named patterns.

    ``verify`` checks each site on a sample before installing it (in ``dtype``, default the
    site's own parameter dtype); a site that fails is left unfused and listed with the reason.
    ``head`` names the Linear to fuse with the loss when it is not called ``lm_head``.
    Parameters that were concatenated are NEW objects: rebuild the optimizer with
    :func:`rebuild_optimizer` (or create it after fuse()).
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    for name in patterns:
        check_choice("fusion pattern", name, FUSION_PATTERNS)
    if head is not None and head not in dict(model.named_modules()):
        raise FusionError(f"head={head!r} is not a module of the model; pass the dotted path of the head Linear")
    report = FusionReport(verified_dtype=dtype if verify else None)
    for site in find_sites(model, tuple(patterns), head=head):
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
    model.__dict__.setdefault("_turbotrain_param_map", {}).update(report.param_map)
    return report


def rebuild_optimizer(optimizer: torch.optim.Optimizer, model_or_report) -> torch.optim.Optimizer:
    """A new optimizer of the same class and settings whose groups point at the fused parameters.

    Only valid before the optimizer has state (before its first step): moments of concatenated
    parameters cannot be carried over meaningfully. Create the optimizer after fuse() to avoid this.
    """
    pmap = (model_or_report.param_map if isinstance(model_or_report, FusionReport)
            else model_or_report.__dict__.get("_turbotrain_param_map", {}))
    if any(len(s) for s in optimizer.state.values()):
        raise FusionError("the optimizer already has state; call rebuild_optimizer before its first step, "
                          "or create the optimizer after turbotrain.fusion.fuse()")
    groups, placed = [], {}
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        params = []
        for p in group["params"]:
            target = pmap.get(p, p)
            target = target[0] if isinstance(target, tuple) else target
            if target in placed:
                if placed[target][1] != settings:
                    raise FusionError("parameters fused into one tensor sit in param groups with different "
                                      "settings; put q/k/v (and gate/up) in one group, or fuse without them")
                continue
            placed[target] = (index, settings)
            params.append(target)
        groups.append({**settings, "params": params})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)
