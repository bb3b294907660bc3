"""Configuration of sharded and tensor-parallel training: how many ranks each degree takes.

The world is split into a mesh of four dimensions, outermost first:

    dp_replicate x dp_shard x cp x tp = world size

``tp`` ranks hold slices of every weight matrix (Megatron-style tensor parallel, neighbours on the
fastest links), ``dp_shard`` ranks hold 1/dp_shard of every parameter, gradient and optimizer state
(FSDP2, ZeRO-3), and ``dp_replicate`` groups of those hold identical replicas (HSDP when both data
dimensions are above one). ``cp`` ranks hold T/cp of every sequence (context parallel,
context.py); they see the same rows, and FSDP shards over dp_shard x cp, so their gradients are
averaged too.

>>> ParallelConfig(tp=2).resolve(8)
ResolvedDegrees(dp_replicate=1, dp_shard=4, tp=2, cp=1)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_bool

__all__ = ["ParallelConfig", "ResolvedDegrees", "MESH_DIMS"]

#: Mesh dimension names, outermost first (the names torch's DeviceMesh slices are taken by).
MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ResolvedDegrees:
    """The concrete degrees for one world size (no -1 left)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    """Context-parallel ranks (last here so positional (dp_replicate, dp_shard, tp) still reads right)."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: the number of distinct micro-batches per step (tp and cp ranks share one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp


def _check_degree(name: str, value, allow_rest: bool = False) -> None:
    rest = " or -1 (the ranks left over)" if allow_rest else ""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not (allow_rest and value == -1)):
        raise ConfigError(f"{name}={value!r} is not valid; it must be an integer >= 1{rest}")


@dataclass(frozen=True)
class ParallelConfig:
    """Shard the model over torch.distributed: FSDP2 over ``dp_shard``, tensor parallel over ``tp``,
    context parallel (the sequence split) over ``cp``.

    >>> ParallelConfig(dp_replicate=2, dp_shard=2).resolve(4).dp
    4
    """

    dp_replicate: int = 1
    """Replicas of the (sharded) model; above 1 with dp_shard above 1 this is HSDP."""
    dp_shard: int = -1
    """Ranks each parameter, gradient and optimizer state is sharded over (FSDP2); -1: the ranks left over."""
    tp: int = 1
    """Tensor-parallel ranks: each holds 1/tp of every attention and MLP matrix, the embedding and the head."""
    cp: int = 1
    """Context-parallel ranks: each holds T/cp of every sequence; attention exchanges heads (all-to-all)."""
    sequence_parallel: bool = False
    """With tp > 1, also split the norms' and residual's activations along the sequence (Megatron SP)."""
    loss_parallel: bool = True
    """With tp > 1, keep the logits sharded over the vocabulary and compute the cross-entropy on the shards
    (torch's loss_parallel): no (B, T, V) all-gather and no full logits or logit gradient on any rank. The
    loss must be F.cross_entropy on the logits (a loss_fn doing other math on them raises, naming this switch);
    False gathers the logits into a plain tensor first."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (ZeRO-3); False keeps them for backward (ZeRO-2 style)."""

    def __post_init__(self):
        _check_degree("dp_replicate", self.dp_replicate)
        _check_degree("dp_shard", self.dp_shard, allow_rest=True)
        _check_degree("tp", self.tp)
        _check_degree("cp", self.cp)
        if self.cp > 1 and self.tp > 1:
            raise ConfigError(f"cp={self.cp} with tp={self.tp}: context parallel with tensor parallel is not "
                              "supported yet; set tp=1 (FSDP shards over dp_shard x cp) or cp=1")
        check_bool("sequence_parallel", self.sequence_parallel)
        check_bool("loss_parallel", self.loss_parallel)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1 (it splits the sequence over the tensor-parallel "
                              "ranks); set tp=2 or more, or sequence_parallel=False")

    def resolve(self, world_size: int) -> ResolvedDegrees:
        """The degrees for ``world_size`` ranks; ConfigError naming the numbers when they do not multiply to it.

        >>> ParallelConfig(dp_replicate=2).resolve(8)
        ResolvedDegrees(dp_replicate=2, dp_shard=4, tp=1, cp=1)
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
        fixed = self.dp_replicate * self.cp * self.tp
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        shard = self.dp_shard
        if shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"dp_replicate={self.dp_replicate}{cp} x tp={self.tp} = {fixed} does not divide the world size "
                    f"{world_size}, so dp_shard=-1 has no whole number of ranks left; choose degrees whose product "
                    f"divides {world_size}"
                )
            shard = world_size // fixed
        degrees = ResolvedDegrees(self.dp_replicate, shard, self.tp, self.cp)
        if degrees.world_size != world_size:
            raise ConfigError(
                f"dp_replicate={self.dp_replicate} x dp_shard={shard}{cp} x tp={self.tp} = {degrees.world_size} ranks, "
                f"but the world size is {world_size}; make the product equal it (dp_shard=-1 takes the ranks left over)"
            )
        return degrees
