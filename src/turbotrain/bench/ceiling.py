"""The project's performance targets, checked on every ladder, and the ceiling that says how far any
schedule of the same matmuls could go on this machine.

The targets (README, "Performance targets") are judged on the fastest turbotrain row whose val loss
kept its tolerance: its throughput at least ``speed`` times the reference's, with an interval that
excludes 1.0; its MFU at least ``mfu`` of the measured peak of the dtype it computes in; and, from
``long_sequence`` tokens a sequence, its peak memory at most ``memory`` times the reference's.

A missed target comes with where the time goes. The **GEMM floor** is the time the step's own
matrix multiplies take when each is timed alone at its best (``measure_floor``: every shape the
plain fp32 forward + backward dispatched, bench/flops.py, in each compute dtype, at the maximum
FLOP/s over a few trials, times its number of calls). Fusion, compilation and scheduling remove
work around the matmuls, not the matmuls, so a row that performs those GEMMs cannot be faster
than the reference by more than ``reference step / floor``: the **ceiling**. It is an upper bound
and a generous one: attention kernels that do not dispatch mm/bmm (flash attention), the loss,
the optimizer step and every elementwise op come on top of the floor, and a row that recomputes
(checkpointing) repeats GEMMs the floor counts once. A row that merges GEMMs (fused QKV) runs the
same FLOPs in fewer, larger calls and can beat the floor by the few percent a larger shape runs
faster; the ceiling says so rather than hiding it.

What the rows' GEMMs cost *inside* the step comes next to it (bench/split.py, profiled in each
row's worker): in a step the same GEMMs run slower than alone (fresh pages for their outputs,
operands evicted by the ops between them), and the split says by how much, how long the attention
kernels and the optimizer take, and what is left.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .flops import Gemm
from .peak import PeakSettings, best_gemm_flops
from .stats import slow_dtypes

__all__ = ["Targets", "TARGETS", "FLOOR_SETTINGS", "measure_floor", "floor_dtypes", "check_targets",
           "target_lines", "floor_text", "malloc_tuned", "FLOOR_METHOD"]


@dataclass(frozen=True)
class Targets:
    speed: float = 1.25
    """The best turbotrain row's throughput over the reference's (torch-compile-step or its fp32 twin)."""
    mfu: float = 0.75
    """Its MFU against the measured matmul peak of its compute dtype."""
    memory: float = 0.70
    """Its peak memory over the reference's (tensors where the CPU rows report them) ..."""
    long_sequence: int = 1024
    """... once sequences are at least this many tokens (the memory target is a long-sequence one)."""


TARGETS = Targets()


#: The floor's trials: the peak's (best of 5, each >= 50 ms), giving up sooner on a slow shape.
FLOOR_SETTINGS = PeakSettings(shape_seconds=1.0)


FLOOR_METHOD = ("each GEMM shape the plain model's fp32 forward + backward dispatched (mm, addmm, bmm, baddbmm; "
                "operand layouts as dispatched), timed alone in the row's compute dtype at the best of 5 trials, "
                "or at the best an earlier run on this machine cached if that was faster (a busy moment cannot "
                "raise the floor; the cache is dropped when the square probe shows the machine faster than when it "
                "was written), times its calls per step; summed. The ceiling is the reference's median step over "
                "the floor: no schedule of those GEMMs is faster than the floor")


def floor_dtypes(dtypes, environment: dict) -> list[str]:
    """The dtypes worth a floor: those the rows compute in, less the emulated ones (bf16 on an
    AVX2-only CPU would take minutes to time and bounds nothing the ladder compares)."""
    slow = slow_dtypes(environment)
    return [d for d in dict.fromkeys(dtypes) if d not in slow]


