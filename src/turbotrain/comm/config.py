"""Configuration of data-parallel training."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_bool, check_choice, check_number

__all__ = ["DataParallelConfig", "COMPRESSIONS", "STRATEGIES"]

#: Every value ``DataParallelConfig(compression=...)`` accepts.
COMPRESSIONS = (None, "bf16", "fp16", "powersgd", "onebit")
#: Every value ``DataParallelConfig(strategy=...)`` accepts.
STRATEGIES = ("ring", "parameter_server", "hybrid")


@dataclass(frozen=True)
class DataParallelConfig:
    """Data-parallel training over torch.distributed (DDP underneath)."""

    compression: str | None = None
    """Gradient compression: None, 'bf16', 'fp16', 'powersgd' or 'onebit' (1-bit Adam)."""
    strategy: str = "ring"
    """Topology of the gradient exchange. 'ring': DDP's all-reduce (NCCL picks ring or tree).
    'parameter_server': each bucket's gradient is cut into ``ps_servers`` shards, reduced onto
    the server ranks and broadcast back (sparse embedding gradients too). 'hybrid': dense
    gradients by all-reduce, sparse embedding gradients through the parameter servers."""
    ps_servers: int = 1
    """Ranks 0..ps_servers-1 act as parameter servers ('parameter_server' and 'hybrid'); at most the world size."""
    bucket_mb: float = 25.0
    """DDP bucket size in MiB; smaller buckets start communicating earlier in backward."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm (statistics over the global batch); local by default."""
    powersgd_rank: int = 4
    """Rank of the PowerSGD low-rank approximation."""
    warmup_steps: int = 10
    """Uncompressed steps before PowerSGD starts. 1-bit Adam takes its warm-up from
    ``OneBitAdam(warmup_steps=...)`` (this field only has to be >= 1 for it): choose it as the paper
    does, uncompressed Adam until the variance is stable, ~15-25% of training for BERT;
    ``turbotrain.comm.onebit.warmup_for(total_steps)`` gives 20%, at least 100 steps."""
    sparse_embeddings: bool = False
    """Exchange gradients of nn.Embedding(sparse=True) sparsely instead of densely."""
    find_unused_parameters: bool = False
    """Passed to DDP; only needed for models whose graph skips parameters."""
    timeout_s: float = 300.0
    """Bound on every collective: a rank that died or stalled ends the others after this long."""

    def __post_init__(self):
        check_choice("compression", self.compression, COMPRESSIONS)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_number("ps_servers", self.ps_servers, integer=True, minimum=1)
        check_number("bucket_mb", self.bucket_mb, minimum=0, exclusive=True)
        check_number("powersgd_rank", self.powersgd_rank, integer=True, minimum=1)
        check_number("warmup_steps", self.warmup_steps, integer=True, minimum=0)
        check_number("timeout_s", self.timeout_s, minimum=0, exclusive=True)
        for name in ("sync_bn", "sparse_embeddings", "find_unused_parameters"):
            check_bool(name, getattr(self, name))
        if self.strategy == "parameter_server" and self.compression in ("powersgd", "onebit"):
            # both replace the all-reduce with exchanges of their own; a server in the middle would
            # need their compression on its side too
            raise ConfigError(
                f"strategy='parameter_server' carries the gradient as it is or cast (compression None, "
                f"'bf16', 'fp16'), not compression={self.compression!r}; use strategy='ring' or 'hybrid' with it"
            )
