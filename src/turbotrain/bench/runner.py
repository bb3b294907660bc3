"""The ladder: environment first, the matmul peak, then every row in its own long-lived worker,
interleaved round by round (bench/interleave.py), a live table, then reports."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..errors import ConfigError, check_positive
from ..hardware import check_idle_threads_sleep, environment_report, print_environment, resolve_device
from ..utils import check_output_dir, require
from .ceiling import (FLOOR_METHOD, MANY_FAULTS, check_targets, floor_dtypes, floor_text, malloc_tuned, measure_floor,
                      target_lines)
from .configs import (BASELINE, INSTANCE_MARK, OPTIMIZER_IMPLEMENTATION, OPTIMIZER_SETTINGS, REFERENCE, TUNED_ROW,
                      default_configs, get_config, list_configs, resolve_names)
from .console import escape, make_console
from .flops import FLOP_CONVENTIONS, profile_step
from .interleave import run_interleaved, split_steps
from .peak import matmul_peaks
from .report import ratio_to_reference, train_loss_window
from .stats import BOOTSTRAP_RESAMPLES, slow_dtypes
from .worker import (CPU_MEMORY_METHOD, CPU_TENSOR_METHOD, CUDA_MEMORY_METHOD, WorkerSpec, fixed_batches, load_payload,
                     load_workload)

__all__ = ["LadderSettings", "run_ladder", "plan_rows", "choose_reference", "slow_dtypes", "BASELINE", "REFERENCE",
           "quick_overrides", "QUICK_CONFIGS", "DEFAULT_STEPS", "DEFAULT_WARMUP", "DEFAULT_ROUNDS", "QUICK_STEPS",
           "QUICK_WARMUP", "QUICK_ROUNDS", "MEASUREMENT"]

MFU_CONVENTIONS = ("achieved FLOP/s (flops_per_step / step time) divided by the matmul peak of the "
                   "row's compute dtype (mfu) and of bf16 (mfu_bf16, only where bf16 is at least as fast as "
                   "fp32); peaks: ")
MEASUREMENT = ("each row in its own long-lived worker, built and warmed up one at a time (untimed), then measured in "
               "interleaved rounds: every row runs its steps of the round in turn, one row at a time, the order "
               "rotated each round; every step timed alone and ended by a device sync; ratio_vs_ref = median "
               "per-round step time of the reference / of the row (the row's throughput over the reference's), "
               f"95% percentile-bootstrap interval over rounds resampled in pairs ({BOOTSTRAP_RESAMPLES} resamples, "
               "fixed seed); the A/A row is the reference again in a second worker: its interval is the noise floor")
#: Quick mode shrinks a text workload (one whose settings have these fields: hf:<model_type> too) so
#: the quick ladder (its compiled reference twice included) stays around a minute on 2 cores; the
#: header says so, and its figures are a smoke test, not a benchmark.
_QUICK_TEXT = {"d": 128, "n_layer": 2, "n_head": 4, "T": 64, "B": 4}


def quick_overrides(workload: str) -> dict:
    """The settings quick mode gives ``workload``: the small text model, or none for other workloads."""
    from ..workloads import settings_class

    return dict(_QUICK_TEXT) if {f.name for f in fields(settings_class(workload))} >= _QUICK_TEXT.keys() else {}


QUICK_CONFIGS = ("fp32-eager", "torch-amp", REFERENCE, "tt-fp32", "tt-bf16-master")
# The default CPU ladder is 10 rows of the default gpt (the reference twice). Measured on 2 cores
# (shared): an fp32 step ~1.3 s, a bf16 step ~0.5 s, torch.compile ~45 s of warm-up; 20 measured
# steps in 10 rounds of 2 (enough rounds for a bootstrap interval, enough steps for a p20-p80 band)
# plus 3 warm-up steps (compilation can take two: train mode, then a recompile) come to about 7-8
# minutes.
DEFAULT_STEPS, DEFAULT_WARMUP, DEFAULT_ROUNDS = 20, 3, 10
QUICK_STEPS, QUICK_WARMUP, QUICK_ROUNDS = 3, 2, 3


@dataclass(frozen=True)
class LadderSettings:
    """One ladder run; the CLI builds it from its flags."""

    workload: str = "gpt"
    configs: tuple[str, ...] | None = None
    """Config names in order; None for the default set on the device (QUICK_CONFIGS when quick)."""
    steps: int = DEFAULT_STEPS
    """Measured steps per row (timed, each ended by a device sync), spread over the rounds."""
    warmup: int = DEFAULT_WARMUP
    """Untimed steps first, which absorb compilation and allocator growth."""
    rounds: int = DEFAULT_ROUNDS
    """Interleaved rounds the measured steps are spread over (at most ``steps``)."""
    device: str = "auto"
    quick: bool = False
    seed: int = 0
    val_batches: int = 4
    """Fixed val batches (the same for every row) the val loss is averaged over."""
    timeout: float = 900.0
    """Seconds one worker command (start, build + warm-up, a round's steps, val) may take before
    the worker is killed and the row marked as an error."""
    overrides: dict = field(default_factory=dict)
    """Workload settings changed from its defaults (quick_overrides() in quick mode)."""
    reference: str | None = None
    """The row ratio_vs_ref is taken against; None: torch-compile-step (or its fp32 twin) when in
    the ladder, else the first peer row, else the first row."""
    aa: bool = True
    """Run the reference a second time in its own worker (the A/A row: the noise floor)."""
    payload: str | None = None
    """A user's workload pickled by turbotrain.workloads.user.save_payload (``turbotrain.bench.compare``),
    loaded instead of ``workload``; neither ``overrides`` nor quick mode's smaller model applies to it."""

    def __post_init__(self):
        if self.payload is not None and self.overrides:
            raise ConfigError("overrides change the settings of a workload by name; a user's model is built by "
                              "its model_fn as it is: change the model there")
        check_positive("steps", self.steps)
        check_positive("warmup", self.warmup, allow_zero=True)
        check_positive("rounds", self.rounds)
        check_positive("val_batches", self.val_batches)
        check_positive("timeout", self.timeout)


def _environment(device: str) -> dict:
    # fp16 on a CPU is emulated and slow to measure; its peak is added only if a row computes in it
    dtypes = ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
    return environment_report(device, dtypes=dtypes)


def _plan(settings: LadderSettings) -> tuple[str, list[str], dict, list[str]]:
    """(device, config names, workload overrides, notes for the header); raises on bad names."""
    device = resolve_device(settings.device)
    notes = []
    if settings.configs:
        names = resolve_names(settings.configs)
    elif settings.quick:
        names = [n for n in QUICK_CONFIGS if n in default_configs(device)]
    else:
        names = default_configs(device)
    if settings.reference:
        get_config(settings.reference)  # a bad --reference costs a line, not a ladder
    overrides = dict(settings.overrides)
    if settings.quick:
        if settings.payload is None:
            overrides = {**quick_overrides(settings.workload), **overrides}
        size = f"model shrunk to {overrides}" if overrides else "model at its default size"
        notes.append(f"quick mode: {settings.steps} steps in {min(settings.rounds, settings.steps)} rounds, "
                     f"{settings.warmup} warm-up, {size}; a smoke test, not a benchmark")
    return device, names, overrides, notes


def _fit_to_hardware(names: list[str], env: dict, device: str, *, default: bool, notes: list[str]) -> list[str]:
    """Where bf16/fp16 matmuls are slower than fp32 (emulated), the default ladder drops the rows that
    compute in them (each would take tens of times longer and measure the emulation) and runs their
    fp32 twins; rows named in --configs run as asked. Either way the header says so."""
    slow = slow_dtypes(env)
    dtypes = {n: get_config(n).dtype_on(device) for n in names}
    hit = [n for n in names if dtypes[n] in slow]
    if not hit:
        return names
    peaks = env["matmul_peak_flops"]
    why = "; ".join(f"{d} matmul measures {peaks[d] / 1e9:.1f} GFLOP/s here against fp32's "
                    f"{peaks['fp32'] / 1e9:.1f} ({slow[d]:.0f}x slower: no native {d} matmul)"
                    for d in dict.fromkeys(dtypes[n] for n in hit))
    if not default:
        notes.append(f"{why}; {', '.join(hit)} run as asked, and measure that emulation")
        return names
    twin = {n: get_config(n).fp32_twin for n in hit}
    out: list[str] = []
    for n in names:
        replacement = twin[n] if n in hit else n
        if replacement and replacement not in out:
            out.append(replacement)
    swaps = [f"{n} -> {t}" for n, t in twin.items() if t]
    notes.append(f"{why}; left out of the default ladder: {', '.join(hit)}"
                 + (f"; fp32 rows in their place: {', '.join(swaps)}" if swaps else "")
                 + " (name rows in --configs to run them anyway; precision='auto' picks fp32 here)")
    return out


def choose_reference(names: list[str], explicit: str | None = None) -> str:
    """The row every ratio is taken against: ``explicit``; else torch-compile-step or its fp32 twin
    when in ``names``; else the first peer row; else the first row."""
    if explicit:
        return get_config(explicit).name
    for candidate in (REFERENCE, get_config(REFERENCE).fp32_twin):
        if candidate in names:
            return candidate
    peers = [n for n in names if get_config(n).group == "peer"]
    return peers[0] if peers else names[0]


def plan_rows(names: list[str], settings: LadderSettings, notes: list[str]) -> tuple[list[str], str, str | None]:
    """(row names in ladder order, the reference, the A/A row or None): the reference is added if
    it is not among ``names``, and its second worker goes right after it."""
    reference = choose_reference(names, settings.reference)
    rows = list(names) if reference in names else [reference, *names]
    if reference not in (REFERENCE, get_config(REFERENCE).fp32_twin):
        notes.append(f"reference: {reference} ({REFERENCE}, the strongest peer, is not in this ladder)")
    aa_row = None
    if settings.aa:
        aa_row = f"{reference}{INSTANCE_MARK}2"
        rows.insert(rows.index(reference) + 1, aa_row)
    return rows, reference, aa_row


def _peak_dtypes(rows: list[str], device: str) -> list[str]:
    # fp16 on a CPU is emulated and slow to measure; its peak is added only if a row computes in it
    base = ["fp32", "bf16", "fp16"] if device == "cuda" else ["fp32", "bf16"]
    return list(dict.fromkeys([*base, *(get_config(r).dtype_on(device) for r in rows)]))


def _print_peaks(peak: dict, console) -> None:
    for dtype, v in peak["detail"].items():
        load = ", ".join(f"{x:.2f}" for x in v["loadavg"])
        console.print(f"[bold]matmul peak {dtype}[/] {v['value'] / 1e9:.1f} GFLOP/s at {escape(v['best_gemm'])} "
                      f"({v['source']}: {escape(v['reason'])}; load average {load} when measured)")


def run_ladder(settings: LadderSettings, out_dir: str | Path, console=None, workload=None) -> dict:
    """Run the ladder, write results.json, report.html and PNGs into ``out_dir``; returns the results.

    ``workload``: the workload ``settings.payload`` holds, when the caller has it loaded already
    (compare: the user's own objects, so this process does not import their script again).

    results.json is rewritten after every set-up and every round, so a crash in the display (or a
    kill) keeps what was measured.
    """
    out_dir = check_output_dir(out_dir)  # before any work: a bad --out costs a line, not a ladder
    check_idle_threads_sleep()  # so does an environment that would spoil every timing
    console = make_console(console)
    require("matplotlib", "bench", "the benchmark report's charts")

    from .live import LiveLadder
    from .report import build_results, write_reports, write_results

    device, names, overrides, notes = _plan(settings)
    if workload is None:  # builds/caches the data once, before the workers
        workload = load_payload(settings.payload) if settings.payload else load_workload(settings.workload, overrides)
    env = _environment(device)
    print_environment(env, console)
    default = not settings.configs and not settings.quick
    names = _fit_to_hardware(names, env, device, default=default, notes=notes)
    if default and (left_out := [c.name for c in list_configs() if c.name not in names]):
        notes.append(f"not in the default ladder on {device}: {', '.join(left_out)} (name them in --configs)")
    rows, reference, aa_row = plan_rows(names, settings, notes)
    step = profile_step(workload.build_model, workload.loss_fn,
                        fixed_batches(workload, "train", 1, settings.seed, device)[0])
    peak = matmul_peaks(_peak_dtypes(rows, device), device, step.gemms)
    env["square_median_peak_flops"] = env["matmul_peak_flops"]  # turbotrain env's figure, for comparison
    env["matmul_peak_flops"], env["matmul_peak_method"] = dict(peak["flops"]), peak["method"]
    _print_peaks(peak, console)
    floors = {d: measure_floor(step.gemm_calls, d, device, peak["detail"].get(d, {}).get("probe_now", 0.0))
              for d in floor_dtypes([get_config(r).dtype_on(device) for r in rows], env)}
    for line in floor_text(floors):
        console.print(f"[bold]{escape(line)}[/]")
    per_round = split_steps(settings.steps, settings.rounds)
    header = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": workload.name, "kind": workload.kind, "unit": workload.unit,
                     "items_per_step": workload.items_per_batch, "settings": workload.settings,
                     "overrides": overrides, "description": workload.description},
        "run": {"device": device, "configs": rows, "steps": sum(per_round), "warmup": settings.warmup,
                "rounds": len(per_round), "steps_per_round": per_round, "seed": settings.seed,
                "val_batches": settings.val_batches, "quick": settings.quick,
                "optimizer": {"name": "AdamW", **OPTIMIZER_SETTINGS, **OPTIMIZER_IMPLEMENTATION},
                "baseline": BASELINE, "reference": reference, "aa_row": aa_row},
        "environment": env,
        "versions": env["hardware"]["versions"],
        "flops_per_step": step.flops,
        "gemms": [{**g.to_dict(), "label": g.label} for g in step.gemms],
        "peak": peak,
        "ceiling": {"method": FLOOR_METHOD, "floors": floors},
        "flop_conventions": FLOP_CONVENTIONS,
        "mfu_conventions": MFU_CONVENTIONS + env["matmul_peak_method"],
        "measurement": MEASUREMENT,
        "memory_method": CUDA_MEMORY_METHOD if device == "cuda" else CPU_MEMORY_METHOD,
        "tensor_memory_method": None if device == "cuda" else CPU_TENSOR_METHOD,
        "train_loss": f"mean of the last {train_loss_window(sum(per_round))} measured steps' losses",
        "notes": notes,
    }
    console.print(f"[bold]workload[/] {escape(workload.name)} {escape(workload.settings or '')}  "
                  f"{step.flops / 1e9:.2f} GFLOP/step ({FLOP_CONVENTIONS})")
    console.print(f"[bold]rows[/] {escape(', '.join(rows))}; reference {escape(reference)}; "
                  f"{len(per_round)} interleaved rounds of {escape(per_round)} steps")
    for note in notes:
        console.print(f"[yellow]note[/] {escape(note)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = {row: WorkerSpec(workload=settings.workload, config=get_config(row).name, device=device,
                             warmup=settings.warmup, seed=settings.seed, val_batches=settings.val_batches,
                             overrides=overrides, threads=torch.get_num_threads(), payload=settings.payload)
             for row in rows}
    with tempfile.TemporaryDirectory(prefix="turbotrain-bench-") as tmp, \
            LiveLadder(rows, header, console, len(per_round)) as live:
        raw = run_interleaved(specs, per_round, Path(tmp), settings.timeout, live=live,
                              on_update=lambda results: write_results(build_results(header, results), out_dir))
    console.print()
    _add_missing_peaks(raw, env, device, step.gemms, header)
    results = build_results(header, raw)
    for note in _implausible_mfu(results) + _ratio_notes(results):
        header["notes"].append(note)
        console.print(f"[yellow]warning[/] {escape(note)}")
    for note in tuned_row_notes(results):
        header["notes"].append(note)
        console.print(f"[bold]tuned[/] {escape(note)}")
    for name, config in results["configs"].items():
        if config.get("status") == "FAILED":
            console.print(f"[bold red]FAILED[/] {escape(name)}: {escape(config['loss_check']['message'])}")
    results["targets"] = check_targets(results)
    for line in target_lines(results["targets"]):
        console.print(escape(line))
    paths = write_reports(results, out_dir)
    console.print("wrote " + escape(", ".join(str(p) for p in paths)))
    return results


