"""The shape every workload has: a model factory, a loss, and deterministic batches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch
from torch import nn

__all__ = ["Workload", "Batch", "cross_entropy_loss", "user_loss"]

#: (inputs, targets) with a loss_fn, or a dict of the model's keyword arguments (a Hugging Face
#: batch: input_ids, attention_mask, labels) whose loss the model computes itself.
Batch = Union[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def user_loss(model: nn.Module, loss_fn: Optional[Callable], batch) -> torch.Tensor:
    """The loss the way a user's loop computes it, by the Engine's batch contract (turbotrain/batch.py,
    whose LossContract finds it): ``loss_fn(model(inputs), targets)`` for a pair, or without a loss_fn
    ``model(inputs, targets)`` and the model's own loss (nanoGPT); ``model(**batch)`` for a dict, its
    ``.loss`` (a plain dict's ``"loss"``) or ``loss_fn(output, batch)``; ``model(batch)`` for a tensor, its own loss or
    ``loss_fn(output)``. The batch is taken as it is (no device move, no checks): this is a hot loop."""
    from ..batch import Batch as Call, LossContract

    if isinstance(batch, Mapping):
        call = Call((), batch, kind="mapping")
    elif isinstance(batch, torch.Tensor):
        call = Call((batch,), {}, kind="tensor")
    else:
        inputs, targets = batch
        call = Call((inputs,) if loss_fn is not None else (inputs, targets), {}, targets)
    return LossContract(loss_fn)(model, call)


@dataclass
class Workload:
    """One benchmarkable training job.

    ``batches(split, seed)`` yields an endless deterministic stream; the same seed gives the same
    batches in every process, which is what lets benchmark rows compare losses.
    """

    name: str
    kind: str
    """'text' (targets are next tokens or masked tokens), 'image' or 'tabular'."""
    unit: str
    """What throughput is counted in: 'tokens' or 'samples'."""
    items_per_batch: int
    """Tokens (text) or samples (others) in one batch."""
    build_model: Callable[[], nn.Module]
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    """loss_fn(output, targets); None when the batches are dicts and the model computes its own
    loss from ``labels`` (the Hugging Face workloads)."""
    batches: Callable[..., Iterator[Batch]]
    """batches(split='train'|'val', seed=0, device='cpu') -> endless iterator of Batch."""
    description: str = ""
    settings: dict | None = None
    """The hyper-parameters the model and data were built with (for reports)."""

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """This workload's loss of ``model`` on ``batch``, as a user computes it (see user_loss)."""
        return user_loss(model, self.loss_fn, batch)


def cross_entropy_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in FP32, ignoring targets of -100 (padding)."""
    logits = output.float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
    )