def measure_floor(gemm_calls, dtype: str, device: str, probe: float = 0.0,
                  settings: PeakSettings = FLOOR_SETTINGS) -> dict:
    """``{"seconds", "gemms": [{label, calls, seconds_each, flops_per_s}]}``: the step's GEMMs at
    their best speed in ``dtype``, heaviest first. ``probe`` is this run's square-GEMM probe
    (peak.matmul_peak's ``probe_now``): it decides whether the speeds a previous run cached still
    describe this machine (peak.best_gemm_flops keeps the faster of the two)."""
    speeds = best_gemm_flops([g for g, _ in gemm_calls], dtype, device, probe, settings)
    rows, total = [], 0.0
    for gemm, calls in gemm_calls:
        seconds = gemm.flops / speeds[gemm.label]
        total += seconds * calls
        rows.append({"label": gemm.label, "calls": calls, "seconds_each": seconds, "flops_per_s": speeds[gemm.label]})
    return {"seconds": total, "gemms": rows}


def _memory(config: dict) -> tuple[str, float] | None:
    metrics = config.get("metrics", {})
    for name in ("tensor_peak", "peak_memory"):
        if name in metrics:
            return name, metrics[name]["median"]
    return None


def _sequence_length(header: dict) -> int | None:
    settings = header["workload"].get("settings") or {}
    value = settings.get("T")
    return int(value) if isinstance(value, (int, float)) else None


def _check(name: str, target: str, value: str, met: bool | None, why: str = "") -> dict:
    return {"name": name, "target": target, "value": value, "met": met, "why": why}


def check_targets(results: dict, targets: Targets = TARGETS) -> dict | None:
    """The targets judged on this ladder, with the ceiling and where the time goes; None when the
    ladder has no turbotrain row measured against a reference."""
    header, configs = results["header"], results["configs"]
    reference_name = header["run"].get("reference")
    reference = configs.get(reference_name or "")
    if not reference or "metrics" not in reference:
        return None
    # every turbotrain row counts, whichever part of the ladder it is in (its main rows, memory, ablations)
    ran = {n: c for n, c in configs.items() if c.get("group") != "peer" and c.get("ratio_vs_ref") is not None}
    kept = {n: c for n, c in ran.items() if c.get("status") == "ok"}
    if not ran:
        return None
    out: dict = {"targets": asdict(targets), "reference": reference_name, "checks": [], "notes": []}
    faster_failed = [n for n, c in ran.items() if n not in kept
                     and (not kept or c["ratio_vs_ref"] > max(k["ratio_vs_ref"] for k in kept.values()))]
    if faster_failed:
        out["notes"].append(f"faster but FAILED its loss check, so not counted: {', '.join(faster_failed)}")
    if not kept:
        out["row"] = None
        out["checks"].append(_check("loss", "", "every turbotrain row FAILED its loss check", False))
        return out
    best = max(kept, key=lambda n: kept[n]["ratio_vs_ref"])
    row = kept[best]
    out["row"] = best
    ratio, (lo, hi) = row["ratio_vs_ref"], row["ratio_ci95"]
    out["checks"].append(_check("speed", f">= {targets.speed:g}x {reference_name}, interval above 1.0",
                                f"{ratio:.2f}x ({lo:.2f}-{hi:.2f})", ratio >= targets.speed and lo > 1.0))
    mfu = row["metrics"].get("mfu", {}).get("median")
    out["checks"].append(_check("mfu", f">= {targets.mfu:.0%} of the {row['compute_dtype']} matmul peak",
                                "not measured" if mfu is None else f"{mfu:.1%}",
                                None if mfu is None else mfu >= targets.mfu))
    check = row.get("loss_check", {})
    out["checks"].append(_check("loss", "", check.get("message", "not checked"), check.get("passed")))
    out["checks"].append(_memory_check(header, kept, best, reference, targets))
    out["ceiling"] = _ceiling(header, reference, {reference_name: reference, best: row})
    below = [n for n, r in (out["ceiling"] or {}).get("rows", {}).items() if r["rest_seconds"] < 0]
    if below:
        out["notes"].append(f"{', '.join(below)} ran faster than the GEMM floor, so the floor is too high (measured "
                            "while the machine was busy?): read the ceiling as a guess and run again with "
                            "TURBOTRAIN_REMEASURE=1 on a quiet machine")
    return out