def _add_missing_peaks(raw: dict, env: dict, device: str, gemms, header: dict) -> None:
    """A row whose trainer computes in a dtype its config did not declare still gets an MFU."""
    missing = {r["compute_dtype"] for r in raw.values() if r.get("status") == "ok"} - set(env["matmul_peak_flops"])
    if missing:
        extra = matmul_peaks(sorted(missing), device, gemms)
        env["matmul_peak_flops"].update(extra["flops"])
        header["peak"]["flops"].update(extra["flops"])
        header["peak"]["detail"].update(extra["detail"])


#: An A/A pair whose page faults a step differ by this factor (and reach ceiling.MANY_FAULTS) is told why.
AA_FAULTS_APART = 2.0


def _ratio_notes(results: dict) -> list[str]:
    """What the intervals say about the page itself: a noisy A/A pair, or a peer faster than the reference."""
    run = results["header"]["run"]
    notes = []
    if run.get("rounds", 0) < 5:
        notes.append(f"{run.get('rounds')} rounds: the ratio intervals can take only a handful of distinct values and "
                     "mean little; use --rounds 10 or more to compare rows")
    configs = results["configs"]
    aa = configs.get(run.get("aa_row") or "", {})
    if aa.get("ratio_ci95") and not aa["ratio_ci95"][0] <= 1.0 <= aa["ratio_ci95"][1]:
        lo, hi = aa["ratio_ci95"]
        notes.append(f"the A/A row's interval ({lo:.3f}-{hi:.3f}) excludes 1.0: two workers of one config differ "
                     "by more than the bootstrap expects (placement, a noisy neighbour); read small ratios with care")
        faults = [configs.get(run.get("reference") or "", {}).get("page_faults_per_step"), aa.get("page_faults_per_step")]
        if None not in faults and not malloc_tuned(results["header"]) \
                and max(faults) >= max(MANY_FAULTS, AA_FAULTS_APART * min(faults)):
            notes.append(f"the two faulted {faults[0]:,.0f} and {faults[1]:,.0f} pages a measured step: glibc's mmap "
                         "threshold moves with each process's history, so the same step maps its buffers afresh more "
                         "often in one worker than in the other; --malloc-tuned removes that for every row alike")
    if run.get("reference") not in (REFERENCE, get_config(REFERENCE).fp32_twin):
        return notes  # a stand-in reference (not the strongest peer) is expected to be beaten
    for name, config in configs.items():
        ci = config.get("ratio_ci95")
        if config.get("group") == "peer" and name not in (run.get("reference"), run.get("aa_row")) and ci and ci[0] > 1:
            notes.append(f"peer {name} measured faster than the reference {run['reference']} "
                         f"({config['ratio_vs_ref']:.2f}x, interval {ci[0]:.2f}-{ci[1]:.2f})")
    return notes


