"""``profile(engine, batches)``: where a training step's time goes, and what to turn on about it.

Three passes over the same engine, each on fresh batches:

1. ``warmup`` steps, untimed (allocator, autotuning, compile);
2. ``steps`` steps timed by wall clock without the profiler: the true step time, used for MFU;
3. ``steps`` steps under torch.profiler, each timed by wall clock: the op table and the
   categories come from this pass, and the categories sum to its measured step time because the
   remainder no op accounts for is reported as 'idle/overhead' (Python, launch gaps, GPU idle);
4. one step under an op counter for exact FLOPs and bytes per op (see counting.py).

The engine trains during all of them (profiling is not free of side effects).
"""

from __future__ import annotations

import mmap
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..hardware import page_faults
from ..utils import sync_device
from .advice import THRESHOLDS, Recommendation, loss_share, recommend
from .categories import CATEGORIES, IDLE, categorise
from .counting import OpCounter, StepCounts

__all__ = ["profile", "ProfileReport", "OpRow", "Recommendation", "MFU_CONVENTIONS"]

MFU_CONVENTIONS = ("MFU = model FLOPs per step / (unprofiled wall step time x peak FLOP/s). Model FLOPs are "
                   "counted by torch.utils.flop_counter formulas on the real step: 2 FLOPs per multiply-add, "
                   "matmul/conv/attention only, attention counted as executed (a causal mask is not discounted), "
                   "recomputation by activation checkpointing excluded. ")
_STEP_RANGE = "turbotrain.profile.step"
PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class OpRow:
    name: str
    category: str
    calls: float
    """Calls per step."""
    self_cpu_s: float
    """Self CPU time per step, seconds."""
    self_device_s: float
    """Self accelerator (kernel) time per step, seconds; 0 on CPU."""
    share: float
    """Fraction of the profiled step time."""
    flops: float | None
    """FLOPs per step; None when the op counter did not see this op (ops nested inside another
    aten op, e.g. copy_ inside _to_copy, are counted on the outer op)."""
    bytes: float | None
    intensity: float | None
    """FLOPs per byte."""
    bound: str
    """'compute', 'memory' or '-' when peaks or counts are missing."""


@dataclass
class ProfileReport:
    device: str
    steps: int
    step_time_s: float
    """Mean wall step time under the profiler (what the categories sum to)."""
    unprofiled_step_time_s: float
    categories: dict
    """Category -> seconds per step (profiled); sums to step_time_s."""
    ops: list = field(default_factory=list)
    flops_per_step: float = 0.0
    recompute_flops_per_step: float = 0.0
    peak_flops: float | None = None
    peak_bandwidth: float | None = None
    peak_source: str = "given"
    mfu: float | None = None
    mfu_conventions: str = MFU_CONVENTIONS
    recommendations: list = field(default_factory=list)
    matmul_dtypes: tuple = ()
    trace_path: str | None = None
    html_path: str | None = None
    notes: list = field(default_factory=list)
    page_faults_per_step: float | None = None
    """Minor page faults a step, over the unprofiled steps (CPU; None on a GPU): pages the allocator
    mapped afresh for the step's buffers (turbotrain.hardware.tune_malloc keeps them mapped)."""

    @property
    def shares(self) -> dict:
        return {k: v / self.step_time_s for k, v in self.categories.items()}

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("ops", "recommendations")}
        out["ops"] = [r.__dict__ for r in self.ops]
        out["recommendations"] = [r.__dict__ for r in self.recommendations]
        out["matmul_dtypes"] = list(self.matmul_dtypes)
        return out

    def __str__(self) -> str:
        ms = 1e3
        lines = [f"Profile on {self.device}: {self.steps} steps, step {self.step_time_s * ms:.2f} ms profiled, "
                 f"{self.unprofiled_step_time_s * ms:.2f} ms without the profiler"]
        mfu = "n/a (no peak FLOP/s)" if self.mfu is None else f"{self.mfu:.1%}"
        lines.append(f"model FLOPs/step {self.flops_per_step:.3g}, MFU {mfu}")
        if self.page_faults_per_step is not None:
            lines.append(f"page faults/step {self.page_faults_per_step:,.0f} "
                         f"({self.page_faults_per_step * PAGE_BYTES / 2**20:,.0f} MiB mapped afresh)")
        lines.append("categories (per step):")
        for cat, sec in self.categories.items():
            lines.append(f"  {cat:<14} {sec * ms:9.3f} ms  {sec / self.step_time_s:6.1%}")
        lines.append(f"{'op':<42} {'category':<12} {'calls':>6} {'self ms':>9} {'%':>6} {'GFLOP':>8} {'MB':>8} "
                     f"{'F/B':>6} bound")
        for r in self.ops[:20]:
            t = max(r.self_cpu_s, r.self_device_s)
            ai = "-" if r.intensity is None else f"{r.intensity:.1f}"
            gflop = "-" if r.flops is None else f"{r.flops / 1e9:.3f}"
            mb = "-" if r.bytes is None else f"{r.bytes / 1e6:.2f}"
            lines.append(f"{r.name[:42]:<42} {r.category:<12} {r.calls:>6.0f} {t * ms:>9.3f} {r.share:>6.1%} "
                         f"{gflop:>8} {mb:>8} {ai:>6} {r.bound}")
        if self.recommendations:
            lines.append("recommendations:")
            lines.extend(f"  - {r}" for r in self.recommendations)
        lines.append(self.mfu_conventions)
        lines.extend(self.notes)
        return "\n".join(lines)


