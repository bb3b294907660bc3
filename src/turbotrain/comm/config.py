"""Configuration of data-parallel training."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import check_bool, check_choice, check_number

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
        check_number("bucket_mb", self.bucket_mb, minimum=0, exclusive=True)
        check_number("powersgd_rank", self.powersgd_rank, integer=True, minimum=1)
        check_number("warmup_steps", self.warmup_steps, integer=True, minimum=0)
        for name in ("sync_bn", "sparse_embeddings", "find_unused_parameters"):
            check_bool(name, getattr(self, name))
