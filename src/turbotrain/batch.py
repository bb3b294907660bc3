"""The batch and loss contract: what ``Engine.step(batch)`` accepts and how the loss is found.

A batch is one of:

- ``(inputs, targets)``: the model is called as ``model(inputs)``, the loss is
  ``loss_fn(output, targets)``; without a loss_fn, ``model(inputs, targets)`` and the model's own
  loss (nanoGPT's ``forward(idx, targets)``);
- a mapping (a Hugging Face batch): the model is called as ``model(**batch)`` with every key passed
  through (a key ``forward`` does not take is a ConfigError naming it); the loss is
  ``loss_fn(output, batch)``, or without a loss_fn the model's own;
- a single tensor: ``model(batch)``, and the loss is ``loss_fn(output)`` or the model's own.

The model's own loss is ``output.loss`` (Hugging Face), ``output["loss"]`` of a dict, a 0-d tensor
output, or the first 0-d floating tensor of a tuple output. Whatever the source, a loss must be a
0-d floating tensor that requires grad; anything else is a ConfigError naming what came back.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from .errors import ConfigError

__all__ = ["Batch", "ContractCall", "LossContract", "as_batch", "model_loss", "check_loss", "check_batch_keys",
           "pad_to_bucket", "bucket_length", "is_causal_model", "accepts_keyword", "IGNORE_INDEX"]

#: Label value every cross-entropy in turbotrain (and Hugging Face) ignores.
IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch as the Engine runs it: the call's arguments and what the loss compares to."""

    args: tuple
    kwargs: dict
    targets: object = None
    """The tuple contract's targets; None for mappings and single tensors."""
    kind: str = "tuple"
    """'tuple', 'mapping' or 'tensor'."""
    size: Optional[int] = None
    """Rows in the batch (first dimension of the first tensor), for the alignment advice."""
    extra: dict = field(default_factory=dict)

    def loss_input(self):
        """What a user loss_fn receives beside the output: targets, the mapping, or nothing."""
        if self.kind == "mapping":
            return self.kwargs
        return self.targets


def _to_device(value, device):
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


def _check_not_empty(value) -> Optional[int]:
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ConfigError("the batch holds no tensor; pass (inputs, targets), a dict of tensors or a tensor")
    for t in tensors:
        if t.numel() == 0:
            raise ConfigError(f"the batch holds an empty tensor of shape {tuple(t.shape)}; an empty batch "
                              "cannot be trained on (it would make a NaN step); skip it before engine.step")
    first = tensors[0]
    return first.shape[0] if first.dim() else None


def as_batch(batch, device: torch.device, has_loss_fn: bool) -> Batch:
    """Move ``batch`` to ``device`` and say how the model is called on it."""
    if isinstance(batch, Mapping):
        if not batch:
            raise ConfigError("the batch is an empty mapping; a dict batch holds the model's keyword "
                              "arguments, e.g. {'input_ids': ..., 'labels': ...}")
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"a dict batch is passed as model(**batch), so its keys must be strings; got {bad!r}")
        kwargs = _to_device(dict(batch), device)
        return Batch((), kwargs, kind="mapping", size=_check_not_empty(kwargs))
    if isinstance(batch, torch.Tensor):
        t = _to_device(batch, device)
        return Batch((t,), {}, kind="tensor", size=_check_not_empty(t))
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = _to_device(tuple(batch), device)
        size = _check_not_empty((inputs, targets))
        if has_loss_fn:
            return Batch((inputs,), {}, targets, kind="tuple", size=size)
        return Batch((inputs, targets), {}, targets, kind="tuple", size=size)
    hint = ""
    if isinstance(batch, (tuple, list)) and len(batch) > 2:
        hint = ("; for more than one input (ids and a mask, say) pass a dict whose keys are forward's "
                "arguments (called as model(**batch); a loss_fn gets the dict as its second argument), or "
                "((x, mask), y), which calls model((x, mask)) and loss_fn(output, y)")
    raise ConfigError(
        f"a batch must be (inputs, targets), a dict of model keyword arguments or a tensor; got "
        f"{type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "") + hint
    )


