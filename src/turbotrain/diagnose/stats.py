"""Small helpers shared by the NaN finder and the precision audit: tensor trees and value stats."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import ConfigError, check_choice
from ..precision.config import PRECISIONS

__all__ = ["TensorStats", "floating_tensors", "all_finite", "split_batch", "PrecisionRun",
           "precision_run"]

#: Largest finite float16 value; anything past it rounds to inf.
FP16_MAX = 65504.0


def floating_tensors(tree) -> list[torch.Tensor]:
    """Every floating-point tensor in a nest of tuples/lists/dicts, in order."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def all_finite(tree) -> bool:
    """True when no floating tensor in ``tree`` holds inf or NaN (one host sync per tensor)."""
    return all(bool(torch.isfinite(t).all()) for t in floating_tensors(tree) if t.numel())


def map_floating(tree, fn):
    """``tree`` with ``fn`` applied to each floating tensor (other leaves kept)."""
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def split_batch(batch):
    """(inputs, targets) from a batch that is a pair, or (batch, None)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


@dataclass(frozen=True)
class TensorStats:
    """Value summary of the floating tensors of one input/output/gradient set."""

    dtype: str
    numel: int
    max_abs: float
    """Largest magnitude among the finite values (0 when none is finite)."""
    min_value: float
    frac_nonfinite: float
    frac_zero: float
    frac_negative: float

    @classmethod
    def of(cls, tree) -> "TensorStats | None":
        tensors = [t.detach() for t in floating_tensors(tree) if t.numel()]
        if not tensors:
            return None
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        finite = torch.isfinite(flat)
        kept = flat[finite]
        n = flat.numel()
        return cls(
            dtype="/".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})),
            numel=n,
            max_abs=float(kept.abs().max()) if kept.numel() else 0.0,
            min_value=float(kept.min()) if kept.numel() else float("nan"),
            frac_nonfinite=1.0 - float(finite.float().mean()),
            frac_zero=float((flat == 0).float().mean()),
            frac_negative=float((kept < 0).float().sum()) / n,
        )

    def __str__(self) -> str:
        return (f"{self.dtype} n={self.numel} max|x|={self.max_abs:.4g} min={self.min_value:.4g} "
                f"nonfinite={self.frac_nonfinite:.2%} zeros={self.frac_zero:.2%}")


@dataclass
class PrecisionRun:
    """A model prepared to run under one precision: the model, its forward context, input cast."""

    model: nn.Module
    autocast: object
    """Callable returning a context manager for the forward pass."""
    dtype: torch.dtype
    cast_inputs: bool

    def inputs(self, tree):
        return map_floating(tree, lambda t: t.to(self.dtype)) if self.cast_inputs else tree


def precision_run(model: nn.Module, precision: str, *, copy_model: bool = True) -> PrecisionRun:
    """How turbotrain runs ``model`` under ``precision`` (see Config.precision).

    '-mixed' keeps the FP32 model and runs forward under autocast; '-master' runs a low-precision
    copy of the model (the FP32 master weights live in the optimizer, which does not matter here).
    """
    check_choice("precision", precision, PRECISIONS)
    if precision == "auto":
        raise ConfigError("precision='auto' must be resolved first: pass the precision the Engine printed, "
                          "e.g. 'bf16-mixed'")
    if precision == "fp32":
        return PrecisionRun(model, contextlib.nullcontext, torch.float32, False)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    if precision.endswith("-mixed"):
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        return PrecisionRun(model, lambda: torch.autocast(device_type, dtype=dtype), dtype, False)
    low = copy.deepcopy(model) if copy_model else model
    return PrecisionRun(low.to(dtype), contextlib.nullcontext, dtype, True)
