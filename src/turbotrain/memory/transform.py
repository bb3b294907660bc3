"""The activation-checkpointing transform."""

from __future__ import annotations

from torch import nn

from ..plan import ApplyContext, ModelPlan, Transform
from .checkpoint import apply_checkpointing, find_block_list

__all__ = ["CheckpointTransform"]


class CheckpointTransform(Transform):
    """``Config(checkpoint='blocks' | 'selective')`` over the model's repeated blocks."""

    name = "checkpoint"

    def __init__(self, mode: str):
        self.mode = mode
        self.blocks_path = None

    def apply(self, model: nn.Module, plan: ModelPlan, ctx: ApplyContext) -> None:
        self.blocks_path, _ = find_block_list(model)
        apply_checkpointing(model, self.mode)
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # A KV cache written in forward would be written again by the recomputation (HF's own
            # gradient_checkpointing_enable() switches it off for the same reason).
            config.use_cache = False
            plan.notes.append("checkpoint: set model.config.use_cache = False (a cache cannot be recomputed)")

    def describe(self) -> str:
        return f"checkpoint {self.mode} on {self.blocks_path or '(blocks found at set-up)'}"
