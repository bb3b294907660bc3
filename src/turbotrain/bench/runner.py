"""The ladder: environment first, then every config in its own worker, a live table, then reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import check_positive
from ..hardware import environment_report, measure_matmul_peak, print_environment, resolve_device
from .configs import BASELINE, OPTIMIZER_SETTINGS, default_configs, get_config, list_configs, resolve_names
from .flops import FLOP_CONVENTIONS, count_step_flops
from .report import train_loss_window
from .stats import slow_dtypes
from .worker import CPU_MEMORY_METHOD, CUDA_MEMORY_METHOD, WorkerSpec, fixed_batches, load_workload

__all__ = ["LadderSettings", "run_ladder", "run_worker", "slow_dtypes", "BASELINE", "QUICK_OVERRIDES", "QUICK_CONFIGS",
           "DEFAULT_STEPS", "DEFAULT_WARMUP", "QUICK_STEPS", "QUICK_WARMUP"]

MFU_CONVENTIONS = ("achieved FLOP/s (flops_per_step / step time) divided by the measured matmul peak of the "
                   "row's compute dtype (mfu) and of bf16 (mfu_bf16, only where bf16 is at least as fast as "
                   "fp32); peaks: ")
#: Quick mode shrinks the model so four rows finish in well under a minute on 2 cores; the header
#: says so, and its figures are a smoke test, not a benchmark.
QUICK_OVERRIDES = {"gpt": {"d": 128, "n_layer": 2, "n_head": 4, "T": 64, "B": 4}}
QUICK_CONFIGS = ("fp32-eager", "torch-amp", "tt-fp32", "tt-bf16-master")
# The default CPU ladder is 8 rows of the default gpt. Measured on 2 cores (shared): an fp32 step
# ~1.3 s, a bf16 step ~0.5 s, torch.compile ~45 s of warm-up; with ~5 s of process start, build and
# val per row, 20 measured steps (enough for a p20-p80 band) plus 3 warm-up steps (compilation can
# take two: train mode, then a recompile) come to about 5-6 minutes.
DEFAULT_STEPS, DEFAULT_WARMUP = 20, 3
QUICK_STEPS, QUICK_WARMUP = 3, 2


@dataclass(frozen=True)
class LadderSettings:
    """One ladder run; the CLI builds it from its flags."""

    workload: str = "gpt"
    configs: tuple[str, ...] | None = None
    """Config names in order; None for the default set on the device (QUICK_CONFIGS when quick)."""
    steps: int = DEFAULT_STEPS
    """Measured steps per row (timed, each ended by a device sync)."""
    warmup: int = DEFAULT_WARMUP
    """Untimed steps first, which absorb compilation and allocator growth."""
    device: str = "auto"
    quick: bool = False
    seed: int = 0
    val_batches: int = 4
    """Fixed val batches (the same for every row) the val loss is averaged over."""
    timeout: float = 900.0
    """Seconds a row may take before its worker is killed and the row marked as an error."""
    overrides: dict = field(default_factory=dict)
    """Workload settings changed from its defaults (QUICK_OVERRIDES in quick mode)."""

    def __post_init__(self):
        check_positive("steps", self.steps)
        check_positive("warmup", self.warmup, allow_zero=True)
        check_positive("val_batches", self.val_batches)
        check_positive("timeout", self.timeout)


def run_worker(spec: WorkerSpec, workdir: Path, timeout: float, on_progress=None) -> dict:
    """Run one row in ``python -m turbotrain.bench.worker``; a result dict whatever happens to it."""
    spec_path, result_path = workdir / f"{spec.config}.spec.json", workdir / f"{spec.config}.result.json"
    stderr_path = workdir / f"{spec.config}.stderr"
    spec_path.write_text(json.dumps(asdict(spec)))
    cmd = [sys.executable, "-m", "turbotrain.bench.worker", str(spec_path), str(result_path)]
    with open(stderr_path, "w") as stderr:
        # own session, so a timeout also ends the worker's children (torch.compile's compile pool)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        reader = threading.Thread(target=_read_progress, args=(proc.stdout, on_progress), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            reason = f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reason = f"timed out after {timeout:.0f} s (raise --timeout)"
        reader.join()
    if result_path.exists():
        return json.loads(result_path.read_text())
    tail = stderr_path.read_text().strip().splitlines()[-1:] or ["no output"]
    return {"status": "error", "error": f"worker died ({reason}): {tail[0]}"}


def _read_progress(stream, on_progress) -> None:
    for line in stream:  # only progress comes through stdout; the row's result comes through a file
        if line.startswith("PROGRESS ") and on_progress:
            done, total = map(int, line.split()[1:3])
            on_progress(done, total)


def _environment(device: str) -> dict:
    # fp16 on a CPU is emulated and slow to measure; its peak is added only if a row computes in it
    dtypes = ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
    return environment_report(device, dtypes=dtypes)


def _add_missing_peak(env: dict, result: dict, device: str) -> None:
    """Measure (or read from the cache) the peak of a finished row's compute dtype if it is missing."""
    dtype = result.get("compute_dtype")
    if result.get("status") == "ok" and dtype not in env["matmul_peak_flops"]:
        env["matmul_peak_flops"][dtype] = measure_matmul_peak(dtype, device)


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
    overrides = dict(settings.overrides)
    if settings.quick:
        overrides = {**QUICK_OVERRIDES.get(settings.workload, {}), **overrides}
        size = f"model shrunk to {overrides}" if overrides else "model at its default size"
        notes.append(f"quick mode: {settings.steps} steps, {settings.warmup} warm-up, {size}; "
                     "a smoke test, not a benchmark")
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


