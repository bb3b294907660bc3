"""The search space of ``turbotrain tune``, enumerated explicitly: one Candidate per combination.

Axes (each value is a Config setting, or the micro-batch split of the user's batch):

    precision      fp32, bf16-mixed, bf16-master, fp16-mixed, fp16-master
    fusion         none, each pattern of FUSION_PATTERNS alone, every pattern
    compile        none, forward+loss (the Engine's one compile scope: ``Config(compile=True)``
                   compiles forward and loss as one graph; the whole step with backward and the
                   optimizer is not an Engine option, it is the ladder's torch-compile-step row)
    checkpoint     none, blocks, selective
    accumulate     1, 2, 4: the batch split into that many micro-batches, one optimizer step
    data parallel  compression x bucket size, only when the run is data parallel (world_size > 1)

>>> space = enumerate_space(batch_rows=8)
>>> len(space) == 5 * 7 * 2 * 3 * 3
True
>>> space[0].name, space[0].is_baseline
('fp32', True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..comm.config import COMPRESSIONS
from ..config import CHECKPOINT_MODES, FUSION_PATTERNS, Config
from ..errors import ConfigError, check_number
from ..precision.config import PRECISIONS

__all__ = ["Candidate", "AXES", "PRECISION_VALUES", "FUSION_VALUES", "COMPILE_VALUES", "ACCUMULATE_VALUES",
           "BUCKET_MB_VALUES", "SHORT_PATTERN", "enumerate_space", "fusion_label"]

#: Every explicit precision mode ('auto' is a choice the tuner makes itself, so it is not a value).
PRECISION_VALUES = tuple(p for p in PRECISIONS if p != "auto")
#: No fusion, each pattern alone, and all of them: 2^5 subsets would be 32 values of one axis; the
#: ablation (benchmarks/) found single patterns to win or lose on their own, so singles plus "all"
#: cover what was seen to matter at a seventh of the cost.
FUSION_VALUES: tuple[tuple[str, ...], ...] = ((),) + tuple((p,) for p in FUSION_PATTERNS) + (FUSION_PATTERNS,)
COMPILE_VALUES = ("none", "forward+loss")
ACCUMULATE_VALUES = (1, 2, 4)
#: DDP bucket sizes tried with each compression (MiB): DDP's default, and smaller buckets that
#: start communicating earlier in backward.
BUCKET_MB_VALUES = (25.0, 5.0)
SHORT_PATTERN = {"linear_act": "lact", "qkv": "qkv", "layernorm_gelu": "lngelu", "swiglu": "swiglu",
                 "linear_cross_entropy": "lce"}
AXES = ("precision", "fusion", "compile", "checkpoint", "accumulate", "data_parallel")


def fusion_label(patterns: tuple[str, ...]) -> str:
    """'none', 'all' or the short names joined by ','."""
    if not patterns:
        return "none"
    if tuple(patterns) == FUSION_PATTERNS:
        return "all"
    return ",".join(SHORT_PATTERN[p] for p in patterns)


@dataclass
class Candidate:
    """One point of the space, and what the tuner learnt about it."""

    precision: str
    fusion: tuple[str, ...]
    compile: str
    checkpoint: str | None
    accumulate: int
    batch_rows: int
    """Rows of the user's batch; a micro-batch holds batch_rows // accumulate of them."""
    compression: str | None = None
    bucket_mb: float | None = None
    data_parallel: bool = False
    status: str = "candidate"
    """'candidate' until decided; then 'pruned', 'not reached', 'error', 'rejected' or 'measured'."""
    reason: str | None = None
    """Why it was pruned, rejected, not reached or failed."""
    pruned_axis: str | None = None
    """The axis whose value pruned it."""
    estimates: dict = field(default_factory=dict)
    """The memory and ordering models' figures (prune.py)."""
    measured: dict = field(default_factory=dict)
    """What the interleaved run measured (search.py)."""

    @property
    def micro_batch(self) -> int:
        return self.batch_rows // self.accumulate

    @property
    def is_baseline(self) -> bool:
        """Plain FP32 with nothing on: the shadow run every loss is checked against."""
        return (self.precision == "fp32" and not self.fusion and self.compile == "none" and self.checkpoint is None
                and self.accumulate == 1 and self.compression is None)

    @property
    def name(self) -> str:
        parts = [self.precision]
        if self.fusion:
            parts.append(f"fuse:{fusion_label(self.fusion)}")
        if self.compile != "none":
            parts.append("compile")
        if self.checkpoint:
            parts.append(f"ckpt:{self.checkpoint}")
        if self.accumulate > 1:
            parts.append(f"acc{self.accumulate}")
        if self.data_parallel:
            parts.append(f"dp:{self.compression or 'fp32'}:{self.bucket_mb:g}MB")
        return "+".join(parts)

    def settings(self) -> dict:
        """The axis values, for reports."""
        out = {"precision": self.precision, "fusion": fusion_label(self.fusion), "compile": self.compile,
               "checkpoint": self.checkpoint, "accumulate": self.accumulate, "micro_batch": self.micro_batch}
        if self.data_parallel:
            out.update(compression=self.compression, bucket_mb=self.bucket_mb)
        return out

    def config(self) -> Config:
        """The Config this candidate trains with (device 'auto': the file runs on any machine)."""
        dp = None
        if self.data_parallel:
            from ..comm.config import DataParallelConfig

            dp = DataParallelConfig(compression=self.compression, bucket_mb=self.bucket_mb)
        return Config(precision=self.precision, fuse=self.fusion, compile=self.compile != "none",
                      checkpoint=self.checkpoint, accumulate=self.accumulate, data_parallel=dp)


def enumerate_space(batch_rows: int, *, world_size: int = 1, precisions=PRECISION_VALUES, fusions=FUSION_VALUES,
                    compiles=COMPILE_VALUES, checkpoints=CHECKPOINT_MODES, accumulates=ACCUMULATE_VALUES,
                    compressions=COMPRESSIONS, bucket_mbs=BUCKET_MB_VALUES) -> list[Candidate]:
    """Every combination of the axes, the baseline first; nothing is pruned here (prune.py does that).

    Accumulation values that do not divide ``batch_rows`` are kept, so the report can say why they
    were dropped. The data-parallel axes exist only when ``world_size > 1``.
    """
    check_number("batch_rows", batch_rows, integer=True, minimum=1)
    check_number("world_size", world_size, integer=True, minimum=1)
    for name, values in (("precisions", precisions), ("fusions", fusions), ("compiles", compiles),
                         ("checkpoints", checkpoints), ("accumulates", accumulates)):
        if not values:
            raise ConfigError(f"the tune space axis {name} is empty; give it at least one value")
    dp_values = list(itertools.product(compressions, bucket_mbs)) if world_size > 1 else [(None, None)]
    out = []
    for precision, fusion, comp, ckpt, acc, (compression, bucket) in itertools.product(
            precisions, fusions, compiles, checkpoints, accumulates, dp_values):
        out.append(Candidate(precision, tuple(fusion), comp, ckpt, acc, batch_rows, compression=compression,
                             bucket_mb=bucket, data_parallel=world_size > 1))
    out.sort(key=lambda c: not c.is_baseline)  # stable: the baseline first, the rest in product order
    return out
