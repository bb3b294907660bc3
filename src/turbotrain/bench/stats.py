"""Summary statistics and the MFU arithmetic every benchmark row uses.

Step times are summarised by their median with the 20th and 80th percentiles around it: robust to
the odd slow step (a page fault, a noisy neighbour) without hiding a bimodal run.

Rows are compared by the ratio of their medians, with a 95% percentile-bootstrap interval over the
ladder's rounds: each round ran every row once, back to back, so a resample draws whole rounds
(the same round indices for both rows) and keeps what interleaving bought, that drift during a
round slows both rows alike.

>>> summarize([3.0, 1.0, 2.0, 4.0, 5.0]).median
3.0
>>> mfu(flops_per_step=2e9, step_seconds=0.5, peak_flops=8e9)
0.5
>>> speed_ratio([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])   # row twice as fast as the reference
2.0
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError

__all__ = ["Summary", "percentile", "summarize", "mfu", "achieved_flops", "throughput", "relative_change", "slow_dtypes",
           "speed_ratio", "bootstrap_ratio_ci", "round_times", "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED"]

#: Resamples of the bootstrap: the interval's ends move by well under 1% of its width beyond ~2000.
BOOTSTRAP_RESAMPLES = 2000
#: Fixed, so the same per-round times always give the same interval (results are reproducible).
BOOTSTRAP_SEED = 0


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


def round_times(step_seconds_by_round: Sequence[Sequence[float]]) -> list[float]:
    """One time per round: the median of the steps a row ran in that round."""
    return [statistics.median(steps) for steps in step_seconds_by_round if steps]


def speed_ratio(reference: Sequence[float], row: Sequence[float]) -> float:
    """median(reference) / median(row): the row's throughput over the reference's (> 1 is faster)."""
    if not reference or not row:
        raise ConfigError("a ratio of medians needs at least one time on each side")
    return statistics.median(reference) / statistics.median(row)


def bootstrap_ratio_ci(reference: Sequence[float], row: Sequence[float], *, confidence: float = 0.95,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``speed_ratio(reference, row)`` over per-round times.

    With as many rounds on both sides (the interleaved ladder), rounds are resampled in pairs: the
    same indices for both rows, since round ``i`` of each ran under the same conditions. Otherwise
    each side is resampled on its own. A single round gives the point estimate at both ends.
    """
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence={confidence} must be in (0, 1)")
    check = speed_ratio(reference, row)  # raises on an empty side
    n_ref, n_row = len(reference), len(row)
    if n_ref == 1 and n_row == 1:
        return check, check
    rng = random.Random(seed)
    paired = n_ref == n_row
    ratios = []
    for _ in range(resamples):
        if paired:
            idx = [rng.randrange(n_ref) for _ in range(n_ref)]
            ref_sample, row_sample = [reference[i] for i in idx], [row[i] for i in idx]
        else:
            ref_sample = [reference[rng.randrange(n_ref)] for _ in range(n_ref)]
            row_sample = [row[rng.randrange(n_row)] for _ in range(n_row)]
        ratios.append(speed_ratio(ref_sample, row_sample))
    tail = 100.0 * (1 - confidence) / 2
    return percentile(ratios, tail), percentile(ratios, 100.0 - tail)
