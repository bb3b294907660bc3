"""Activation memory: checkpointing transforms and the measures that show what they save."""

from .checkpoint import (
    CHECKPOINT_MODES,
    SAVED_OPS,
    apply_checkpointing,
    checkpointed_blocks,
    find_block_list,
    is_recomputing,
    remove_checkpointing,
    selective_policy,
)
from .measure import saved_activation_bytes, saved_tensor_bytes

__all__ = [
    # transforms
    "apply_checkpointing",
    "remove_checkpointing",
    "CHECKPOINT_MODES",
    # inspection
    "find_block_list",
    "checkpointed_blocks",
    "is_recomputing",
    "selective_policy",
    "SAVED_OPS",
    # measures
    "saved_activation_bytes",
    "saved_tensor_bytes",
]
