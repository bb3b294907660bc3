"""The shape every workload has: a model factory, a loss, and deterministic batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["Workload", "Batch", "cross_entropy_loss"]

#: (inputs, targets): what Engine.step and the loss take.
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """One benchmarkable training job.

    ``batches(split, seed)`` yields an endless deterministic stream; the same seed gives the same
    batches in every process, which is what lets benchmark rows compare losses.
    """

    name: str
    kind: str
    """'text' (targets are next tokens), 'image' or 'tabular'."""
    unit: str
    """What throughput is counted in: 'tokens' or 'samples'."""
    items_per_batch: int
    """Tokens (text) or samples (others) in one batch."""
    build_model: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batches: Callable[..., Iterator[Batch]]
    """batches(split='train'|'val', seed=0, device='cpu') -> endless iterator of Batch."""
    description: str = ""
    settings: dict | None = None
    """The hyper-parameters the model and data were built with (for reports)."""


def cross_entropy_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in FP32, ignoring targets of -100 (padding).

    A fused head (turbotrain.fusion) may return an object with a ``cross_entropy_loss(targets)``
    method instead of logits, so the loss is computed without materialising FP32 logits.
    """
    fused = getattr(output, "cross_entropy_loss", None)
    if fused is not None:
        return fused(targets)
    logits = output.float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
    )
