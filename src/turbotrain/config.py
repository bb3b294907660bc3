"""The one configuration object every Engine takes.

Each field belongs to one subpackage (precision/, fusion/, comm/, memory/, diagnose/); nothing is
switched on unless it is named here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .comm.config import DataParallelConfig
from .errors import ConfigError, check_choice, check_positive
from .precision.config import PRECISIONS, LossScaleConfig

__all__ = ["Config", "CHECKPOINT_MODES", "DEVICES", "FUSION_PATTERNS"]

CHECKPOINT_MODES = (None, "blocks", "selective")
DEVICES = ("auto", "cpu", "cuda")
#: Pattern names ``Config(fuse=(...))`` and ``turbotrain.fusion.fuse(patterns=...)`` accept.
FUSION_PATTERNS = ("linear_act", "qkv", "layernorm_gelu", "swiglu", "linear_cross_entropy")


@dataclass(frozen=True)
class Config:
    """How an Engine trains. Invalid values raise ConfigError listing the valid choices.

    >>> Config(precision="bf16-master", accumulate=4, clip_grad_norm=1.0).accumulate
    4
    """

    precision: str = "fp32"
    """'fp32', 'bf16-mixed'/'fp16-mixed' (autocast), 'bf16-master'/'fp16-master' (model in low
    precision, FP32 master weights in the optimizer) or 'auto' (chosen from the hardware, printed)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling; used by the fp16 modes only."""
    keep_fp32_head: bool = False
    """Also keep the classifier head (the last Linear feeding the loss) in FP32."""
    accumulate: int = 1
    """Micro-batches per optimizer step; gradients are communicated once per step."""
    clip_grad_norm: float | None = None
    """Clip the global gradient L2 norm to this value (after unscaling), or None."""
    fuse: bool | tuple[str, ...] = False
    """True for every fusion pattern, a tuple of names from FUSION_PATTERNS, or False."""
    compile: bool = False
    """Run the model through torch.compile (with sequence-length bucketing)."""
    seq_buckets: tuple[int, ...] | None = None
    """Sequence lengths batches are padded up to when compiling, so shapes stay few."""
    checkpoint: str | None = None
    """Activation checkpointing: None, 'blocks' (every block) or 'selective' (keep matmul outputs)."""
    data_parallel: DataParallelConfig | bool | None = None
    """True or a DataParallelConfig to train data-parallel over torch.distributed."""
    nan_check: bool = False
    """One fused finiteness test of the loss per step; on failure find the origin module."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    sync_stats: bool = False
    """Copy StepStats tensors to host floats every step (a device sync); off by default."""
    track_grad_norm: bool = False
    """Report the global gradient norm in StepStats even without clipping (one extra pass)."""

    def __post_init__(self):
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        check_choice("device", self.device, DEVICES)
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) or self.accumulate < 1:
            raise ConfigError(f"accumulate={self.accumulate!r} is not valid; it must be an integer >= 1")
        if self.clip_grad_norm is not None:
            check_positive("clip_grad_norm", self.clip_grad_norm)
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ConfigError("loss_scale must be a turbotrain.LossScaleConfig")
        object.__setattr__(self, "fuse", _normalise_fuse(self.fuse))
        object.__setattr__(self, "data_parallel", _normalise_dp(self.data_parallel))
        if self.seq_buckets is not None:
            buckets = tuple(sorted(set(self.seq_buckets)))
            if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
                raise ConfigError(f"seq_buckets={self.seq_buckets!r} must be positive integers")
            object.__setattr__(self, "seq_buckets", buckets)

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-JSON form, for benchmark rows and checkpoints."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "__dataclass_fields__"):
                value = {g.name: getattr(value, g.name) for g in fields(value)}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def _normalise_fuse(value) -> tuple[str, ...]:
    if value is True:
        return FUSION_PATTERNS
    if value is False or value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    patterns = tuple(value)
    for name in patterns:
        check_choice("fuse pattern", name, FUSION_PATTERNS)
    return patterns


def _normalise_dp(value) -> DataParallelConfig | None:
    if value is True:
        return DataParallelConfig()
    if value is False or value is None:
        return None
    if not isinstance(value, DataParallelConfig):
        raise ConfigError("data_parallel must be True, False or a turbotrain.DataParallelConfig")
    return value
