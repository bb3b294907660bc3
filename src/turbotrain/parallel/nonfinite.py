"""``nan_check`` on a sharded run: every rank's view of a non-finite step, one error on every rank.

Under FSDP2 and tensor parallel each rank holds other shards of the gradients (and its own rows of
the batch), so an inf/NaN can be visible on one rank only. The Engine MAX-reduces the finiteness
flag over every rank (``agree_found_inf``), so all ranks stop at the same step, and then each rank
raises the error :func:`nonfinite_error` builds from what *every* rank saw: the loss, the batch,
and which parameter and gradient shards hold inf/NaN, read as local shards (no collective but the
one gather of these findings).

The single-process finder (``turbotrain.diagnose.find_nonfinite``) is not run here: its forward and
backward replays are collectives on a sharded model, and ranks that saw different things would
replay along different paths and wait on each other for ever. The message says how to run it on
the failing rank's batch in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..batch import Batch
from ..diagnose.stats import all_finite
from ..errors import TurbotrainError
from ..utils import local_shard

__all__ = ["RankFindings", "local_findings", "nonfinite_error"]

#: Parameter names listed per rank before "and N more".
_LISTED = 4


@dataclass
class RankFindings:
    """What one rank sees of a non-finite step (plain Python, so it can be gathered)."""

    rank: int
    loss: float
    batch_finite: bool
    bad_params: list = field(default_factory=list)
    """Parameters whose local shard holds inf/NaN."""
    bad_grads: list | None = None
    """Parameters whose local gradient shard holds inf/NaN; None when gradients were not checked
    (fp16 loss scaling, where scaled gradients may overflow legitimately)."""

    def __str__(self) -> str:
        parts = [f"loss {self.loss:.4g}", "batch finite" if self.batch_finite else "batch holds inf/NaN",
                 f"parameter shards with inf/NaN: {_listed(self.bad_params)}"]
        if self.bad_grads is not None:
            parts.append(f"gradient shards with inf/NaN: {_listed(self.bad_grads)}")
        return f"rank {self.rank}: " + "; ".join(parts)


def _listed(names: list) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _nonfinite(t: torch.Tensor | None) -> bool:
    return t is not None and not all_finite(local_shard(t.detach()))


def local_findings(module: nn.Module, loss: torch.Tensor, batch: Batch, check_grads: bool) -> RankFindings:
    """This rank's findings, from its local shards only (no collective)."""
    import torch.distributed as dist

    named = list(module.named_parameters())
    return RankFindings(
        rank=dist.get_rank(), loss=float(local_shard(loss.detach())),
        batch_finite=all_finite((batch.args, batch.kwargs, batch.targets)),
        bad_params=[n for n, p in named if _nonfinite(p)],
        bad_grads=[n for n, p in named if _nonfinite(p.grad)] if check_grads else None,
    )


def _origin(views: list[RankFindings]) -> str:
    """The earliest place the inf/NaN shows, in the order a step makes things: weights, data, loss, gradients."""
    def ranks(pred) -> str:
        return ", ".join(str(v.rank) for v in views if pred(v))

    if any(v.bad_params for v in views):
        return (f"the weights already hold inf/NaN (ranks {ranks(lambda v: v.bad_params)}): an earlier update broke "
                "them; reload the last good checkpoint, lower the learning rate or set Config(clip_grad_norm=1.0)")
    if not all(v.batch_finite for v in views):
        return (f"the batch holds inf/NaN on ranks {ranks(lambda v: not v.batch_finite)}: fix the data (the loader, "
                "normalisation, any division in preprocessing)")
    if not all(math.isfinite(v.loss) for v in views):
        return (f"the forward or the loss went inf/NaN from finite weights and data on ranks "
                f"{ranks(lambda v: not math.isfinite(v.loss))}")
    return (f"the backward made inf/NaN gradients from a finite loss (shards on ranks "
            f"{ranks(lambda v: v.bad_grads)})")


def nonfinite_error(module: nn.Module, loss: torch.Tensor, batch: Batch, *, check_grads: bool,
                    step: int) -> TurbotrainError:
    """The same error on every rank: each rank's findings, gathered (a collective every rank must call)."""
    import torch.distributed as dist

    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, local_findings(module, loss, batch, check_grads))
    return TurbotrainError(
        f"inf/NaN appeared at optimizer step {step} of a sharded run (Config(parallel=...)); every rank stopped "
        f"at this step.\n" + "\n".join(f"  {v}" for v in views) + f"\n  origin: {_origin(views)}.\n"
        "  The module-by-module replay (turbotrain.diagnose.find_nonfinite) does not run on a sharded model (its "
        "forward is a collective the ranks would run along different paths); to name the module, run the failing "
        "rank's batch through the same model in one process without Config(parallel=...) and with "
        "Config(nan_check=True)."
    )
