"""The seed's topologies beside DDP's ring all-reduce: a parameter server, and the hybrid of both.

``DataParallelConfig(strategy=...)``:

* ``'ring'``: DDP's all-reduce (NCCL's ring or tree), what every compression hook builds on;
* ``'parameter_server'``: each DDP bucket's flat gradient is cut into ``ps_servers`` shards;
  shard s is reduced onto server rank s (``dist.reduce``, "push") and broadcast back from it
  (``dist.broadcast``, "pull"). It is a DDP comm hook, so it keeps DDP's bucketing and overlap;
  the pull of a bucket is launched from its push's completion (hooks.OrderedSecondPhase), so
  backward never waits for it. Sparse embedding gradients go to the servers as (row, values)
  pairs, each server owning a contiguous range of rows;
* ``'hybrid'``: dense gradients by all-reduce (with any compression), sparse embedding gradients
  by the parameter-server path: all-reduce suits dense tensors every rank has in full, a server
  suits rows only some ranks touched.

The servers are ordinary training ranks 0..ps_servers-1 (their link carries world/ps_servers
times a worker's traffic, which is the topology's known bottleneck; comm/model.py prices it).
"""

# No `from __future__ import annotations`: DDP reads a comm hook's return annotation at run time.

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collectives import all_gather_flat
from .hooks import HookState, OrderedSecondPhase, completed

__all__ = ["ParameterServerState", "parameter_server_hook", "ps_sparse_mean", "shard_bounds", "global_rank"]


def shard_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, near-equal (start, end) pieces of ``range(length)``; empty ones dropped."""
    per = math.ceil(length / shards) if length else 0
    return [(a, min(a + per, length)) for a in range(0, length, per)] if per else []


def global_rank(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (collectives' src/dst take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


@dataclass
class ParameterServerState(HookState):
    """Hook state of the parameter-server strategy."""

    servers: int = 1
    """Ranks 0..servers-1 of the group serve one shard each."""
    rank: int = 0
    """This process's rank in the group."""
    _second: OrderedSecondPhase = field(default_factory=OrderedSecondPhase, repr=False)


def parameter_server_hook(state: ParameterServerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: push shards of the pre-divided bucket onto the servers, pull the sums back."""
    buffer = bucket.buffer()
    state.close_bucket(bucket)
    if state.world_size == 1:
        return completed(buffer)
    buffer.div_(state.world_size)
    wire = buffer if state.wire_dtype in (None, buffer.dtype) else buffer.to(state.wire_dtype)
    shards = shard_bounds(wire.numel(), state.servers)
    elem = wire.element_size()
    pushes = []
    for s, (a, b) in enumerate(shards):
        pushes.append(dist.reduce(wire[a:b], dst=global_rank(state.group, s), group=state.group,
                                  async_op=True).get_future())
    state.count(wire.numel() * elem, calls=len(shards))

    def pull(_):
        side = state.side_group if state.side_group is not None else state.group
        futs = [dist.broadcast(wire[a:b], src=global_rank(side, s), group=side, async_op=True).get_future()
                for s, (a, b) in enumerate(shards)]
        mine = [b - a for s, (a, b) in enumerate(shards) if s == state.rank]
        state.count(sum(mine) * elem, calls=len(shards))
        return torch.futures.collect_all(futs).then(lambda _: back())

    def back():
        if wire is not buffer:
            buffer.copy_(wire)
        return buffer

    first = torch.futures.collect_all(pushes)
    return state._second.chain(first, pull, buffer.device)


def ps_sparse_mean(grad: torch.Tensor, group=None, counter: HookState | None = None, *,
                   servers: int = 1) -> torch.Tensor:
    """Mean over ranks of a sparse COO gradient through parameter servers, as a coalesced sparse tensor.

    Server s owns the rows in ``shard_bounds(rows, servers)[s]``. Push: every rank gathers its
    (row index, row) pairs of those rows onto server s (``dist.gather``, padded to the largest
    count, which one all_gather of the counts tells everyone). The server sums them. Pull: it
    broadcasts its count, then its rows.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    grad = grad.coalesce()
    indices, values = grad.indices(), grad.values()
    device = values.device
    bounds = shard_bounds(grad.shape[0], servers)
    # coalesced indices are sorted by row, so each server's entries are one slice
    cuts = torch.searchsorted(indices[0].contiguous(), torch.tensor([a for a, _ in bounds] + [grad.shape[0]],
                                                                     device=indices.device)).tolist()
    mine = torch.tensor([cuts[s + 1] - cuts[s] for s in range(len(bounds))], dtype=torch.int64, device=device)
    counts = torch.empty(world * len(bounds), dtype=torch.int64, device=device)
    all_gather_flat(counts, mine, group=group)
    counts = counts.view(world, len(bounds)).tolist()
    sent = mine.numel() * 8
    calls = 1
    results = []
    for s in range(len(bounds)):
        width = max(row[s] for row in counts)
        if width == 0:
            results.append((indices.new_empty(indices.shape[0], 0), values.new_empty((0,) + values.shape[1:])))
            continue
        dst = global_rank(group, s)
        idx = indices.new_zeros(indices.shape[0], width)
        val = values.new_zeros((width,) + values.shape[1:])
        k = cuts[s + 1] - cuts[s]
        idx[:, :k] = indices[:, cuts[s]:cuts[s + 1]]
        val[:k] = values[cuts[s]:cuts[s + 1]]
        idx = idx.t().contiguous()  # gathered along dim 0
        got_idx = [torch.empty_like(idx) for _ in range(world)] if rank == s else None
        got_val = [torch.empty_like(val) for _ in range(world)] if rank == s else None
        dist.gather(idx, got_idx, dst=dst, group=group)
        dist.gather(val, got_val, dst=dst, group=group)
        sent += idx.numel() * idx.element_size() + val.numel() * val.element_size()
        calls += 2
        nnz = torch.zeros(1, dtype=torch.int64, device=device)
        if rank == s:
            summed = torch.sparse_coo_tensor(
                torch.cat([got_idx[r][:counts[r][s]] for r in range(world)]).t(),
                torch.cat([got_val[r][:counts[r][s]] for r in range(world)]), grad.shape).coalesce()
            s_idx, s_val = summed.indices().contiguous(), summed.values().contiguous()
            nnz[0] = s_idx.shape[1]
        dist.broadcast(nnz, src=dst, group=group)
        if rank != s:
            s_idx = indices.new_empty(indices.shape[0], int(nnz))
            s_val = values.new_empty((int(nnz),) + values.shape[1:])
        dist.broadcast(s_idx, src=dst, group=group)
        dist.broadcast(s_val, src=dst, group=group)
        calls += 3
        if rank == s:
            sent += 8 + s_idx.numel() * s_idx.element_size() + s_val.numel() * s_val.element_size()
        results.append((s_idx, s_val))
    if counter is not None:
        counter.count(sent, calls=calls)
    idx = torch.cat([r[0] for r in results], dim=1)
    val = torch.cat([r[1] for r in results], dim=0)
    return torch.sparse_coo_tensor(idx, val / world, grad.shape).coalesce()
