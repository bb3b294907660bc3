"""Activation checkpointing of a model's blocks, whole or selective, without touching state_dict keys.

``apply_checkpointing(model, "blocks")`` recomputes each block's forward in backward, so only block
inputs stay alive between forward and backward. ``"selective"`` keeps the outputs of the expensive
ops (matmuls, attention) and recomputes only the cheap elementwise and norm ops, which buys most of
the memory back for a few percent of extra compute.

The block's class is swapped for a subclass whose ``forward`` runs the original one under
``torch.utils.checkpoint`` (non-reentrant). No wrapper module is inserted, so parameter names, and
therefore checkpoints, are the same with and without it; deepcopy keeps the checkpointing.

Compiled by the Engine (``Config(compile=True)``) each checkpointed block is one graph even when its
forward mutates Python state, as Hugging Face models' output hooks do; under your own
``torch.compile`` set ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``
for the same, or Dynamo breaks the graph at every such block (fusion/compile.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import ConfigError, check_choice, check_number

__all__ = [
    "apply_checkpointing",
    "remove_checkpointing",
    "find_block_list",
    "checkpointed_blocks",
    "selective_policy",
    "is_recomputing",
    "recompute_user_checkpoints_under_forward_modes",
    "CHECKPOINT_MODES",
    "SAVED_OPS",
]

CHECKPOINT_MODES = ("blocks", "selective")

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    # Some attention kernels exist only in some builds; keep the ones this torch has.
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


#: Op families whose outputs "selective" keeps: they cost O(n^3) or O(n^2 d) to recompute, while
#: everything else (pointwise, norms, softmax) is memory-bound and cheap to run again.
SAVED_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed block's forward is being re-run during backward.

    The profiler uses it to leave recomputation out of model FLOPs (MFU convention).
    """
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul/attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


@contextlib.contextmanager
def _function_modes(modes):
    """Re-enter the TorchFunctionModes the forward ran under (e.g. turbotrain's FP32 keep-list).

    torch.utils.checkpoint restores autocast state for the recomputation but not Python function
    modes, and the recompute runs inside backward, where the forward's modes are long gone; without
    this the recomputed ops would differ in dtype from the saved ones.
    """
    active = set(map(id, torch.overrides._get_current_function_mode_stack()))
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


def _replaying(fn, runs_forward: bool):
    """``fn``, which torch.utils.checkpoint re-runs in backward, made to recompute under the function
    modes active now (at the checkpoint call in the forward) and counted as recomputation
    (:func:`is_recomputing`). ``runs_forward``: the first call is the forward itself (reentrant)."""
    modes = tuple(torch.overrides._get_current_function_mode_stack())
    calls = 0

    @functools.wraps(fn)
    def replay(*args, **kwargs):
        nonlocal calls
        calls += 1
        if runs_forward and calls == 1:
            return fn(*args, **kwargs)
        with _recomputing(), _function_modes(modes):
            return fn(*args, **kwargs)

    return replay


_REENTRANT_CHECKPOINT = getattr(torch_checkpoint, "CheckpointFunction", None)
_NON_REENTRANT_CHECKPOINT = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)


