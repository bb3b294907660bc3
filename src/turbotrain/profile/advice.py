"""From a ProfileReport to the turbotrain settings worth trying, each with the finding behind it.

Thresholds are shares of the profiled step; each is where the named feature has, in our
benchmarks' experience, enough time to win back to be worth its cost. None of them is applied:
this only says what to try (transforms are opt-in).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["recommend", "loss_share", "Recommendation", "THRESHOLDS"]

THRESHOLDS = {
    "casts": 0.10,        # per-step weight/activation casts: bf16-master keeps weights in bf16 instead
    "loss": 0.10,         # log_softmax + nll over a big vocabulary: the fused head never builds FP32 logits
    "elementwise": 0.25,  # many small memory-bound kernels: fusion/compile merge them
    "elementwise_calls": 100,
    "comm": 0.10,         # gradient all-reduce not hidden behind backward
    "idle": 0.30,         # Python and launch overhead between ops
    "optimizer": 0.15,
    "data": 0.10,
    "mfu": 0.30,
    "page_faults": 0.03,  # pages mapped afresh each step, at FAULT_SECONDS each, against the step
}

#: What one minor fault costs, roughly: the kernel's trap plus zeroing a 4 KiB page (1-2 us on the
#: development CPUs). It only sizes the finding; the measured effect of removing the faults was
#: larger (the compiled gpt step's GEMMs ran 1.14-1.20x their isolated time with 25-84k faults a
#: step, 1.05-1.10x with ~400; benchmarks/2026-12-06-avx2-step-split.md).
FAULT_SECONDS = 2e-6


@dataclass(frozen=True)
class Recommendation:
    finding: str
    suggestion: str
    config: str
    """The turbotrain setting to try, e.g. "Config(precision='bf16-master')"."""

    def __str__(self):
        return f"{self.finding} -> {self.suggestion} [{self.config}]"


def _fp32_matmuls(report) -> bool:
    return bool(report.matmul_dtypes) and set(report.matmul_dtypes) <= {"float32"}


def _low_precision(device: str) -> tuple[str, str]:
    """The precision this device trains fastest in, and why (turbotrain.hardware.recommend_precision)."""
    from ..hardware import detect, recommend_precision

    return recommend_precision(detect("cuda" if str(device).startswith("cuda") else "cpu"))


def loss_share(report) -> float:
    """The share of the step in log-softmax and cross-entropy, forward and backward."""
    ops = sum(r.share for r in report.ops if any(k in r.name for k in ("log_softmax", "nll_loss", "cross_entropy")))
    return max(report.shares["loss"], ops)


def recommend(report, config=None, head_refusal: str = "") -> list[Recommendation]:
    """Recommendations for ``report``; ``config`` (the engine's Config, if any) skips what is already on.

    ``head_refusal``: why the fused linear+cross-entropy could not replace this model's loss
    (fusion.loss_head.loss_head_refusal); when given, that fusion is not recommended.
    """
    share = report.shares
    precision = getattr(config, "precision", "fp32")
    fuse = getattr(config, "fuse", ()) or ()
    # fuse=True always includes the linear+cross-entropy head (fusion.transform.patterns_for)
    fuse = ("linear_cross_entropy",) if fuse is True else tuple(fuse)
    compiled = bool(getattr(config, "compile", False))
    recs: list[Recommendation] = []

    if share["casts"] >= THRESHOLDS["casts"] and not precision.endswith("-master"):
        recs.append(Recommendation(
            f"dtype casts take {share['casts']:.0%} of the step",
            "keep the model in bf16 with FP32 master weights, so weights are not cast every forward",
            "Config(precision='bf16-master')"))
    loss = loss_share(report)
    if loss >= THRESHOLDS["loss"] and "linear_cross_entropy" not in fuse and not head_refusal:
        recs.append(Recommendation(
            f"log_softmax/cross-entropy (forward and backward) take {loss:.0%} of the step",
            "fuse the classifier matmul with the loss so the logits are never materialised",
            "Config(fuse=('linear_cross_entropy',))"))
    calls = sum(r.calls for r in report.ops if r.category == "elementwise")
    if share["elementwise"] >= THRESHOLDS["elementwise"] and calls >= THRESHOLDS["elementwise_calls"]:
        if not compiled:
            recs.append(Recommendation(
                f"{calls:.0f} elementwise calls per step take {share['elementwise']:.0%} of it",
                "compile the step: Inductor fuses the elementwise chains (bias+activation, norms) into single loops",
                "Config(compile=True)"))
    if share["comm"] >= THRESHOLDS["comm"]:
        recs.append(Recommendation(
            f"communication takes {share['comm']:.0%} of the step (not hidden behind backward)",
            "overlap it with smaller buckets, or compress gradients",
            "DataParallelConfig(bucket_mb=5) or DataParallelConfig(compression='powersgd')"))
    low_mfu = report.mfu is not None and report.mfu < THRESHOLDS["mfu"]
    if _fp32_matmuls(report) and (low_mfu or share["matmul"] >= 0.3) and precision == "fp32":
        low, why = _low_precision(getattr(report, "device", "cpu"))
        if low != "fp32":  # where bf16/fp16 is emulated (an AVX2-only CPU) fp32 is already the fastest
            mfu = "n/a" if report.mfu is None else f"{report.mfu:.0%}"
            dtype = low.split("-")[0]
            recs.append(Recommendation(
                f"matmuls run in FP32 (MFU {mfu}, matmul {share['matmul']:.0%} of the step) where {why}",
                f"run matmuls in {dtype} (FP32 accumulation, FP32 master weights)"
                + ("; fp16 needs loss scaling, which the Engine does" if dtype == "fp16" else ""),
                f"Config(precision='{low}')"))
    if share["idle/overhead"] >= THRESHOLDS["idle"] and not compiled:
        recs.append(Recommendation(
            f"{share['idle/overhead']:.0%} of the step is outside any op (Python and launch overhead)",
            "compile the model, or give each step more work (bigger micro-batches, fewer accumulation steps)",
            "Config(compile=True)"))
    if share["optimizer"] >= THRESHOLDS["optimizer"]:
        recs.append(Recommendation(
            f"the optimizer step takes {share['optimizer']:.0%} of the step",
            "use the fused optimizer: one kernel over parameters, gradients and both moments (CPU and GPU since torch 2.4)",
            "torch.optim.AdamW(fused=True)"))
    faults = getattr(report, "page_faults_per_step", None)
    if faults and faults * FAULT_SECONDS >= THRESHOLDS["page_faults"] * report.step_time_s:
        recs.append(Recommendation(
            f"each step faults in {faults:,.0f} fresh pages (the allocator maps large buffers anew every step)",
            "keep freed buffers mapped for the next step: call turbotrain.hardware.tune_malloc() before training "
            "(glibc; or start the process with turbotrain.hardware.TUNED_MALLOC_ENV)",
            "turbotrain.hardware.tune_malloc()"))
    if share["data"] >= THRESHOLDS["data"]:
        recs.append(Recommendation(
            f"data loading takes {share['data']:.0%} of the step",
            "load ahead of the step: DataLoader(num_workers>0, pin_memory=True, prefetch_factor>=2)",
            "DataLoader(num_workers=4, pin_memory=True)"))
    return recs