def _device_of(engine) -> str:
    device = getattr(engine, "device", None)
    if device is None:
        model = getattr(engine, "model", None)
        param = next(model.parameters(), None) if model is not None else None
        device = param.device if param is not None else "cpu"
    return str(device)


def _timed_steps(engine, batches, n, device, label=None) -> list[float]:
    times = []
    for _ in range(n):
        batch = next(batches)
        sync_device(device)
        start = time.perf_counter()
        if label:
            with torch.profiler.record_function(label):
                engine.step(batch)
        else:
            engine.step(batch)
        sync_device(device)
        times.append(time.perf_counter() - start)
    return times


def _count_step(engine, batches, notes) -> StepCounts | None:
    counter = OpCounter()
    try:
        with counter:
            engine.step(next(batches))
    except Exception as exc:  # e.g. a compiled model that cannot trace under a dispatch mode
        warnings.warn(f"profile: FLOP/byte counting failed ({exc!r}); FLOPs and MFU are not reported", stacklevel=3)
        notes.append(f"FLOP/byte counting failed: {exc!r}")
        return None
    return counter.counts


def _processes() -> int:
    """How many processes train together (1 without an initialised process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _loss_head_refusal(engine, batches) -> str:
    """Why the fused linear+cross-entropy could not replace ``engine``'s loss ("" if nothing says so, or if
    ``engine`` is not a turbotrain Engine and cannot be asked). The Engine's own verdict when it tried.
    Without that verdict, not checked across processes: each rank decides from its own timings whether
    to ask, and a forward on one rank alone would wait forever on a sharded model's collectives."""
    from ..engine import Engine

    if not isinstance(engine, Engine):
        return ""
    fusion = engine._transform("fusion")
    if fusion is not None and fusion.loss_head is not None:
        return "" if fusion.loss_head.fused else fusion.loss_head.reason
    if _processes() > 1:
        return ""
    from ..batch import as_batch
    from ..fusion.loss_head import loss_head_refusal
    from ..plan import find_head

    model = engine.module
    try:
        batch = as_batch(next(batches), engine.device, engine.loss_fn is not None)
        head_path = find_head(model, lambda: model(*batch.args, **batch.kwargs))
        return loss_head_refusal(model, head_path, engine.contract, batch, engine.autocast)
    except Exception as exc:  # noqa: BLE001 - the advice must not cost the user the profile
        return f"checking it failed: {type(exc).__name__}: {exc}"


def _default_peaks(device: str, matmul_dtypes, peak_flops, peak_bandwidth):
    """Peaks from turbotrain.hardware when not given (measured once, cached on disk)."""
    try:
        from .. import hardware
    except ImportError:
        return peak_flops, peak_bandwidth, "not available"
    dtype = "bf16" if "bfloat16" in matmul_dtypes else "fp16" if "float16" in matmul_dtypes else "fp32"
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if peak_flops is None:
        peak_flops = hardware.measure_matmul_peak(dtype, kind)
    if peak_bandwidth is None:
        peak_bandwidth = hardware.measure_memory_bandwidth(kind)
    return peak_flops, peak_bandwidth, f"measured by turbotrain.hardware ({dtype} square matmul; buffer copy)"


