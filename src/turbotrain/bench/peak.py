"""The matmul peak every MFU is divided by: the best this machine does, at the model's own shapes.

A peak is a *maximum*: the highest FLOP/s seen over repeated trials, each at one of the model's
heaviest GEMM shapes (as the step dispatches them, operand layouts included: bench/flops.py) or at
a square shape in both layouts. A median would fold in whatever else the machine was doing, and a
denominator that is too low makes every MFU too high; a maximum can only be lowered by the machine
being busy for every trial, and the load average at the time is recorded next to it.

Peaks are cached in ``$TURBOTRAIN_CACHE/bench-peaks.json`` (turbotrain.hardware.cache_dir()), keyed
by device, GPU, dtype, CPU model and matmul features, torch version, thread count and the shapes.
Every ladder first runs a quick probe (the square shape, a few short trials) and compares it with
the probe recorded when the cached peak was measured: if the two differ by more than
PROBE_TOLERANCE, the machine is not the one the cache describes (busier then, or now, or changed)
and the peak is measured again. A re-measurement that comes out below the cached peak while the
probe is also lower keeps the cached peak: the machine is busier now, and a maximum is only ever
lowered by asking (``force``). ``force=True`` (``TURBOTRAIN_REMEASURE=1``) always re-measures.
Every entry holds the square shapes too, so a workload whose shapes are new to the cache (measured
now) gets at least the best square figure an earlier ladder on this machine recorded.

turbotrain.hardware's ``measure_matmul_peak`` (``turbotrain env``) is the square shape alone, timed
with the same trials (hardware.timed_trials); the ladder keeps it in its header for comparison only.
``turbotrain env --remeasure`` clears this cache too (clear_cache).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from ..hardware import cache_dir, default_matmul_size, detect, timed_trials
from ..utils import atomic_write
from .flops import Gemm

__all__ = ["PeakSettings", "matmul_peak", "matmul_peaks", "best_gemm_flops", "measure_gemm", "quick_probe", "square_gemms", "square_size", "peak_method",
           "clear_cache", "PROBE_TOLERANCE", "CACHE_FILE"]

logger = logging.getLogger(__name__)

#: A fresh probe further than this from the cached one (relative) means: measure again.
PROBE_TOLERANCE = 0.10
CACHE_FILE = "bench-peaks.json"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PeakSettings:
    trials: int = 5
    """Trials per shape; the peak is the best of all of them."""
    trial_seconds: float = 0.05
    """Each trial times back-to-back calls filling at least this long (after one warm-up call)."""
    shape_seconds: float = 1.5
    """A shape whose trials pass this long stops after two (the lm head at d=512 on a CPU: 0.4 s a call)."""
    probe_trials: int = 3


def square_size(dtype: str, device: str) -> int:
    """Large enough to be compute-bound; fp16 on a CPU is emulated (~25x slower), so kept small."""
    return default_matmul_size(dtype, device)


def square_gemms(dtype: str, device: str) -> list[Gemm]:
    """The square shape in both layouts of the right operand (nn.Linear multiplies by Wᵀ; some CPUs
    take different kernels for the two)."""
    n = square_size(dtype, device)
    return [Gemm(n, n, n), Gemm(n, n, n, b_transposed=True)]


def _operands(g: Gemm, dtype: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    lead = (g.batch,) if g.batch > 1 else ()

    def make(rows, cols, transposed):
        shape = (*lead, cols, rows) if transposed else (*lead, rows, cols)
        t = torch.randn(shape, device=device, generator=gen).to(_DTYPES[dtype])
        return t.transpose(-1, -2) if transposed else t

    return make(g.m, g.k, g.a_transposed), make(g.k, g.n, g.b_transposed)


def measure_gemm(g: Gemm, dtype: str, device: str, trials: int, trial_seconds: float,
                 shape_seconds: float = math.inf) -> list[float]:
    """FLOP/s of each trial of ``g`` in ``dtype`` (2 FLOPs per multiply-add)."""
    a, b = _operands(g, dtype, device)
    mm = torch.bmm if g.batch > 1 else torch.mm
    return [g.flops / s for s in timed_trials(lambda: mm(a, b), device, trials, trial_seconds, shape_seconds)]


def quick_probe(dtype: str, device: str, settings: PeakSettings = PeakSettings()) -> float:
    """Best FLOP/s of a few short trials of the square shape: cheap enough to run on every ladder."""
    return max(measure_gemm(square_gemms(dtype, device)[0], dtype, device, settings.probe_trials,
                            settings.trial_seconds))


def peak_method(settings: PeakSettings = PeakSettings()) -> str:
    return (f"maximum FLOP/s over {settings.trials} trials of each of the step's heaviest GEMM shapes (as dispatched, "
            f"operand layouts included) and of a square shape in both layouts (n=1024 on CPU, 256 for fp16 on CPU, "
            f"8192 on CUDA); a trial times back-to-back calls filling >= {settings.trial_seconds * 1e3:.0f} ms after "
            f"a warm-up call; 2 FLOPs per multiply-add; cached, and measured again when a fresh square probe differs "
            f"from the cached one by more than {PROBE_TOLERANCE:.0%}; the load average is recorded with each figure")


def _cache_key(dtype: str, device: str, gemms: list[Gemm]) -> str:
    info = detect(device)
    features = "+".join(info.cpu_features) or "-"
    shapes = ",".join(sorted(g.label for g in gemms))
    return "|".join(["bench-matmul", device, info.cuda_name or "-", dtype, torch.__version__, info.cpu_model,
                     features, str(torch.get_num_threads()), shapes])


def _load_cache() -> dict:
    try:
        return json.loads((cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def clear_cache() -> bool:
    """Forget every cached ladder peak (``turbotrain env --remeasure``); True if there was a cache."""
    path = cache_dir() / CACHE_FILE
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _save_cache(table: dict) -> None:
    path = cache_dir() / CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only home still gets a measured number, just not a cached one
        logger.warning("could not cache matmul peaks in %s (%s); set TURBOTRAIN_CACHE", path, exc)


def _measure(dtype: str, device: str, gemms: list[Gemm], probe: float, settings: PeakSettings) -> dict:
    best = {}
    for g in gemms:
        values = measure_gemm(g, dtype, device, settings.trials, settings.trial_seconds, settings.shape_seconds)
        best[g.label] = max(values)
    best_label = max(best, key=best.get)
    return {"value": max(max(best.values()), probe), "best_gemm": best_label, "per_gemm": best, "probe": probe,
            "loadavg": list(os.getloadavg()), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def matmul_peak(dtype: str, device: str, model_gemms, *, force: bool = False,
                settings: PeakSettings = PeakSettings()) -> dict:
    """The peak of ``dtype`` for a step whose heaviest GEMMs are ``model_gemms``, with how it was found.

    Returns the cache entry (value, best_gemm, per_gemm, probe, loadavg, measured_at) plus
    ``source`` ('measured' or 'cached'), ``reason``, ``probe_now`` and ``loadavg_now``.
    """
    gemms = list(dict.fromkeys([*model_gemms, *square_gemms(dtype, device)]))
    if dtype == "fp16" and device == "cpu":
        gemms = square_gemms(dtype, device)  # emulated: the model's shapes would take minutes
    key = _cache_key(dtype, device, gemms)
    probe = quick_probe(dtype, device, settings)
    now = {"probe_now": probe, "loadavg_now": list(os.getloadavg())}
    table = _load_cache()
    cached = table.get(key)
    force = force or os.environ.get("TURBOTRAIN_REMEASURE") == "1"
    result = _cached_or_measured(table, key, cached, dtype, device, gemms, probe, force, settings)
    known, square = _square_maximum(table, key, dtype, device)
    if not force and known > result["value"]:
        # A new workload's shapes have no cache entry of their own, but the square shapes every entry
        # holds do: a machine slow at this moment must not lower the peak an earlier ladder measured.
        result = {**result, "value": known, "best_gemm": square,
                  "reason": f"{result['reason']}: {result['value'] / 1e9:.1f} GFLOP/s, below the {known / 1e9:.1f} "
                            "the square shape reached in an earlier ladder on this machine, which stands as the peak"}
    return {**result, **now}


def _cached_or_measured(table: dict, key: str, cached, dtype: str, device: str, gemms, probe: float, force: bool,
                        settings: PeakSettings) -> dict:
    if cached and not force:
        drift = probe / cached["probe"] - 1
        if abs(drift) <= PROBE_TOLERANCE:
            return {**cached, "source": "cached", "reason": f"fresh probe within {abs(drift):.0%} of the cached one"}
        reason = (f"fresh probe {probe / 1e9:.1f} GFLOP/s is {drift:+.0%} from the cached "
                  f"{cached['probe'] / 1e9:.1f}, so measured again")
    else:
        reason = "asked to re-measure" if cached else "not cached"
    entry = _measure(dtype, device, gemms, probe, settings)
    if cached and not force and probe < cached["probe"] and cached["value"] > entry["value"]:
        # slower now than when the cache was written: a busy moment, which must not lower a maximum
        return {**cached, "source": "cached",
                "reason": f"{reason}: {entry['value'] / 1e9:.1f} GFLOP/s now, below the cached maximum, which "
                          "stands (a busy machine lowers a measurement, never the peak)"}
    table[key] = entry
    _save_cache(table)
    return {**entry, "source": "measured", "reason": reason}


def _square_maximum(table: dict, key: str, dtype: str, device: str) -> tuple[float, str]:
    """The best square-shape FLOP/s any cached entry of this machine, dtype and thread count holds, and
    the square shape that reached it."""
    machine = key.rsplit("|", 1)[0]
    squares = [g.label for g in square_gemms(dtype, device)]
    best, best_label = 0.0, squares[0]
    for other, entry in table.items():
        if other.rsplit("|", 1)[0] != machine:
            continue
        for label, value in [(squares[0], entry.get("probe", 0.0)),
                             *((sq, entry.get("per_gemm", {}).get(sq, 0.0)) for sq in squares)]:
            if value > best:
                best, best_label = value, label
    return best, best_label


def matmul_peaks(dtypes, device: str, model_gemms, *, force: bool = False,
                 settings: PeakSettings = PeakSettings()) -> dict:
    """``{"flops": {dtype: peak}, "detail": {dtype: matmul_peak(...)}, "method": ...}`` for ``dtypes``."""
    detail = {d: matmul_peak(d, device, model_gemms, force=force, settings=settings) for d in dtypes}
    return {"flops": {d: v["value"] for d, v in detail.items()}, "detail": detail, "method": peak_method(settings)}


def best_gemm_flops(gemms, dtype: str, device: str, probe: float, settings: PeakSettings = PeakSettings(), *,
                    force: bool = False) -> dict[str, float]:
    """The best FLOP/s of each of ``gemms`` in ``dtype``: this run's best trial, or the best a
    previous run recorded under the same machine key, whichever is higher.

    For a bound that must not be pessimistic (bench/ceiling.py's GEMM floor), a run measured
    while something else used the CPU should not raise it: the cached best survives such a run. It
    is dropped when this run's square ``probe`` is more than PROBE_TOLERANCE *above* the probe it was
    recorded with (the machine is faster than when the cache was written), or on ``force`` /
    ``TURBOTRAIN_REMEASURE=1``.
    """
    gemms = list(dict.fromkeys(gemms))
    key = "gemm-best|" + _cache_key(dtype, device, gemms)
    table = _load_cache()
    cached = table.get(key)
    force = force or os.environ.get("TURBOTRAIN_REMEASURE") == "1"
    if force or not cached or probe > cached["probe"] * (1 + PROBE_TOLERANCE):
        cached = {"probe": probe, "flops": {}}
    best = {}
    for g in gemms:
        fresh = max(measure_gemm(g, dtype, device, settings.trials, settings.trial_seconds, settings.shape_seconds))
        best[g.label] = max(fresh, cached["flops"].get(g.label, 0.0))
    table[key] = {"probe": max(probe, cached["probe"]), "flops": best,
                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _save_cache(table)
    return best
