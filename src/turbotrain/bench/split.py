"""Where one row's step goes, measured: a few profiled steps split into GEMMs, attention kernels,
the optimizer step and everything else (the worker also counts the page faults of its measured
steps, hardware.page_faults).

The ceiling (bench/ceiling.py) says what the step's GEMMs cost at their best, alone; this says what
they cost inside the step. The two differ: a GEMM whose output lands in freshly mapped pages, or
whose operands were evicted by the ops before it, runs below its isolated best (on the 2-core AVX2
development CPU, 2026-12-06, benchmarks/2026-12-06-avx2-step-split.md: the gpt rows' GEMMs took
1.14-1.20x their floor at 25-84k page faults a step, and 1.02-1.12x with ``--malloc-tuned``, which
took the faults to under 1k).

Buckets, by each profiled ATen op's *self* time (the time on the calling thread inside that op but
not in the ops it called; intra-op threads work inside it, so the buckets add up to wall time):

- ``gemm``: ``mm``, ``addmm``, ``addmm_``, ``bmm``, ``baddbmm``, ``matmul``'s kernels, wherever they
  run (a fused loss head's GEMMs count here, not in the loss);
- ``attention``: the fused scaled-dot-product kernels (flash, memory-efficient, cuDNN), forward and
  backward; a plain attention's bmm counts as GEMM and its softmax as the rest;
- ``optimizer``: every other op under ``Optimizer.step`` / ``Optimizer.zero_grad``;
- ``rest``: the profiled step's wall time less the three (elementwise and norm kernels, compiled
  graphs' own code, the loss's softmax, Python and dispatch).

CPU only: on CUDA the host-side self times say when kernels were queued, not how long they ran, so
the split is not measured there (``None``) and the report says so.
"""

from __future__ import annotations

import time

__all__ = ["GEMM_OPS", "split_events", "profile_split"]

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
                      "aten::_int_mm", "aten::_addmm_activation"})
_ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_OPTIMIZER_MARKS = ("Optimizer.step", "Optimizer.zero_grad")
BUCKETS = ("gemm", "attention", "optimizer", "rest")


def _bucket(event) -> str | None:
    name = event.name
    if name in GEMM_OPS:
        return "gemm"
    if any(mark in name for mark in _ATTENTION_MARKS):
        return "attention"
    parent = event
    while parent is not None:
        if parent.name.startswith(_OPTIMIZER_MARKS):
            return "optimizer"
        parent = parent.cpu_parent
    return None


def split_events(events, wall_seconds: float, steps: int) -> dict:
    """Per-step seconds in each bucket from a profiler's ``events()`` over ``steps`` steps that took
    ``wall_seconds`` in all; ``rest`` is what the other three leave of the wall time."""
    totals = dict.fromkeys(BUCKETS[:-1], 0.0)
    for event in events:
        bucket = _bucket(event)
        if bucket is not None:
            totals[bucket] += event.self_cpu_time_total / 1e6
    out = {name: seconds / steps for name, seconds in totals.items()}
    out["step"] = wall_seconds / steps
    out["rest"] = out["step"] - sum(totals.values()) / steps
    return out


def profile_split(step, steps: int = 2) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler (CPU activity) and split them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    return split_events(prof.events(), wall, steps)