class _ReplayingCheckpointFunction:
    """What ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` calls while it is patched."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        return _REENTRANT_CHECKPOINT.apply(_replaying(function, True), preserve_rng_state, *args)


def _replaying_generator(function, *args, **kwargs):
    """What ``checkpoint(..., use_reentrant=False)`` calls while it is patched: the forward runs the
    function itself, so the one the generator keeps is called only to recompute."""
    return _NON_REENTRANT_CHECKPOINT(_replaying(function, False), *args, **kwargs)


_patch_lock = threading.Lock()
_patch_depth = 0
_warned_unpatched = False


@contextlib.contextmanager
def recompute_user_checkpoints_under_forward_modes():
    """While the Engine's forward runs: a ``torch.utils.checkpoint`` call in the model's own code (a
    user's ``checkpoint(block, x)``, Hugging Face's ``gradient_checkpointing_enable()``) recomputes in
    backward under the function modes its forward ran under (turbotrain's FP32 keep-list, the
    attention routing), as torch itself restores autocast there.

    Without this, bf16-master recomputed a checkpointed block without the keep-list: its norms ran in
    bf16 where the forward had run them in FP32, and the non-reentrant checkpoint failed ("Recomputed
    values ... have different metadata"); the reentrant one silently took gradients through other
    ops than the forward ran. torch has no public hook for this, so the two module globals
    ``checkpoint()`` calls are swapped for wrappers while any Engine's forward runs, and put back
    after.
    """
    global _patch_depth, _warned_unpatched
    if _REENTRANT_CHECKPOINT is None or _NON_REENTRANT_CHECKPOINT is None:
        if not _warned_unpatched and torch.overrides._get_current_function_mode_stack():
            _warned_unpatched = True
            warnings.warn("this torch's torch.utils.checkpoint lacks the functions turbotrain wraps, so a "
                          "checkpoint() call in the model's own code recomputes without the FP32 keep-list; "
                          "use Config(checkpoint='blocks') instead of your own checkpoint calls", stacklevel=3)
        yield
        return
    with _patch_lock:
        if _patch_depth == 0:
            torch_checkpoint.CheckpointFunction = _ReplayingCheckpointFunction
            torch_checkpoint._checkpoint_without_reentrant_generator = _replaying_generator
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch_checkpoint.CheckpointFunction = _REENTRANT_CHECKPOINT
                torch_checkpoint._checkpoint_without_reentrant_generator = _NON_REENTRANT_CHECKPOINT


def _checkpointed_call(original_forward, mode: str, module, *args, **kwargs):
    if not torch.is_grad_enabled():
        # Nothing is saved for backward under no_grad, so checkpointing would only add overhead.
        return original_forward(module, *args, **kwargs)
    context = {"context_fn": _selective_contexts} if mode == "selective" else {}
    if torch.compiler.is_compiling():
        # Under torch.compile the region becomes one checkpoint op in the graph and AOTAutograd
        # emits its recomputation into the backward graph, with the dtypes traced in forward; the
        # replay wrapper below is a Python side effect dynamo would break the graph on.
        # kwargs are bound, not passed through: a forward keyword such as `debug` is not checkpoint's
        return checkpoint(functools.partial(original_forward, module, **kwargs), *args, use_reentrant=False,
                          **context)
    calls = 0
    forward_modes = tuple(torch.overrides._get_current_function_mode_stack())

    def run(*inner_args):
        nonlocal calls
        calls += 1
        if calls == 1:
            return original_forward(module, *inner_args, **kwargs)
        with _recomputing(), _function_modes(forward_modes):
            return original_forward(module, *inner_args, **kwargs)

    return checkpoint(run, *args, use_reentrant=False, **context)


@functools.lru_cache(maxsize=None)
def _checkpointed_class(cls: type, mode: str) -> type:
    original_forward = cls.forward

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        return _checkpointed_call(original_forward, mode, self, *args, **kwargs)

    # Same name so reprs, error messages and profiler tables read as before.
    return type(cls.__name__, (cls,), {
        "forward": forward,
        "_turbotrain_checkpoint": mode,
        "_turbotrain_original_class": cls,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    })


def _base_class(module: nn.Module) -> type:
    return getattr(type(module), "_turbotrain_original_class", type(module))


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
            and len({_base_class(c) for c in children}) == 1
            and all(any(True for _ in c.parameters()) for c in children))


def find_block_list(model: nn.Module) -> tuple[str, nn.Module]:
    """The (path, container) of the model's repeated blocks, found by structure, not by name.

    A block list is an nn.ModuleList or nn.Sequential of two or more modules of one class that hold
    parameters (HF's ``model.layers``, GPT-2's ``transformer.h``, a user's ``nn.Sequential`` of
    blocks, whatever it is called). Where there are several (an encoder and a decoder, or a block
    list nested inside a block), the one holding the most parameters wins. Raises ConfigError when
    there is none.
    """
    best = None
    for name, module in model.named_modules():
        if not _is_block_list(module):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise ConfigError(
            f"checkpointing found no block list in {type(model).__name__}: it looks for an nn.ModuleList or "
            "nn.Sequential of two or more modules of one class that hold parameters. Fix: hold the repeated "
            "layers in one (e.g. self.blocks = nn.ModuleList([...])), or set Config(checkpoint=None)"
        )
    return best[1], best[2]


def checkpointed_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """(path, mode) of every module that apply_checkpointing changed."""
    return [(n, m._turbotrain_checkpoint) for n, m in model.named_modules()
            if getattr(type(m), "_turbotrain_checkpoint", None)]


def apply_checkpointing(model: nn.Module, mode: str, every: int = 1) -> nn.Module:
    """Checkpoint every block (or every ``every``-th: blocks 0, every, 2 every, ...) of ``model`` in
    place and return it.

    mode: 'blocks' (recompute each whole block in backward) or 'selective' (keep matmul and
    attention outputs, recompute the rest). Applying again replaces the first application.

    >>> import torch
    >>> net = torch.nn.Sequential()
    >>> net.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    >>> apply_checkpointing(net, "blocks") is net
    True
    """
    check_choice("checkpoint mode", mode, CHECKPOINT_MODES)
    check_number("every", every, integer=True, minimum=1)
    _, blocks = find_block_list(model)
    for i, block in enumerate(blocks):
        base = getattr(type(block), "_turbotrain_original_class", type(block))
        block.__class__ = _checkpointed_class(base, mode) if i % every == 0 else base
    return model


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo apply_checkpointing on every module of ``model`` (in place)."""
    for module in model.modules():
        original = getattr(type(module), "_turbotrain_original_class", None)
        if original is not None:
            module.__class__ = original
    return model