def tuned_row_notes(results: dict) -> list[str]:
    """The tuned row against the fastest other turbotrain row of the same ladder, paired over rounds.

    This is the comparison ``turbotrain tune`` promises to win or tie: its ratio (> 1: the tuned
    config is faster) with the 95% bootstrap interval, and whether the interval separates them.
    """
    configs = results["configs"]
    tuned = configs.get(TUNED_ROW)
    if not tuned or tuned.get("status") not in ("ok", "FAILED") or not tuned.get("round_seconds"):
        return []
    others = {name: c for name, c in configs.items()
              if name != TUNED_ROW and c.get("group") == "turbotrain" and c.get("status") == "ok"
              and c.get("ratio_vs_ref") is not None}
    if not others:
        return []
    best = max(others, key=lambda name: others[name]["ratio_vs_ref"])
    ratio, ci = ratio_to_reference(tuned, others[best])
    if ratio is None:
        return []
    verdict = ("faster" if ci[0] > 1 else "slower" if ci[1] < 1
               else "not distinguishable within the noise (the interval holds 1.0)")
    return [f"{TUNED_ROW} against the fastest other turbotrain row, {best}: {ratio:.3f}x "
            f"(95% interval {ci[0]:.3f}-{ci[1]:.3f}, paired over rounds): {verdict}"]


def _implausible_mfu(results: dict) -> list[str]:
    """Rows faster than their peak: the cached peak was likely measured on a busy machine."""
    notes = []
    for name, config in results["configs"].items():
        value = config.get("metrics", {}).get("mfu", {}).get("median")
        if value is not None and value > 1.0:
            notes.append(f"{name}: MFU {value:.0%} > 100%, so the {config['compute_dtype']} matmul peak is too low "
                         "(every trial measured while the machine was busy?); run again with TURBOTRAIN_REMEASURE=1")
    return notes
