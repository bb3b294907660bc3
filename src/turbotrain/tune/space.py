"""The search space of ``turbotrain tune``, enumerated explicitly: one Candidate per combination.

Axes (each value is a Config setting, or the micro-batch split of the user's batch):

    precision      fp32, bf16-mixed, bf16-master, fp16-mixed, fp16-master
    fusion         none, each pattern of FUSION_PATTERNS alone, every pattern
    compile        none, forward+loss (the Engine's one compile scope: ``Config(compile=True)``
                   compiles forward and loss as one graph; the whole step with backward and the
                   optimizer is not an Engine option, it is the ladder's torch-compile-step row)
    checkpoint     none, blocks, every other block (blocks/2: ``checkpoint_every=2``), selective
    accumulate     1, 2, 4: the batch split into that many micro-batches, one optimizer step
    data parallel  compression x DDP bucket size, for one compute recipe (the single-process
                   search's winner): ``enumerate_dp_space``, searched by the data-parallel stage
                   (dp_prune.py, dp_search.py) when the run has several ranks

>>> space = enumerate_space(batch_rows=8)
>>> len(space) == 5 * 7 * 2 * 4 * 3
True
>>> space[0].name, space[0].is_baseline
('fp32', True)
>>> next(c for c in space if c.checkpoint_every == 2).name
'fp32+ckpt:blocks/2'
>>> dp = enumerate_dp_space(space[0])
>>> len(dp) == len(COMPRESSIONS) * len(BUCKET_MB_VALUES), dp[0].name, dp[0].is_dp_reference
(True, 'fp32+dp:none:25MB', True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from ..comm.config import COMPRESSIONS
from ..config import FUSION_PATTERNS, Config
from ..errors import ConfigError, check_number
from ..precision.config import PRECISIONS

__all__ = ["Candidate", "AXES", "PRECISION_VALUES", "FUSION_VALUES", "COMPILE_VALUES", "CHECKPOINT_VALUES",
           "ACCUMULATE_VALUES", "BUCKET_MB_VALUES", "DEFAULT_BUCKET_MB", "SHORT_PATTERN", "enumerate_space",
           "enumerate_dp_space", "fusion_label", "checkpoint_label"]

#: Every explicit precision mode ('auto' is a choice the tuner makes itself, so it is not a value).
PRECISION_VALUES = tuple(p for p in PRECISIONS if p != "auto")
#: No fusion, each pattern alone, and all of them: 2^5 subsets would be 32 values of one axis; the
#: ablation (benchmarks/) found single patterns to win or lose on their own, so singles plus "all"
#: cover what was seen to matter at a seventh of the cost.
FUSION_VALUES: tuple[tuple[str, ...], ...] = ((),) + tuple((p,) for p in FUSION_PATTERNS) + (FUSION_PATTERNS,)
COMPILE_VALUES = ("none", "forward+loss")
#: (Config.checkpoint, Config.checkpoint_every): none, every block, every other block (blocks 0,
#: 2, 4, ...: about half the saved activations for about half the recompute, the point between
#: none and all that benchmarks/2026-12-06-avx2-t1024-memory.md measured), and selective on every
#: block. Selective on every other block is not a default value: selective already is the cheap
#: middle point (only the elementwise and norm ops are recomputed), so halving it again buys back a
#: quarter of what block checkpointing saves, a step the few measured steps of a tune cannot tell
#: from none, for another 210 candidates in the same budget; pass ``("selective", 2)`` in
#: ``checkpoints`` to search it.
CHECKPOINT_VALUES: tuple[tuple[str | None, int], ...] = ((None, 1), ("blocks", 1), ("blocks", 2), ("selective", 1))
ACCUMULATE_VALUES = (1, 2, 4)
#: DDP bucket sizes tried with each compression (MiB): DDP's default, and smaller buckets that
#: start communicating earlier in backward.
BUCKET_MB_VALUES = (25.0, 5.0)
#: DDP's (and DataParallelConfig's) default bucket: the data-parallel stage's reference runs with it.
DEFAULT_BUCKET_MB = 25.0
SHORT_PATTERN = {"linear_act": "lact", "qkv": "qkv", "layernorm_gelu": "lngelu", "swiglu": "swiglu",
                 "linear_cross_entropy": "lce"}
AXES = ("precision", "fusion", "compile", "checkpoint", "accumulate", "data_parallel")


def checkpoint_label(mode: str | None, every: int = 1) -> str | None:
    """None, the mode, or 'mode/N' for every Nth block (``checkpoint_every=N``).

    >>> checkpoint_label("blocks"), checkpoint_label("blocks", 2), checkpoint_label(None)
    ('blocks', 'blocks/2', None)
    """
    if mode is None or every == 1:
        return mode
    return f"{mode}/{every}"


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
    checkpoint_every: int = 1
    """Config.checkpoint_every: with ``checkpoint``, blocks 0, N, 2N, ... only (1: every block)."""
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
        """Plain FP32 with nothing on, in one process: the shadow run every loss is checked against."""
        return (self.precision == "fp32" and not self.fusion and self.compile == "none" and self.checkpoint is None
                and self.accumulate == 1 and not self.data_parallel)

    @property
    def is_dp_reference(self) -> bool:
        """Data parallel with DDP's defaults (no compression, the default bucket): the job the
        data-parallel stage takes every ratio and loss delta against."""
        return self.data_parallel and self.compression is None and self.bucket_mb == DEFAULT_BUCKET_MB

    @property
    def name(self) -> str:
        parts = [self.precision]
        if self.fusion:
            parts.append(f"fuse:{fusion_label(self.fusion)}")
        if self.compile != "none":
            parts.append("compile")
        if self.checkpoint:
            parts.append(f"ckpt:{self.checkpoint_label}")
        if self.accumulate > 1:
            parts.append(f"acc{self.accumulate}")
        if self.data_parallel:
            parts.append(f"dp:{self.dp_label}")
        return "+".join(parts)

    @property
    def checkpoint_label(self) -> str | None:
        """None, 'blocks', 'selective', or 'blocks/2' for every other block."""
        return checkpoint_label(self.checkpoint, self.checkpoint_every)

    @property
    def dp_label(self) -> str:
        """'compression:bucket', e.g. 'powersgd:5MB' ('none' for no compression)."""
        return f"{self.compression or 'none'}:{self.bucket_mb:g}MB"

    def settings(self) -> dict:
        """The axis values as labels, for reports (``config()`` has the Config's own values)."""
        out = {"precision": self.precision, "fusion": fusion_label(self.fusion), "compile": self.compile,
               "checkpoint": self.checkpoint_label, "accumulate": self.accumulate, "micro_batch": self.micro_batch}
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
                      checkpoint=self.checkpoint, checkpoint_every=self.checkpoint_every, accumulate=self.accumulate,
                      data_parallel=dp)


