"""The activation-checkpointing transform."""

from __future__ import annotations

from torch import nn

from ..plan import ApplyContext, ModelPlan, Transform
from .checkpoint import apply_checkpointing, find_block_list

__all__ = ["CheckpointTransform"]


class CheckpointTransform(Transform):
    """``Config(checkpoint='blocks' | 'selective', checkpoint_every=N)`` over the model's repeated blocks."""

    name = "checkpoint"

    def __init__(self, mode: str, every: int = 1):
        self.mode = mode
        self.every = every
        self.blocks_path = None
        self.count = None

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        self.blocks_path, blocks = find_block_list(model)
        self.count = (len(range(0, len(blocks), self.every)), len(blocks))
        apply_checkpointing(model, self.mode, self.every)
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # A KV cache written in forward would be written again by the recomputation (HF's own
            # gradient_checkpointing_enable() switches it off for the same reason).
            config.use_cache = False
            plan.notes.append("checkpoint: set model.config.use_cache = False (a cache cannot be recomputed)")

    def describe(self) -> str:
        which = "" if self.count is None or self.every == 1 else \
            f" (every {self.every}: {self.count[0]} of {self.count[1]} blocks)"
        return f"checkpoint {self.mode} on {self.blocks_path or '(blocks found at set-up)'}{which}"
