"""The activation-checkpointing transform."""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
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
        own = next((name or "model" for name, m in model.named_modules()
                    if getattr(m, "gradient_checkpointing", None) is True), None)
        if own is not None:
            # Hugging Face's flag on the modules whose layers it checkpoints itself: each layer would be
            # recomputed inside a recomputation (the forward run three times for one backward).
            raise ConfigError(f"the model checkpoints its own layers ({own}.gradient_checkpointing is True: "
                              f"gradient_checkpointing_enable()), and Config(checkpoint={self.mode!r}) would "
                              "checkpoint them again; drop one: model.gradient_checkpointing_disable(), or "
                              "Config(checkpoint=None)")
        self.blocks_path, blocks = find_block_list(model)
        self.count = (len(range(0, len(blocks), self.every)), len(blocks))
        apply_checkpointing(model, self.mode, self.every)
        # A KV cache written in forward would be written again by the recomputation (HF's own
        # gradient_checkpointing_enable() switches it off for the same reason). Every config the model
        # holds: T5's decoder stack reads a copy of its own when the top model passes use_cache=None.
        configs = {id(c): (name, c) for name, m in model.named_modules()
                   if getattr(c := getattr(m, "config", None), "use_cache", False) is True}
        for name, config in configs.values():
            config.use_cache = False
        if configs:
            where = ", ".join(f"{name}.config" if name else "model.config" for name, _ in configs.values())
            plan.notes.append(f"checkpoint: set use_cache = False in {where} (a cache cannot be recomputed)")

    def describe(self) -> str:
        which = "" if self.count is None or self.every == 1 else \
            f" (every {self.every}: {self.count[0]} of {self.count[1]} blocks)"
        return f"checkpoint {self.mode} on {self.blocks_path or '(blocks found at set-up)'}{which}"
