"""Context parallel over the mesh's "cp" dimension: the sequence split, attention by all-to-all over heads.

Each rank of a cp group holds T/cp consecutive tokens of every sequence for the whole model; norms,
MLPs, embeddings and the loss need nothing from the other ranks. Attention does, and there the split
is swapped from the sequence to the heads (the DeepSpeed-Ulysses scheme):

    q, k, v   (B, H, T/cp, D)  --all-to-all-->  (B, H/cp, T, D)   each head sees the whole sequence
    output    (B, H/cp, T, D)  --all-to-all-->  (B, H, T/cp, D)

so torch's own ``scaled_dot_product_attention`` runs unchanged, causal masking included. Per
attention and rank that is three exchanges of (cp-1)/cp of a (B, H, T/cp, D) tensor forward (k and v
with their own head count under GQA) and one back, and the same again in backward.

:class:`ContextParallelMode` intercepts the ``F.scaled_dot_product_attention`` calls of any model
(turbotrain's gpt and llama, Hugging Face's sdpa attention) the way
:class:`turbotrain.fusion.attention.PlainAttentionMode` does; :func:`split_batch` gives each rank
its slice of every (B, T) tensor of a batch and the ``position_ids`` of that slice.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..batch import IGNORE_INDEX, accepts_keyword
from ..errors import ConfigError

# The stock op as imported, held the way fusion.attention holds it (importing it from there would
# close a cycle: turbotrain.config imports this package, and fusion imports turbotrain.config).
_SDPA = torch.nn.functional.scaled_dot_product_attention

__all__ = ["ContextParallelMode", "context_parallel_runner", "split_batch", "sequence_to_heads", "heads_to_sequence",
           "check_cp_model"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_DROPPED_MASK = [False]


def _all_to_all(x: Tensor, group) -> Tensor:
    """Chunk i of dim 0 goes to rank i; the result's chunk i came from rank i (autograd-aware)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    # Eagerly an AsyncCollectiveTensor, waited on by the first op that reads it; a plain tensor under compile.
    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def sequence_to_heads(x: Tensor, group, cp: int) -> Tensor:
    """(B, H, T/cp, D) on each rank -> (B, H/cp, T, D): this rank's heads over the whole sequence."""
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1)  # chunk i: the heads rank i computes
    got = _all_to_all(send, group)  # (cp, B, H/cp, T/cp, D): chunk i is sequence slice i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def heads_to_sequence(y: Tensor, group, cp: int) -> Tensor:
    """(B, H/cp, T, D) -> (B, H, T/cp, D): every head again, over this rank's slice of the sequence."""
    b, h, t, d = y.shape
    send = y.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # chunk i: sequence slice i
    got = _all_to_all(send, group)  # (cp, B, H/cp, T/cp, D): chunk i is rank i's heads
    return got.transpose(0, 1).reshape(b, cp * h, t // cp, d)


def _refusal(query, key, value, attn_mask, cp: int) -> Optional[str]:
    """Why this attention call cannot run split over the sequence, or None."""
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested tensors"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"q/k/v of shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}, not (B, H, T, D)"
    if attn_mask is not None:
        return (f"an explicit attn_mask of shape {tuple(attn_mask.shape)} (it covers this rank's T/cp tokens, "
                "not the whole sequence); feed batches without padding and without an attention mask")
    if key.shape[-2] != query.shape[-2]:
        return (f"keys of length {key.shape[-2]} for queries of length {query.shape[-2]} (a KV cache or cross "
                "attention); context parallel splits self-attention over one sequence")
    heads = {"query": query.shape[1], "key/value": key.shape[1]}
    bad = {n: h for n, h in heads.items() if h % cp}
    if bad:
        listed = ", ".join(f"{h} {n} heads" for n, h in bad.items())
        return f"cp={cp} does not divide the {listed}; choose a cp that divides every head count"
    return None


class ContextParallelMode(TorchFunctionMode):
    """While entered, ``F.scaled_dot_product_attention`` runs over the whole sequence of a cp group.

    ``group``: the cp ranks (a ProcessGroup or 1-D DeviceMesh) holding consecutive slices of each
    sequence, in rank order. A call it cannot split correctly (an explicit mask, heads cp does not
    divide, keys of another length) is a ConfigError naming why: the stock op on this rank's slice
    alone would be silently wrong. ``calls`` counts the calls split outside torch.compile.
    """

    def __init__(self, group, cp: int):
        super().__init__()
        self.group = group
        self.cp = cp
        self.calls = 0
        self._sdpa = _SDPA  # the stock op, called for this rank's slice and never dispatched again

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not self._sdpa:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        reason = _refusal(query, key, value, attn_mask, self.cp)
        if reason is not None:
            raise ConfigError(f"context parallel (cp={self.cp}) cannot run this scaled_dot_product_attention: "
                              f"{reason}")
        if not torch.compiler.is_compiling():
            self.calls += 1
        q, k, v = (sequence_to_heads(t, self.group, self.cp) for t in (query, key, value))
        # The mode is off inside its own handler, so this is the stock op (or the next mode down).
        out = self._sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return heads_to_sequence(out, self.group, self.cp)


# -- the batch ---------------------------------------------------------------------------------
def _sequence_shape(args, kwargs) -> tuple[int, int]:
    """(B, T) of the batch's token input: input_ids / inputs_embeds, else the first positional tensor."""
    first = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if isinstance(kwargs.get(k), Tensor)), None)
    if first is None:
        first = next((a for a in args if isinstance(a, Tensor)), None)
    if first is None or first.dim() < 2:
        what = "no tensor input" if first is None else f"an input of shape {tuple(first.shape)}"
        raise ConfigError(f"context parallel splits (B, T) token inputs along T, but the batch has {what}; pass "
                          "input_ids (or the tuple contract's inputs) of shape (B, T)")
    return first.shape[0], first.shape[1]