def _memory_check(header: dict, kept: dict, best: str, reference: dict, targets: Targets) -> dict:
    target = f"<= {targets.memory:g}x the reference's peak memory at T >= {targets.long_sequence}"
    ref_memory, row_memory = _memory(reference), _memory(kept[best])
    if not ref_memory or not row_memory or ref_memory[0] != row_memory[0]:
        return _check("memory", target, "not measured", None)
    share = row_memory[1] / ref_memory[1]
    value = f"{share:.2f}x ({row_memory[0].replace('_', ' ')})"
    tokens = _sequence_length(header)
    lean_row = _lean_row(header)
    if tokens is None or tokens < targets.long_sequence:
        return _check("memory", target, value, None,
                      f"T={tokens} here: run --set T={targets.long_sequence} --configs {lean_row},... to judge it"
                      if tokens else "not a sequence workload")
    if share <= targets.memory:
        return _check("memory", target, value, True)
    lean = [n for n, c in kept.items() if (m := _memory(c)) and m[0] == ref_memory[0]
            and m[1] / ref_memory[1] <= targets.memory]
    why = ""
    if lean:
        fastest = max(lean, key=lambda n: kept[n]["ratio_vs_ref"])
        why = (f"{fastest} meets it ({_memory(kept[fastest])[1] / ref_memory[1]:.2f}x) at "
               f"{kept[fastest]['ratio_vs_ref']:.2f}x the reference's speed")
    elif lean_row not in kept:
        why = f"no row here meets it; the checkpointing rows are off the default ladder: add {lean_row} with --configs"
    return _check("memory", target, value, False, why)


def _lean_row(header: dict) -> str:
    """The row that met the memory target at speed on gpt and user-gpt (selective checkpointing, the fused
    head, compiled; benchmarks/2026-12-06-avx2-selective-checkpoint.md), as this ladder would name it."""
    twin = "-fp32" if str(header.get("run", {}).get("reference", "")).endswith("-fp32") else ""
    return f"tt-ckpt-selective-fused-ce-compile{twin}"


def _ceiling(header: dict, reference: dict, rows: dict) -> dict | None:
    floors = header.get("ceiling", {}).get("floors", {})
    if not floors:
        return None
    ref_step = reference["metrics"]["step_time"]["median"]
    out = {"reference_step_seconds": ref_step, "rows": {}}
    for name, config in rows.items():
        floor = floors.get(config["compute_dtype"])
        if not floor or not floor["seconds"]:
            continue
        step = config["metrics"]["step_time"]["median"]
        out["rows"][name] = {"compute_dtype": config["compute_dtype"], "step_seconds": step,
                             "gemm_floor_seconds": floor["seconds"], "rest_seconds": step - floor["seconds"],
                             "ceiling_vs_ref": ref_step / floor["seconds"],
                             "split": config.get("step_split"),  # bench/split.py: measured inside the step
                             "page_faults_per_step": config.get("page_faults_per_step")}
    if out["rows"]:
        out["malloc_tuned"] = malloc_tuned(header)
        return out
    return None


def malloc_tuned(header: dict) -> bool:
    """Whether the ladder's workers started with MALLOC_* settings (``--malloc-tuned`` or the shell's)."""
    return bool(header.get("environment", {}).get("malloc_env"))


