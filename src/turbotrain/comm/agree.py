"""Fail fast when ranks disagree on the setup, instead of hanging inside a mismatched collective.

Two ranks with different bucket layouts or compressors issue collectives of different sizes, and
gloo/NCCL then wait forever. One fixed-size all_gather of a hash is cheap and cannot hang that way.

>>> plan_hash({"compression": None}) == plan_hash({"compression": None})
True
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DistributedError

from .collectives import all_gather_flat

__all__ = ["preflight", "build_plan", "plan_hash"]


def plan_hash(plan: dict) -> int:
    """A signed 64-bit hash of a JSON-able plan, stable across processes and runs."""
    text = json.dumps(plan, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def build_plan(model: nn.Module, dp, *, world_size: int, backend: str, optimizer=None) -> dict:
    """What every rank must agree on before DDP starts: config, parameter layout, world, versions."""
    from dataclasses import asdict

    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()]
    return {
        "data_parallel": asdict(dp),
        "world_size": world_size,
        "backend": backend,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "params": params,
        "torch": torch.__version__,
    }


def _differences(mine: dict, ref: dict) -> list[str]:
    keys = sorted(set(mine) | set(ref))
    out = []
    for key in keys:
        a, b = mine.get(key), ref.get(key)
        if a != b:
            if key == "params":
                out.append("params (model layout differs: same model and dtype on every rank?)")
            else:
                out.append(f"{key} ({a!r} vs {b!r})")
    return out


def preflight(plan: dict, group=None, device: torch.device | None = None) -> None:
    """Check every rank holds the same ``plan``; on mismatch raise DistributedError on every rank.

    The message lists the ranks that differ from the majority and which keys differ, so the
    broken launch line can be found from any rank's log.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([plan_hash(plan)], dtype=torch.int64, device=device)
    gathered = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(gathered, mine, group=group)
    hashes = gathered.tolist()
    if len(set(hashes)) == 1:
        return
    # Majority hash is the reference; a tie goes to rank 0's, the usual source of truth.
    counts = Counter(hashes)
    ref_hash = max(counts, key=lambda h: (counts[h], h == hashes[0]))
    ref_rank = hashes.index(ref_hash)
    # Every rank saw the same hashes, so every rank takes this branch: the object gather cannot hang.
    plans: list = [None] * world
    dist.all_gather_object(plans, plan, group=group)
    lines = []
    for rank, h in enumerate(hashes):
        if h != ref_hash:
            diff = ", ".join(_differences(plans[rank], plans[ref_rank])) or "hash only"
            lines.append(f"rank {rank} differs from rank {ref_rank} in: {diff}")
    raise DistributedError(
        "data-parallel preflight failed, ranks disagree on the training setup:\n  "
        + "\n  ".join(lines)
        + "\nFix: launch every rank with the same config, model and library versions."
    )
