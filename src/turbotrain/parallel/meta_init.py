"""Build on the meta device, shard, then allocate and initialise only each rank's shards.

A model built under ``torch.device("meta")`` has shapes and no storage. The Engine hands it to
FSDP2 as it is; ``fully_shard`` cuts the meta parameters into meta shards, and only then is memory
allocated: each rank's shards, plus one whole parameter at a time while it is initialised.

The values are exactly those of an eager build on the CPU from the same seed, in two passes:

    record_init(model, init_weights)    at Engine(...): ``init_weights(model)`` (by default
                                        ``reset_parameters``: every module's own, as torch's modules
                                        run it in their ``__init__``) runs with a stand-in in place of
                                        each meta parameter and buffer, which writes down the in-place
                                        ops that reach it and the random generator's state before
                                        each draw. Every draw is also made once on a scratch tensor of
                                        the same shape, so the global generator advances as the eager
                                        build would have advanced it.
    InitTape.materialise(model, device) after fully_shard: for each parameter and buffer in turn, a
                                        whole-size CPU scratch tensor, its ops replayed (each draw from a
                                        private generator set to the state recorded), this rank's shard
                                        of it copied into the DTensor's local tensor, the scratch freed.

``init_weights`` stands for everything the eager build ran to initialise, in the order it ran it:
for turbotrain's gpt, ``reset_parameters`` then ``GPT._init_weights``; for a Hugging Face model,
``hf_init_weights`` (each sub-model's resets, then its ``post_init`` init, innermost first).

Draws depend only on the generator's state and the tensor's shape, dtype and layout, which both
passes share, so each parameter's ops replay alone, in any order, without the rest of the model:
peak memory is the sharded model plus the largest single parameter (and 5 KB of generator state
per parameter's last draw until it is replayed).

The stand-ins say they are CPU tensors, so torch.nn.init's shortcuts for meta tensors do not skip
them (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_`` return at once on a meta tensor).
What an init may do: in-place ops on a parameter, a buffer or any view of one (``nn.init.*``,
``weight[pad_idx].zero_()``, ``mul_``); ``copy_`` from a real tensor (a RoPE table, orthogonal_'s
QR; held until the shards are made, so whole weights computed on the CPU cost their memory);
assigning a real tensor to a buffer. What it may not, each a MetaInitError naming the op and the
tensor: write one model tensor from another (``bias.copy_(weight[0])``), draw into a tensor computed
from the model's, or read values back (``if w.sum() > 0``); and leave a parameter or buffer unwritten.
``trunc_normal_``'s rejection sampling reads values back, so its helper is recorded as one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import MetaInitError
from .meta_record import (
    Recorder, Stand, Target, covers, prune, stand_down, stand_in, storage_key, whole_calls_recorded,
)

__all__ = ["InitTape", "record_init", "reset_parameters", "hf_init_weights", "check_meta_config", "has_meta_tensors",
           "local_piece"]

InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


def check_meta_config(config) -> None:
    """Refuse the Configs that cannot materialise a meta model (a turbotrain Config), before any collective."""
    build = "build the model on a device (no torch.device('meta')) "
    if config.parallel is None:
        raise MetaInitError(
            "the model's parameters are on the meta device (no storage), and nothing would allocate them: only "
            "sharding materialises a meta model, each rank allocating its own shards. Pass "
            "Config(parallel=ParallelConfig(dp_shard=-1)) with init_weights=..., or " + build.strip())
    p = config.parallel
    for name, degree in (("tp", p.tp), ("cp", p.cp)):
        if degree > 1:
            kind = "tensor" if name == "tp" else "context"
            raise MetaInitError(f"a model built on the meta device with {kind} parallel ({name}={degree}) is not "
                                f"supported yet (FSDP2 alone is: ParallelConfig(dp_shard=...)); set {name}=1, or "
                                + build + f"to use {name}")
    if config.fuse:
        raise MetaInitError("Config(fuse=...) with a model built on the meta device is not supported: fusion verifies "
                            "every site on the real weights before sharding. Drop fuse, or " + build + "to fuse")
    if config.keep_fp32_head:
        raise MetaInitError("keep_fp32_head=True with a model built on the meta device is not supported: the head is "
                            "found by running the model on the first batch, before its weights exist. Drop "
                            "keep_fp32_head, or " + build + "to keep the head FP32")


@dataclass
class InitTape:
    """What record_init wrote down: per meta parameter and buffer, the ops that initialise it."""

    targets: list[Target]

    def nbytes(self) -> int:
        """The whole model's meta parameters and buffers, in bytes (what an eager build allocates)."""
        return sum(t.nbytes() for t in self.targets)

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Allocate ``model``'s meta tensors on ``device`` (a sharded parameter: this rank's shard only) and
        write their recorded values (see the module docstring)."""
        model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)  # to_empty, meta only
        with torch.no_grad():
            for target in self.targets:
                live = model.get_parameter(target.name) if target.kind == "parameter" else model.get_buffer(target.name)
                full = target.replay()
                local = live.to_local() if hasattr(live, "to_local") else live
                local.copy_(local_piece(full, live))
                del full  # before the next one is made: one whole parameter at a time
        self.targets = []  # the constants and generator states are no longer needed


def local_piece(full: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` as ``tensor`` (a DTensor, or a plain tensor: all of it) holds it.

    A Shard(d) placement over n ranks is torch.chunk(n, d), the last chunks possibly empty, as FSDP2
    and DTensor cut it; a Replicate one keeps it whole. No communication.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return full
    piece, mesh = full, tensor.device_mesh
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise MetaInitError(f"a meta-built parameter placed {placement} is not supported (only Shard and "
                                "Replicate, as FSDP2 and HSDP place them); build the model on a device for this layout")
        chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
        index = mesh.get_local_rank(mesh_dim)
        piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    if piece.shape != tensor.to_local().shape:
        raise MetaInitError(f"this rank's piece of a {tuple(full.shape)} parameter is {tuple(piece.shape)}, but its "
                            f"shard is {tuple(tensor.to_local().shape)}; the placements {tensor.placements} are cut "
                            "another way than torch.chunk")
    return piece


def record_init(model: nn.Module, init_weights: Optional[InitFn] = None) -> InitTape:
    """Record how to initialise every meta parameter and buffer of ``model`` (see the module docstring).

    Draws from torch's global CPU generator as an eager build at this point would, and leaves it where
    that build would have. MetaInitError when a parameter or buffer is not written whole, naming it.

    >>> with torch.device("meta"):
    ...     net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    >>> tape = record_init(net)
    >>> [t.name for t in tape.targets]
    ['0.weight', '0.bias', '1.weight', '1.bias']
    """
    if init_weights is not None and not callable(init_weights):
        raise MetaInitError(f"init_weights must be a callable taking the model, got {type(init_weights).__name__}")
    targets = _targets(model)
    recorder = Recorder(targets)
    originals = stand_in(model, recorder)
    try:
        with torch.no_grad(), whole_calls_recorded():
            (init_weights or reset_parameters)(model)
    except Exception as exc:
        if recorder.refusal is not None:  # the user's code may have wrapped our error in its own
            raise recorder.refusal from exc
        raise
    finally:
        replaced = stand_down(model, originals)
    if recorder.refusal is not None:  # raised inside the init, which caught it and went on
        raise recorder.refusal
    _check_replacements(replaced, targets)
    _check_all_written(list(targets.values()), init_weights)
    for target in targets.values():
        prune(target)
    return InitTape(list(targets.values()))


def reset_parameters(model: nn.Module) -> None:
    """torch's own initialisation: every module's ``reset_parameters()``, as torch's modules run it in their
    ``__init__``, each module after its children (the order a model's ``__init__`` builds them in).

    The default ``init_weights``; a function standing for a whole eager build starts with it.
    """
    for module in _children_first(model):
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def hf_init_weights(model: nn.Module) -> None:
    """A Hugging Face model's own initialisation, in the order its eager build runs it.

    Each ``PreTrainedModel`` inside (``LlamaForCausalLM.model``), the innermost first, resets its modules
    (their ``__init__``) and then runs the ``init_weights()`` of its ``post_init``, which marks what it
    initialised so that the outer models skip it; an outer model's own modules (``lm_head``) come after.
    A Hugging Face model built under ``torch.device("meta")`` skips that ``init_weights()``. The marks are
    taken off again afterwards, so a second call initialises again.
    """
    marked = {m for m in model.modules() if getattr(m, "_is_hf_initialized", False)}
    done: set = set()
    try:
        for sub in _children_first(model):
            if not (callable(getattr(sub, "post_init", None)) and callable(getattr(sub, "init_weights", None))):
                continue
            for module in _children_first(sub):
                reset = getattr(module, "reset_parameters", None)
                if module not in done and callable(reset):
                    reset()
                done.add(module)
            sub.init_weights()
    finally:
        for module in model.modules():
            if module not in marked and getattr(module, "_is_hf_initialized", False):
                module._is_hf_initialized = False


def _targets(model: nn.Module) -> dict[int, Target]:
    real = [(n, p.device) for n, p in model.named_parameters() if not p.is_meta]
    if real:
        name, device = real[0]
        raise MetaInitError(f"the model has parameters on the meta device and {len(real)} on {device} ({name} the "
                            "first); build all of it under torch.device('meta') (FSDP2 shards them together), or "
                            "none of it")
    out: dict[int, Target] = {}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            key = storage_key(t)
            if t.is_meta and key not in out:
                out[key] = Target(key, name, kind, t.size(), tuple(t.stride()), t.storage_offset(), t.dtype)
    return out


def _children_first(model: nn.Module) -> list[nn.Module]:
    """model.apply's order: each module after its children, siblings in registration order. That is the
    order torch modules reset themselves in while a model is built (a parent's __init__ builds its
    children, then resets its own parameters)."""
    out: list[nn.Module] = []
    model.apply(out.append)
    return out


def _check_replacements(replaced: dict[tuple, torch.Tensor], targets: dict[int, Target]) -> None:
    """A buffer the init replaced by a real tensor is initialised (it is kept); a parameter is refused."""
    for key, target in list(targets.items()):
        tensor = replaced.get((target.kind, target.name))
        if tensor is None:
            continue
        if isinstance(tensor, Stand):
            raise MetaInitError(f"init_weights put a tensor computed from the model into {target.kind} {target.name}; "
                                "write it in place instead, from itself, constants or real tensors")
        if target.kind == "parameter":
            raise MetaInitError(f"init_weights replaced the meta parameter {target.name} by a real tensor; write it in "
                                "place instead (torch.nn.init.*, or .copy_(values) under torch.no_grad()), so only "
                                "this rank's shard of it is ever allocated")
        del targets[key]


def _check_all_written(targets: list[Target], init_weights) -> None:
    missing = [t for t in targets if not covers(t)]
    if not missing:
        return
    listed = ", ".join(f"{t.kind} {t.name} {tuple(t.size)}" for t in missing[:6])
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    given = ("init_weights did not write them whole" if init_weights is not None else
             "no init_weights was given, and no module's reset_parameters() wrote them whole")
    raise MetaInitError(
        f"{len(missing)} tensor(s) of the meta model would stay uninitialised: {listed}{more}. Values set in a "
        f"module's __init__ (torch.ones, a RoPE table, a causal mask) are lost on the meta device, and {given}. "
        "Pass Engine(..., init_weights=fn) where fn(model) also writes them in place "
        "(torch.nn.init.ones_(norm.weight), buffer.copy_(table)) or assigns a real tensor to a buffer; start fn "
        "with turbotrain.parallel.reset_parameters(model) to keep torch's defaults for the rest "
        "(docs/parallel.md, 'Building on the meta device')")
