"""One benchmark row in its own process: ``python -m turbotrain.bench.worker SPEC.json RESULT.json``.

A fresh process per config means no row inherits another's compiled graphs, patched modules,
allocator state or thread pools. The spec fixes the seed, the batches and the step counts, so every
row sees the same initial weights and the same data in the same order.

Progress goes to stdout as ``PROGRESS <done> <total>`` lines; the result is written as JSON to
RESULT.json (also when the row fails: status 'error' and the message).

Memory, honestly: on CUDA the row reports torch.cuda.max_memory_allocated() during build, warm-up
and the measured steps (tensors only; the caching allocator's reserve is excluded). On CPU there is
no allocator counter, so a thread samples this process's anonymous resident memory (resident minus
file-backed pages, from /proc/self/statm) every 5 ms and the row reports the peak above its value
just before the model was built: weights, gradients, optimizer state, activations, whatever the
allocator keeps cached, torch's one-time lazy initialisation on the first step, and for compiled
rows the compiler's own memory. File-backed pages are left out because touching libtorch's code
pages would otherwise count as training memory. Peaks shorter than 5 ms can be missed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError

__all__ = ["WorkerSpec", "run_row", "load_workload", "fixed_batches", "RssSampler", "CPU_MEMORY_METHOD",
           "CUDA_MEMORY_METHOD"]

CPU_MEMORY_METHOD = "peak anonymous RSS of the worker above its value before the model was built (5 ms sampling)"
CUDA_MEMORY_METHOD = "torch.cuda.max_memory_allocated() during build, warm-up and measured steps"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one row needs; identical across rows except ``config``."""

    workload: str
    config: str
    device: str
    steps: int
    """Measured steps."""
    warmup: int
    """Steps run first and not timed (compilation happens here)."""
    seed: int = 0
    val_batches: int = 4
    overrides: dict = field(default_factory=dict)
    """Workload settings changed from its defaults (quick mode shrinks the model)."""
    threads: int | None = None
    """torch intra-op threads; the parent passes its own so peaks and rows use the same count."""


def load_workload(name: str, overrides: dict | None = None):
    """turbotrain.workloads.get_workload(name, **overrides); UnknownWorkloadError for a bad name."""
    from ..workloads import get_workload

    return get_workload(name, **(overrides or {}))


def fixed_batches(workload, split: str, count: int, seed: int, device: str) -> list:
    """The first ``count`` batches of the workload's deterministic ``split`` stream."""
    stream = workload.batches(split=split, seed=seed, device=device)
    return [next(stream) for _ in range(count)]


class RssSampler:
    """Peak anonymous resident memory of this process, sampled by a daemon thread (CPU memory metric)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.baseline = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            _, resident, shared = f.read().split()[:3]
        return (int(resident) - int(shared)) * self._page

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_step_ops(trainer, batch) -> int:
    """ATen ops dispatched by one more training step (forward, backward, optimizer), after the
    measurements; the fusion ablation compares it across rows. Compiled rows are not counted: their
    ops run inside generated kernels that a dispatch mode cannot see."""
    with _OpCounter() as counter:
        trainer.step(batch)
    return counter.count


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _progress(done: int, total: int) -> None:
    print(f"PROGRESS {done} {total}", flush=True)


def _train(trainer, batches: list, spec: WorkerSpec) -> tuple[list[float], list[float]]:
    """Run warm-up + measured steps; returns (losses of every step, seconds of measured steps)."""
    losses, times = [], []
    total = spec.warmup + spec.steps
    for i, batch in enumerate(batches):
        _sync(spec.device)
        t0 = time.perf_counter()
        loss = trainer.step(batch)
        _sync(spec.device)
        elapsed = time.perf_counter() - t0
        if i >= spec.warmup:
            times.append(elapsed)
        losses.append(float(loss))
        _progress(i + 1, total + 1)
    return losses, times


def run_row(spec: WorkerSpec) -> dict:
    """Build the config, train, evaluate; a dict for results.json (raises on failure)."""
    from .configs import COMPUTE_DTYPES, get_config

    if spec.threads:
        torch.set_num_threads(spec.threads)
    workload = load_workload(spec.workload, spec.overrides)
    batches = fixed_batches(workload, "train", spec.warmup + spec.steps, spec.seed, spec.device)
    val = fixed_batches(workload, "val", spec.val_batches, spec.seed, spec.device)
    build = get_config(spec.config).build
    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    with RssSampler() as rss:
        torch.manual_seed(spec.seed)  # same initial weights in every row
        t0 = time.perf_counter()
        trainer = build(workload, spec.device)
        build_s = time.perf_counter() - t0
        if getattr(trainer, "compute_dtype", None) not in COMPUTE_DTYPES:
            raise ConfigError(f"config {spec.config!r} built a trainer whose compute_dtype is "
                              f"{getattr(trainer, 'compute_dtype', None)!r}; set it to one of {COMPUTE_DTYPES}")
        losses, times = _train(trainer, batches, spec)
    peak = torch.cuda.max_memory_allocated() - base_cuda if cuda else rss.peak - rss.baseline
    val_loss = trainer.eval_loss(val)
    op_count = None if getattr(trainer, "compiled", False) else count_step_ops(trainer, batches[0])
    _progress(spec.warmup + spec.steps + 1, spec.warmup + spec.steps + 1)
    return {
        "status": "ok",
        "compute_dtype": trainer.compute_dtype,
        "build_seconds": build_s,
        "step_seconds": times,
        "losses": losses,
        "val_loss": val_loss,
        "ops_per_step": op_count,
        "peak_memory_bytes": peak,
        "rss_baseline_bytes": rss.baseline,
        "rss_peak_bytes": rss.peak,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m turbotrain.bench.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec_path, result_path = map(Path, argv)
    spec = WorkerSpec(**json.loads(spec_path.read_text()))
    try:
        result = run_row(spec)
        rc = 0
    except Exception as exc:  # the row fails, the ladder goes on: report the message, keep the trace
        result = error_result(exc)
        rc = 1
    write_result(result, spec, result_path)
    return rc


def error_result(exc: BaseException) -> dict:
    """The result document of a job that failed: its message and traceback, for the report."""
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}".strip(), "traceback": traceback.format_exc()}


def write_result(result: dict, spec, path: Path) -> None:
    """Write a job's result (with the spec it ran) atomically, so the parent never reads half a file."""
    result["spec"] = asdict(spec)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
