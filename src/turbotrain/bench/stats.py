"""Summary statistics and the MFU arithmetic every benchmark row uses.

Step times are summarised by their median with the 20th and 80th percentiles around it: robust to
the odd slow step (a page fault, a noisy neighbour) without hiding a bimodal run.

>>> summarize([3.0, 1.0, 2.0, 4.0, 5.0]).median
3.0
>>> mfu(flops_per_step=2e9, step_seconds=0.5, peak_flops=8e9)
0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError

__all__ = ["Summary", "percentile", "summarize", "mfu", "achieved_flops", "throughput", "relative_change", "slow_dtypes"]


@dataclass(frozen=True)
class Summary:
    """Median and 20th/80th percentiles of ``n`` samples."""

    median: float
    p20: float
    p80: float
    n: int

    def to_dict(self) -> dict:
        return {"median": self.median, "p20": self.p20, "p80": self.p80, "n": self.n}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between closest ranks (numpy's default)."""
    if not values:
        raise ConfigError("percentile of no values; run at least one measured step (--steps >= 1)")
    if not 0.0 <= q <= 100.0:
        raise ConfigError(f"percentile q={q} must be in [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(position), math.ceil(position)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def summarize(values: Sequence[float]) -> Summary:
    """Median, p20 and p80 of ``values``."""
    return Summary(percentile(values, 50), percentile(values, 20), percentile(values, 80), len(values))


def achieved_flops(flops_per_step: float, step_seconds: float) -> float:
    """FLOP/s reached by a step of ``flops_per_step`` FLOPs taking ``step_seconds``."""
    if step_seconds <= 0:
        raise ConfigError(f"step time {step_seconds} s must be > 0")
    return flops_per_step / step_seconds


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the measured matmul peak (a fraction, not %)."""
    if peak_flops <= 0:
        raise ConfigError(f"peak {peak_flops} FLOP/s must be > 0")
    return achieved_flops(flops_per_step, step_seconds) / peak_flops


def throughput(items_per_step: float, step_seconds: float) -> float:
    """Items (tokens or samples) per second."""
    if step_seconds <= 0:
        raise ConfigError(f"step time {step_seconds} s must be > 0")
    return items_per_step / step_seconds


def relative_change(value: float, reference: float) -> float:
    """(value - reference) / reference in percent."""
    return 100.0 * (value - reference) / reference


def slow_dtypes(env: dict) -> dict[str, float]:
    """Low-precision dtypes whose measured matmul peak is below fp32's, as {dtype: times slower}."""
    peaks = env["matmul_peak_flops"]
    fp32 = peaks.get("fp32")
    return {d: fp32 / v for d, v in peaks.items() if d != "fp32" and fp32 and 0 < v < fp32}
