"""nn.Module wrappers of the fused ops, each built from the stock module(s) it replaces.

Every wrapper saves and loads in the stock layout (habit 8 of STYLE.md): a checkpoint of a fused
model loads into the original model and back. Wrappers that keep the original parameters
(linear+act, layernorm+act, the CE head) get that for free; the ones that concatenate weights
(QKV, SwiGLU gate/up) override ``_save_to_state_dict``/``_load_from_state_dict`` to split and join.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import FusionError
from .ops.layernorm_gelu import layernorm_act
from .ops.linear_act import linear_act
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.qkv import qkv_projection
from .ops.swiglu import swiglu

__all__ = [
    "FusedLinearAct", "FusedLayerNormAct", "FusedQKVProjection", "QKVSlice", "FusedSwiGLUMLP",
    "LinearCrossEntropyHead", "FusedLogits",
]


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force, or None: custom ops are not cast by autocast, so we do it."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _cast(dtype, *tensors):
    return tuple(t.to(dtype) if t is not None and dtype is not None else t for t in tensors)


class FusedLinearAct(nn.Module):
    """act(linear(x)) in one op, holding the SAME weight/bias Parameters as the Linear it replaces."""

    def __init__(self, linear: nn.Linear, act: str):
        super().__init__()
        self.in_features, self.out_features, self.act = linear.in_features, linear.out_features, act
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = _cast(_autocast_dtype(x.device.type), x, self.weight, self.bias)
        return linear_act(x, w, b, self.act)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act={self.act!r}"


class FusedLayerNormAct(nn.Module):
    """act(layer_norm(x)) in one op, holding the SAME weight/bias Parameters as the LayerNorm."""

    def __init__(self, norm: nn.LayerNorm, act: str):
        super().__init__()
        if len(norm.normalized_shape) != 1:
            raise FusionError("only a LayerNorm over the last dimension can be fused with its activation")
        self.normalized_shape, self.eps, self.act = norm.normalized_shape, norm.eps, act
        self.weight = norm.weight
        self.bias = norm.bias

    def forward(self, x: Tensor) -> Tensor:
        # Computed in FP32 inside the kernel whatever the input dtype, as autocast runs layer_norm.
        return layernorm_act(x, self.weight, self.bias, self.eps, self.act)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, act={self.act!r}"


class FusedQKVProjection(nn.Module):
    """One concatenated (q+k+v, d) weight; the three QKVSlice modules read their part of one GEMM.

    The GEMM runs once per input tensor: the first slice called with ``x`` computes all three
    outputs and keeps them until its two siblings have taken theirs with the same ``x`` (same
    object, same in-place version, same grad mode). A slice called with another input (cross
    attention) simply triggers a fresh GEMM, so the user's forward stays correct either way.
    """

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        self.in_features = linears[0].in_features
        self.sizes = tuple(lin.out_features for lin in linears)
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in linears])
            bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
        self.weight = nn.Parameter(weight, requires_grad=linears[0].weight.requires_grad)
        self.bias = nn.Parameter(bias, requires_grad=linears[0].bias.requires_grad) if bias is not None else None
        self._cache = None

    def offsets(self, index: int) -> slice:
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def output(self, x: Tensor, index: int) -> Tensor:
        key = (x._version, torch.is_grad_enabled(), _autocast_dtype(x.device.type))
        cache = self._cache
        if cache is not None and cache[0] is x and cache[1] == key and index not in cache[3]:
            cache[3].add(index)
            if len(cache[3]) == len(self.sizes):
                self._cache = None  # all three taken: drop the references at once
            return cache[2][index]
        outputs = qkv_projection(x, self.weight, self.bias, self.sizes)
        self._cache = (x, key, outputs, {index})
        return outputs[index]

    # The slices carry this module's tensors in the stock layout; it saves and loads nothing itself.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, bias={self.bias is not None}"


class QKVSlice(nn.Module):
    """Stands where q_proj/k_proj/v_proj stood; saves and loads as the stock Linear would."""

    def __init__(self, shared: FusedQKVProjection, index: int):
        super().__init__()
        object.__setattr__(self, "_shared", shared)  # not a child: the owner registers it once
        self.index = index
        self.in_features, self.out_features = shared.in_features, shared.sizes[index]

    @property
    def weight(self) -> Tensor:
        return self._shared.weight[self._shared.offsets(self.index)]

    @property
    def bias(self) -> Optional[Tensor]:
        b = self._shared.bias
        return None if b is None else b[self._shared.offsets(self.index)]

    def forward(self, x: Tensor) -> Tensor:
        return self._shared.output(x, self.index)

    def _tensors(self):
        yield "weight", self._shared.weight
        if self._shared.bias is not None:
            yield "bias", self._shared.bias

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        rows = self._shared.offsets(self.index)
        for name, t in self._tensors():
            destination[prefix + name] = (t if keep_vars else t.detach())[rows]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        rows = self._shared.offsets(self.index)
        for name, t in self._tensors():
            _copy_rows(state_dict, prefix + name, t, rows, missing_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slice of fused QKV"


def _copy_rows(state_dict, key, target: Tensor, rows: slice, missing_keys, error_msgs) -> None:
    """Copy ``state_dict[key]`` into ``target[rows]``, reporting as Module._load_from_state_dict does."""
    if key not in state_dict:
        missing_keys.append(key)
        return
    value, part = state_dict[key], target[rows]
    if value.shape != part.shape:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                          f"the shape in current model is {tuple(part.shape)}.")
        return
    with torch.no_grad():
        part.copy_(value)


class FusedSwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with gate and up as one (2*hidden, d) GEMM."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear):
        super().__init__()
        if gate_proj.weight.shape != up_proj.weight.shape or (gate_proj.bias is None) != (up_proj.bias is None):
            raise FusionError("gate_proj and up_proj must have one shape and both or neither a bias to fuse")
        self.hidden = gate_proj.out_features
        with torch.no_grad():
            weight = torch.cat([gate_proj.weight, up_proj.weight])
            bias = torch.cat([gate_proj.bias, up_proj.bias]) if gate_proj.bias is not None else None
        self.gate_up_weight = nn.Parameter(weight, requires_grad=gate_proj.weight.requires_grad)
        self.gate_up_bias = nn.Parameter(bias) if bias is not None else None
        self.down_proj = down_proj

    def forward(self, x: Tensor) -> Tensor:
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        return self.down_proj(swiglu(gate_up))

    def _stock_names(self):
        yield "gate_proj.weight", self.gate_up_weight, slice(0, self.hidden)
        yield "up_proj.weight", self.gate_up_weight, slice(self.hidden, 2 * self.hidden)
        if self.gate_up_bias is not None:
            yield "gate_proj.bias", self.gate_up_bias, slice(0, self.hidden)
            yield "up_proj.bias", self.gate_up_bias, slice(self.hidden, 2 * self.hidden)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t, rows in self._stock_names():
            destination[prefix + name] = (t if keep_vars else t.detach())[rows]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, t, rows in self._stock_names():
            _copy_rows(state_dict, prefix + name, t, rows, missing_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, gate/up fused"


class FusedLogits:
    """What a LinearCrossEntropyHead returns in training: the loss is computed without full logits.

    ``workloads.base.cross_entropy_loss`` calls :meth:`cross_entropy_loss`. Any other use (indexing,
    ``.view``, torch functions) materialises the logits, with a one-time warning that the memory
    saving is lost for that model.
    """

    _warned = False

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], chunk_rows: Optional[int]):
        dtype = _autocast_dtype(hidden.device.type)  # captured now: the loss may run outside autocast
        self.hidden, self.weight, self.bias = _cast(dtype, hidden, weight, bias)
        self.chunk_rows = chunk_rows

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    def cross_entropy_loss(self, targets: Tensor, ignore_index: int = -100) -> Tensor:
        return linear_cross_entropy(self.hidden, self.weight, self.bias, targets, ignore_index, self.chunk_rows)

    def materialize(self) -> Tensor:
        if not FusedLogits._warned:
            FusedLogits._warned = True
            warnings.warn("a fused lm_head output was used as a logits tensor, so the full logits were "
                          "materialised; compute the loss with workloads.base.cross_entropy_loss (or "
                          "output.cross_entropy_loss(targets)) to keep the memory saving", stacklevel=3)
        return F.linear(self.hidden, self.weight, self.bias)

    def float(self) -> Tensor:
        return self.materialize().float()

    def __getattr__(self, name):
        if name.startswith("__") or name in ("hidden", "weight", "bias", "chunk_rows"):
            raise AttributeError(name)  # copy/pickle probes, or a half-built object: no materialising
        return getattr(self.materialize(), name)

    def __getitem__(self, index):
        return self.materialize()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.materialize() if isinstance(a, FusedLogits) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class LinearCrossEntropyHead(nn.Module):
    """A Linear head that, in training mode, returns FusedLogits (loss without full FP32 logits).

    In eval mode it returns ordinary logits, so generation and metrics code keeps working. The
    weight is the SAME Parameter as the stock head's (weight tying with the embedding survives).
    """

    def __init__(self, linear: nn.Linear, chunk_rows: Optional[int] = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.chunk_rows = chunk_rows

    def forward(self, x: Tensor):
        if self.training:
            return FusedLogits(x, self.weight, self.bias, self.chunk_rows)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused cross-entropy"
