"""Configuration of data-parallel training."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_choice, check_positive

__all__ = ["DataParallelConfig", "COMPRESSIONS"]

#: Every value ``DataParallelConfig(compression=...)`` accepts.
COMPRESSIONS = (None, "bf16", "fp16", "powersgd", "onebit")


@dataclass(frozen=True)
class DataParallelConfig:
    """Data-parallel training over torch.distributed (DDP underneath)."""

    compression: str | None = None
    """Gradient compression: None, 'bf16', 'fp16', 'powersgd' or 'onebit' (1-bit Adam)."""
    bucket_mb: float = 25.0
    """DDP bucket size in MiB; smaller buckets start communicating earlier in backward."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm (statistics over the global batch); local by default."""
    powersgd_rank: int = 4
    """Rank of the PowerSGD low-rank approximation."""
    warmup_steps: int = 10
    """Uncompressed optimizer steps before PowerSGD / 1-bit compression starts."""
    sparse_embeddings: bool = False
    """Exchange gradients of nn.Embedding(sparse=True) sparsely instead of densely."""
    find_unused_parameters: bool = False
    """Passed to DDP; only needed for models whose graph skips parameters."""

    def __post_init__(self):
        check_choice("compression", self.compression, COMPRESSIONS)
        check_positive("bucket_mb", self.bucket_mb)
        for name in ("powersgd_rank", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "powersgd_rank" else 0):
                raise ConfigError(f"{name}={value!r} must be a non-negative integer (rank >= 1)")