def _drop_full_mask(kwargs: dict) -> None:
    mask = kwargs.get("attention_mask")
    if mask is None:
        kwargs.pop("attention_mask", None)
        return
    if not bool(mask.bool().all()):
        raise ConfigError(
            "the batch has an attention_mask with padded (0) positions, and context parallel cannot apply a "
            "mask over the whole sequence yet; pack the sequences to one length without padding, or train "
            "with cp=1")
    del kwargs["attention_mask"]  # all ones: the same attention as none, which the split supports
    if not _DROPPED_MASK[0]:
        _DROPPED_MASK[0] = True
        logger.info("context parallel: the batch's attention_mask is all ones, so it is left out (no padding)")


def split_batch(args: tuple, kwargs: dict, targets, rank: int, cp: int, shift_labels: bool = False):
    """This cp rank's (args, kwargs, targets): its T/cp slice of every (B, T, ...) tensor, with position_ids.

    ``shift_labels``: the model shifts ``labels`` itself (Hugging Face causal LMs), which inside one
    slice would drop each slice's last target; the whole batch's shifted labels are sliced and passed
    as ``shift_labels=`` (read by transformers' ForCausalLMLoss) so every position keeps its target,
    and ``num_items_in_batch`` becomes the whole batch's scored targets / cp (a user's count / cp), so
    each rank's loss is its sum over that and the cp ranks' average is the batch's mean, however the
    ignored labels fall between the slices.

    >>> ids = torch.arange(8).view(1, 8)
    >>> args, kwargs, _ = split_batch((), {"input_ids": ids, "labels": ids}, None, rank=1, cp=2, shift_labels=True)
    >>> kwargs["input_ids"].tolist(), kwargs["position_ids"].tolist(), kwargs["shift_labels"].tolist()
    ([[4, 5, 6, 7]], [[4, 5, 6, 7]], [[5, 6, 7, -100]])
    >>> float(kwargs["num_items_in_batch"])  # 7 targets in the whole row, over 2 ranks
    3.5
    """
    kwargs = dict(kwargs)
    batch, length = _sequence_shape(args, kwargs)
    if length % cp:
        raise ConfigError(f"context parallel (cp={cp}) gives each rank T/cp tokens, but the batch's sequence length "
                          f"T={length} is not a multiple of {cp}; make T a multiple of cp (e.g. "
                          f"{length - length % cp or cp} or {length + cp - length % cp})")
    _drop_full_mask(kwargs)
    if shift_labels and isinstance(kwargs.get("labels"), Tensor):
        if "shift_labels" not in kwargs:
            labels = kwargs["labels"]
            kwargs["shift_labels"] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        count = kwargs.get("num_items_in_batch")
        if count is None:
            count = (kwargs["shift_labels"] != IGNORE_INDEX).sum()
        kwargs["num_items_in_batch"] = count / cp
    if "position_ids" not in kwargs or kwargs["position_ids"] is None:
        kwargs["position_ids"] = torch.arange(length, device=_device(args, kwargs)).unsqueeze(0)
    lo, hi = rank * (length // cp), (rank + 1) * (length // cp)

    def cut(value):
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length \
                and value.shape[0] in (batch, 1):
            return value[:, lo:hi].contiguous()  # a user's loss may .view() it (transformers' does)
        return value

    args = tuple(cut(a) for a in args)
    kwargs = {k: cut(v) for k, v in kwargs.items()}
    targets = tuple(cut(t) for t in targets) if isinstance(targets, tuple) else cut(targets)
    return args, kwargs, targets


def _device(args, kwargs) -> torch.device:
    return next(t.device for t in (*args, *kwargs.values()) if isinstance(t, Tensor))


def check_cp_model(model, cp: int) -> None:
    """ConfigError naming the fix when ``model`` cannot train split over the sequence (cp > 1)."""
    from ..memory import checkpointed_blocks

    if not accepts_keyword(model, "position_ids"):
        raise ConfigError(
            f"context parallel (cp={cp}) gives each rank a slice of every sequence, so the model must be told "
            f"where its slice starts, but {type(model).__name__}.forward takes no position_ids (every rank "
            "would number its tokens from 0); add a position_ids=None argument to its forward")
    if checkpointed_blocks(model):
        raise ConfigError(
            f"activation checkpointing with context parallel (cp={cp}) is not supported yet: the recomputation "
            "in backward would run attention on this rank's slice alone; drop checkpoint= or set cp=1")


def _shifts_labels_itself(model) -> bool:
    """A Hugging Face causal LM: its loss shifts ``labels`` by one inside the forward."""
    from ..batch import is_causal_model

    return is_causal_model(model) and callable(getattr(model, "loss_function", None))


def context_parallel_runner(runner, model, mesh):
    """Wrap the Engine's ``runner(args, kwargs, targets, kind)``: this cp rank's slice, attention split over heads.

    ``mesh``: the 1-D "cp" DeviceMesh. Each rank's loss is the mean over its own tokens; FSDP's average
    over the cp ranks makes it the sequence's mean when every slice holds as many scored targets.
    """
    cp, rank = mesh.size(), mesh.get_local_rank()
    shift = _shifts_labels_itself(model)
    mode = ContextParallelMode(mesh.get_group(), cp)

    def run(args, kwargs, targets, kind):
        args, kwargs, targets = split_batch(args, kwargs, targets, rank, cp, shift_labels=shift)
        with mode:
            return runner(args, kwargs, targets, kind)

    run.mode = mode
    return run