def model_loss(output) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss``, a dict's ``"loss"``, a 0-d tensor, or a tuple's
    0-d tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output
    elif isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point():
                return item
    what = _describe(output)
    has_field = hasattr(output, "loss") or (isinstance(output, Mapping) and "loss" in output)
    hint = ("it has a 'loss' field that is None: put 'labels' in the batch" if has_field
            else "return the loss from forward, or pass loss_fn=")
    raise ConfigError(f"no loss_fn was given, so the loss must be the model's own, but the model returned "
                      f"{what} with no 0-d loss tensor; {hint}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def check_loss(loss, source: str) -> torch.Tensor:
    """A loss must be a 0-d floating tensor with a gradient path; say what it is otherwise."""
    if not isinstance(loss, torch.Tensor):
        hint = ""
        if isinstance(loss, (tuple, list)) and loss and isinstance(loss[0], torch.Tensor) and loss[0].dim() == 0:
            hint = (f" (a {type(loss).__name__} of {len(loss)} starting with a 0-d tensor: return the loss alone; "
                    "the step takes one loss, so compute metrics apart from it)")
        raise ConfigError(f"{source} returned {_describe(loss)}, not a tensor; the loss must be a 0-d "
                          f"floating torch.Tensor{hint}")
    if loss.dim() != 0 or not loss.is_floating_point():
        hint = " (a per-element loss: use reduction='mean' or call .mean())" if loss.dim() else ""
        raise ConfigError(f"{source} returned {_describe(loss)}; the loss must be a 0-d floating tensor{hint}")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigError(f"{source} returned a loss that does not require grad (detached, or computed "
                          "without the model's parameters); backward would change nothing")
    return loss


class LossContract:
    """How a batch becomes a loss: call the model, then the user's loss_fn or the model's own loss."""

    def __init__(self, loss_fn: Optional[Callable]):
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable or None (the model's own loss), got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    @property
    def source(self) -> str:
        return "loss_fn" if self.loss_fn is not None else "the model's own loss"

    def loss(self, output, batch: Batch) -> torch.Tensor:
        if self.loss_fn is None:
            return model_loss(output)
        loss = self.loss_fn(output) if batch.kind == "tensor" else self.loss_fn(output, batch.loss_input())
        if not isinstance(loss, torch.Tensor):  # said here, before anything reads it as a tensor
            check_loss(loss, "loss_fn")
        return loss

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        return self.loss(model(*batch.args, **batch.kwargs), batch)


# -- padding to sequence buckets -------------------------------------------------------------

#: What each conventional key is padded with; other keys of sequence length get 0.
_PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


def _forward_parameters(model: nn.Module):
    """``model.forward``'s parameters, or None where Python cannot tell them."""
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None


def _takes(params, name: str) -> bool:
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def accepts_keyword(model: nn.Module, name: str) -> bool:
    """True when ``model.forward`` takes a keyword argument ``name`` (or **kwargs)."""
    params = _forward_parameters(model)
    return params is not None and _takes(params, name)


def check_batch_keys(model: nn.Module, batch: Batch) -> None:
    """A dict batch is passed as ``model(**batch)``: a key that ``model.forward`` does not take (and no
    ``**kwargs`` to take it) is named here, with the fix, instead of the model's own TypeError."""
    if batch.kind != "mapping":
        return
    params = _forward_parameters(model)
    unknown = [k for k in batch.kwargs if not _takes(params, k)] if params is not None else []
    if unknown:
        raise ConfigError(f"the batch's key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                          f"{'are' if len(unknown) > 1 else 'is'} not an argument of "
                          f"{type(model).__name__}.forward({', '.join(params)}); a dict batch is passed as "
                          "model(**batch): drop such keys from the batch (or have forward take them)")


def is_causal_model(model: nn.Module) -> bool:
    """A model whose position t never reads positions > t, so right padding cannot change its loss.

    Declared by the model (``is_causal = True``), or a Hugging Face decoder (``config.is_decoder``
    or a ``...ForCausalLM`` class).
    """
    declared = getattr(model, "is_causal", None)
    if isinstance(declared, bool):
        return declared
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_decoder", False):
        return True
    return type(model).__name__.endswith("ForCausalLM")


def bucket_length(length: int, buckets) -> int:
    """The smallest bucket >= ``length``.

    >>> bucket_length(100, (64, 128, 256))
    128
    """
    fitting = [b for b in sorted(buckets) if b >= length]
    if not fitting:
        raise ConfigError(f"sequence length {length} is longer than every seq_bucket {tuple(buckets)}; "
                          f"add a bucket >= {length} to Config(seq_buckets=...)")
    return fitting[0]


def _pad_seq(t: torch.Tensor, extra: int, value) -> torch.Tensor:
    spec = [0, 0] * (t.dim() - 2) + [0, extra]  # F.pad lists the last dimension first
    return F.pad(t, spec, value=value)


def pad_to_bucket(batch: Batch, buckets, model: nn.Module, pad_id: int = 0) -> Batch:
    """Pad every sequence-length tensor of ``batch`` on the right up to the smallest fitting bucket.

    The padded positions are masked so the loss over the real tokens is unchanged: labels get
    IGNORE_INDEX, and the attention mask is passed (extended with zeros, or created). A model that
    takes no mask is padded only if it is causal; otherwise this is refused with a ConfigError.
    """
    first = batch.args[0] if batch.args else batch.kwargs.get("input_ids")
    if first is None:
        first = next(v for v in batch.kwargs.values() if isinstance(v, torch.Tensor))
    if first.dim() < 2:
        return batch
    length = first.shape[1]
    size = bucket_length(length, buckets)
    if size == length:
        return batch
    extra = size - length
    causal = is_causal_model(model)
    takes_mask = accepts_keyword(model, "attention_mask")
    if batch.kind == "mapping":
        kwargs = dict(batch.kwargs)
        if "attention_mask" not in kwargs:
            if not takes_mask and not causal:
                raise _refuse(model, length, size)
            if takes_mask:
                kwargs["attention_mask"] = torch.ones(first.shape[:2], dtype=torch.long, device=first.device)
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
                kwargs[key] = _pad_seq(value, extra, _PAD_VALUES.get(key, pad_id if key == "input_ids" else 0))
        return Batch((), kwargs, kind="mapping", size=batch.size)
    if not causal and not takes_mask:
        raise _refuse(model, length, size)
    args = tuple(_pad_seq(a, extra, pad_id) if i == 0 else a for i, a in enumerate(batch.args))
    targets = batch.targets
    if isinstance(targets, torch.Tensor) and targets.dim() >= 2 and targets.shape[1] == length:
        targets = _pad_seq(targets, extra, IGNORE_INDEX)
        if len(args) == 2:  # no loss_fn: the targets are the model's second argument
            args = (args[0], targets)
    kwargs = dict(batch.kwargs)
    if not causal:
        mask = torch.ones(first.shape[:2], dtype=torch.long, device=first.device)
        kwargs["attention_mask"] = _pad_seq(mask, extra, 0)
    return Batch(args, kwargs, targets, kind=batch.kind, size=batch.size)


def _refuse(model: nn.Module, length: int, size: int) -> ConfigError:
    return ConfigError(
        f"seq_buckets would pad this batch from length {length} to {size}, but "
        f"{type(model).__name__}.forward takes no attention_mask and the model is not causal, so the "
        "padding would change its loss. Fix: give forward an attention_mask argument, set "
        "model.is_causal = True if it is causal, or drop seq_buckets"
    )


class ContractCall(nn.Module):
    """The model called the way the batch contract calls it: ``forward((args, kwargs))``.

    What the NaN finder needs, whose replays call ``module(inputs)`` with one argument.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, call):
        args, kwargs = call
        return self.inner(*args, **kwargs)