def target_lines(verdict: dict | None) -> list[str]:
    """The verdict as plain lines for the terminal and the report."""
    if not verdict:
        return []
    targets = Targets(**verdict["targets"])
    lines = [f"targets, judged on the fastest turbotrain row that kept its loss: {verdict.get('row') or 'none'}"]
    for c in verdict["checks"]:
        state = {True: "met", False: "NOT met", None: "not judged"}[c["met"]]
        against = f" against {c['target']}" if c["target"] else ""
        lines.append(f"  {c['name']}: {c['value']}{against}: {state}" + (f" ({c['why']})" if c["why"] else ""))
    ceiling = verdict.get("ceiling")
    if ceiling:
        for name, r in ceiling["rows"].items():
            share = r["gemm_floor_seconds"] / r["step_seconds"]
            lines.append(f"  where the time goes, {name} ({r['compute_dtype']}): {r['step_seconds']:.3f} s a step = "
                         f"{r['gemm_floor_seconds']:.3f} s of GEMMs at their best speed ({share:.0%}) + "
                         f"{r['rest_seconds']:.3f} s of everything else (attention kernels, the loss, the optimizer, "
                         f"elementwise work, GEMMs below their best)")
            lines.extend(_split_lines(r, ceiling.get("malloc_tuned", False)))
        if not any(r.get("split") for r in ceiling["rows"].values()):
            lines.append("  (the split inside the step is measured on CPU rows only: on CUDA the host's op times "
                         "say when kernels were queued, not how long they ran)")
        row = verdict.get("row")
        best = ceiling["rows"].get(row) if row else None
        if best:
            reach = best["ceiling_vs_ref"]
            lines.append(f"  ceiling: {reach:.2f}x the reference, if {row} did nothing but its GEMMs at their best "
                         f"({best['compute_dtype']})")
            if reach < targets.speed:
                lines.append(f"  so the {targets.speed:g}x target is out of reach of any schedule of these GEMMs on "
                             "this machine: it needs fewer FLOPs or faster matmuls (a dtype with native support)")
            elif best["step_seconds"] > ceiling["reference_step_seconds"] / targets.speed:
                needed = ceiling["reference_step_seconds"] / targets.speed
                ref_rest = ceiling["rows"].get(verdict["reference"], {}).get("rest_seconds")
                spent = f" (the reference spends {ref_rest:.3f} s there)" if ref_rest is not None else ""
                lines.append(f"  {targets.speed:g}x needs a step of {needed:.3f} s: "
                             f"{needed - best['gemm_floor_seconds']:.3f} s for everything but the GEMMs at their "
                             f"best{spent}")
    lines.extend(f"  note: {n}" for n in verdict["notes"])
    return lines


#: GEMMs this much slower in the step than at their floor, with this many page faults a step, get the
#: allocator hint (a step that maps its buffers afresh pays for it inside the GEMMs that write them).
SLOW_GEMMS, MANY_FAULTS = 1.10, 2000


def _split_lines(row: dict, malloc_tuned: bool) -> list[str]:
    split, faults = row.get("split"), row.get("page_faults_per_step")
    if not split:
        return []
    gemm, floor = split["gemm"], row["gemm_floor_seconds"]
    line = (f"    inside the step (profiled: {split['step']:.3f} s a step): GEMMs {gemm:.3f} s ({gemm / floor:.2f}x "
            f"their floor), attention kernels {split['attention']:.3f} s, optimizer {split['optimizer']:.3f} s, "
            f"the rest {split['rest']:.3f} s")
    if faults is not None:
        line += f"; {faults:,.0f} page faults a measured step"
    lines = [line]
    if faults is not None and faults >= MANY_FAULTS and gemm >= SLOW_GEMMS * floor and not malloc_tuned:
        lines.append("    the step maps fresh pages for its buffers each time (glibc unmaps large freed blocks): "
                     "--malloc-tuned keeps them mapped, for every row alike")
    return lines


def floor_text(floors: dict) -> list[str]:
    """One line per dtype for the ladder's preamble."""
    return [f"GEMM floor {dtype}: {f['seconds']:.3f} s a step over {len(f['gemms'])} shapes "
            f"({sum(g['calls'] for g in f['gemms'])} calls), each timed alone at its best"
            for dtype, f in floors.items() if math.isfinite(f["seconds"])]