def enumerate_space(batch_rows: int, *, precisions=PRECISION_VALUES, fusions=FUSION_VALUES,
                    compiles=COMPILE_VALUES, checkpoints=CHECKPOINT_VALUES, accumulates=ACCUMULATE_VALUES
                    ) -> list[Candidate]:
    """Every combination of the compute axes, the baseline first; nothing is pruned here (prune.py does that).

    ``checkpoints``: each value a mode (None, 'blocks', 'selective': every block) or a (mode,
    every) pair. Accumulation values that do not divide ``batch_rows`` are kept, and so are
    checkpoint_every values that pick the same blocks as a smaller one on the model's block count
    (prune.py knows the count), so the report can say why they were dropped. The data-parallel axes
    are not crossed with these: ``enumerate_dp_space`` spans them for the recipe this search picks
    (crossing them would multiply the space by 10 and measure the exchange of recipes that lost on
    compute).
    """
    check_number("batch_rows", batch_rows, integer=True, minimum=1)
    for name, values in (("precisions", precisions), ("fusions", fusions), ("compiles", compiles),
                         ("checkpoints", checkpoints), ("accumulates", accumulates)):
        if not values:
            raise ConfigError(f"the tune space axis {name} is empty; give it at least one value")
    checkpoints = [_checkpoint_value(v) for v in checkpoints]
    out = [Candidate(precision, tuple(fusion), comp, mode, acc, batch_rows, checkpoint_every=every)
           for precision, fusion, comp, (mode, every), acc in itertools.product(precisions, fusions, compiles,
                                                                                 checkpoints, accumulates)]
    out.sort(key=lambda c: not c.is_baseline)  # stable: the baseline first, the rest in product order
    return out


def _checkpoint_value(value) -> tuple[str | None, int]:
    """A checkpoint axis value as (mode, every), validated as the Config would take it."""
    if isinstance(value, (tuple, list)) and len(value) != 2:
        raise ConfigError(f"checkpoint axis value {value!r} is not valid; give a mode (None, 'blocks', 'selective') "
                          "or a (mode, every) pair such as ('blocks', 2)")
    mode, every = value if isinstance(value, (tuple, list)) else (value, 1)
    Config(checkpoint=mode, checkpoint_every=every)  # a ConfigError listing the valid choices
    return mode, every


def enumerate_dp_space(recipe: Candidate, *, compressions=COMPRESSIONS, bucket_mbs=BUCKET_MB_VALUES
                       ) -> list[Candidate]:
    """Compression x bucket size for ``recipe``'s compute settings (precision, fusion, compile,
    checkpointing, accumulation), DDP's defaults (no compression, the default bucket) first.

    Every value ``DataParallelConfig(compression=...)`` accepts is enumerated, including those the
    pruning will remove (fp16 on the wire, a cast to the gradients' own dtype), so the report says why.
    """
    if not compressions or not bucket_mbs:
        raise ConfigError("the data-parallel space needs at least one compression and one bucket size")
    if DEFAULT_BUCKET_MB not in bucket_mbs or None not in compressions:
        raise ConfigError(f"the data-parallel space must hold DDP's defaults (compression None, bucket "
                          f"{DEFAULT_BUCKET_MB:g} MiB): every ratio and loss delta is taken against that job")
    out = [replace(recipe, compression=compression, bucket_mb=float(bucket), data_parallel=True, status="candidate",
                   reason=None, pruned_axis=None, estimates={}, measured={})
           for compression, bucket in itertools.product(compressions, bucket_mbs)]
    out.sort(key=lambda c: not c.is_dp_reference)
    return out