def profile(engine, batches, steps: int = 5, warmup: int = 2, *, peak_flops: float | None = None,
            peak_bandwidth: float | None = None, measure_peaks: bool = True, out_dir=None,
            title: str = "turbotrain profile") -> ProfileReport:
    """Profile ``engine.step`` (any object with ``.step(batch)``) over batches from ``batches``.

    ``peak_flops`` (FLOP/s) and ``peak_bandwidth`` (bytes/s) are what MFU and the compute/memory
    verdicts divide by; when None and ``measure_peaks`` they are measured by turbotrain.hardware.
    ``out_dir``: where to write ``trace.json`` (Chrome/Perfetto) and ``report.html``.
    """
    if steps < 1 or warmup < 0:
        from ..errors import ConfigError
        raise ConfigError(f"profile needs steps >= 1 and warmup >= 0; got steps={steps}, warmup={warmup}")
    batches = iter(batches)
    device = _device_of(engine)
    _timed_steps(engine, batches, warmup, device)
    faults = page_faults()
    unprofiled = _timed_steps(engine, batches, steps, device)
    faults = (page_faults() - faults) / steps

    activities = [torch.profiler.ProfilerActivity.CPU]
    on_gpu = device.startswith("cuda")
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = _timed_steps(engine, batches, steps, device, label=_STEP_RANGE)
    notes: list[str] = []
    counts = _count_step(engine, batches, notes)

    step_time = sum(profiled) / steps
    categories, op_time = _bucket(prof.events(), steps, on_gpu)
    busy = sum(categories.values())
    if busy > step_time * 1.05:
        notes.append(f"op self times ({busy * 1e3:.2f} ms) exceed the step ({step_time * 1e3:.2f} ms): ops ran "
                     "on several threads at once, so idle/overhead is shown as 0")
    categories[IDLE] = max(0.0, step_time - busy)

    matmul_dtypes = tuple(sorted({d for name, c in (counts.ops.items() if counts else ())
                                  if op_time.get(name, {}).get("category") == "matmul" and c.flops
                                  for d in c.dtypes}))
    source = "given"
    if measure_peaks and (peak_flops is None or peak_bandwidth is None):
        peak_flops, peak_bandwidth, source = _default_peaks(device, matmul_dtypes, peak_flops, peak_bandwidth)
    report = ProfileReport(
        device=device, steps=steps, step_time_s=step_time, unprofiled_step_time_s=sum(unprofiled) / steps,
        categories={c: categories.get(c, 0.0) for c in CATEGORIES}, peak_flops=peak_flops,
        peak_bandwidth=peak_bandwidth, peak_source=source, matmul_dtypes=matmul_dtypes, notes=notes,
        page_faults_per_step=None if on_gpu else faults)
    report.ops = _op_rows(op_time, counts, step_time, peak_flops, peak_bandwidth, on_gpu)
    if counts is not None:
        report.flops_per_step = counts.flops
        report.recompute_flops_per_step = counts.recompute_flops
        if peak_flops:
            report.mfu = counts.flops / (report.unprofiled_step_time_s * peak_flops)
    report.mfu_conventions = MFU_CONVENTIONS + f"Peak: {_fmt_peak(peak_flops)} FLOP/s, {source}."
    refusal = ""
    loss = loss_share(report)
    if loss >= THRESHOLDS["loss"]:
        refusal = _loss_head_refusal(engine, batches)
        if refusal:
            notes.append(f"log_softmax/cross-entropy take {loss:.0%} of the step, but the fused "
                         f"linear+cross-entropy is not advised: {refusal}")
    report.recommendations = recommend(report, getattr(engine, "config", None), head_refusal=refusal)
    if out_dir is not None:
        from .html import write_outputs
        write_outputs(report, prof, out_dir, title)
    return report


def _fmt_peak(value):
    return "n/a" if value is None else f"{value:.3g}"


def _bucket(events, steps, on_gpu):
    """Per-step seconds per category and per op name, from self times (no double counting)."""
    cache: dict = {}
    main_threads = {e.thread for e in events if e.name == _STEP_RANGE}
    categories: dict = defaultdict(float)
    op_time: dict = {}
    for e in events:
        if e.name == _STEP_RANGE:
            continue  # its self time is Python between ops: left to idle/overhead
        cpu = e.self_cpu_time_total / 1e6 / steps
        dev = getattr(e, "self_device_time_total", 0.0) / 1e6 / steps
        if not on_gpu and e.thread not in main_threads:
            continue  # other CPU threads overlap the main one; their time is not step time
        cat = categorise(e, cache)
        seconds = dev if on_gpu else cpu
        categories[cat] += seconds
        row = op_time.setdefault(e.name, {"cpu": 0.0, "dev": 0.0, "calls": 0, "by_cat": defaultdict(float)})
        row["cpu"] += cpu
        row["dev"] += dev
        row["calls"] += 1 / steps
        row["by_cat"][cat] += seconds
    for row in op_time.values():
        row["category"] = max(row["by_cat"].items(), key=lambda kv: kv[1])[0]
    return categories, op_time


def _op_rows(op_time, counts: StepCounts | None, step_time, peak_flops, peak_bandwidth, on_gpu) -> list[OpRow]:
    rows = []
    ridge = peak_flops / peak_bandwidth if peak_flops and peak_bandwidth else None
    for name, t in op_time.items():
        c = counts.ops.get(name) if counts is not None else None
        flops, nbytes = (c.flops, c.bytes) if c else (None, None)
        intensity = flops / nbytes if nbytes else None
        if ridge is None or c is None or not nbytes:
            bound = "-"
        else:
            bound = "compute" if intensity >= ridge else "memory"
        # On GPU an op's share is its kernel time (its CPU time overlaps the kernels of earlier ops).
        share = (t["dev"] if on_gpu else t["cpu"]) / step_time
        rows.append(OpRow(name, t["category"], t["calls"], t["cpu"], t["dev"], share, flops, nbytes, intensity, bound))
    rows.sort(key=lambda r: -r.share)
    return rows