def run_ladder(settings: LadderSettings, out_dir: str | Path, console=None) -> dict:
    """Run the ladder, write results.json, report.html and PNGs into ``out_dir``; returns the results."""
    from rich.console import Console

    from .live import LiveLadder
    from .report import build_results, write_reports

    # a log file or pipe gets a wide table rather than rich's 80-column default, which folds every cell
    console = console or (Console() if sys.stdout.isatty() else Console(width=160))
    device, names, overrides, notes = _plan(settings)
    workload = load_workload(settings.workload, overrides)  # builds/caches the data once, before the workers
    env = _environment(device)
    print_environment(env, console)
    default = not settings.configs and not settings.quick
    names = _fit_to_hardware(names, env, device, default=default, notes=notes)
    if default and (left_out := [c.name for c in list_configs() if c.name not in names]):
        notes.append(f"not in the default ladder on {device}: {', '.join(left_out)} (name them in --configs)")
    flops = count_step_flops(workload.build_model, workload.loss_fn,
                             fixed_batches(workload, "train", 1, settings.seed, device)[0])
    header = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": workload.name, "kind": workload.kind, "unit": workload.unit,
                     "items_per_step": workload.items_per_batch, "settings": workload.settings,
                     "overrides": overrides, "description": workload.description},
        "run": {"device": device, "configs": names, "steps": settings.steps, "warmup": settings.warmup,
                "seed": settings.seed, "val_batches": settings.val_batches, "quick": settings.quick,
                "optimizer": {"name": "AdamW", **OPTIMIZER_SETTINGS}, "baseline": BASELINE},
        "environment": env,
        "versions": env["hardware"]["versions"],
        "flops_per_step": flops,
        "flop_conventions": FLOP_CONVENTIONS,
        "mfu_conventions": MFU_CONVENTIONS + env["matmul_peak_method"],
        "memory_method": CUDA_MEMORY_METHOD if device == "cuda" else CPU_MEMORY_METHOD,
        "train_loss": f"mean of the last {train_loss_window(settings.steps)} measured steps' losses",
        "notes": notes,
    }
    console.print(f"[bold]workload[/] {workload.name} {workload.settings or ''}  "
                  f"{flops / 1e9:.2f} GFLOP/step ({FLOP_CONVENTIONS})")
    for note in notes:
        console.print(f"[yellow]note[/] {note}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="turbotrain-bench-") as tmp, \
            LiveLadder(names, header, console, settings.warmup + settings.steps + 1) as live:
        for name in names:
            spec = WorkerSpec(workload=settings.workload, config=name, device=device, steps=settings.steps,
                              warmup=settings.warmup, seed=settings.seed, val_batches=settings.val_batches,
                              overrides=overrides, threads=torch.get_num_threads())
            live.start(name)
            raw[name] = run_worker(spec, Path(tmp), settings.timeout, live.progress)
            _add_missing_peak(env, raw[name], device)
            live.finish(name, raw[name])
    console.print()
    results = build_results(header, raw)
    for note in _implausible_mfu(results):
        header["notes"].append(note)
        console.print(f"[yellow]warning[/] {note}")
    paths = write_reports(results, out_dir)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return results


def _implausible_mfu(results: dict) -> list[str]:
    """Rows faster than their peak: the cached peak was likely measured on a busy machine."""
    notes = []
    for name, config in results["configs"].items():
        value = config.get("metrics", {}).get("mfu", {}).get("median")
        if value is not None and value > 1.0:
            notes.append(f"{name}: MFU {value:.0%} > 100%, so the cached {config['compute_dtype']} matmul peak "
                         "is too low (measured while the machine was busy?); run `turbotrain env --remeasure`")
    return notes
