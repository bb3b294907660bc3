"""nn.Module wrappers of the fused ops, each built from the stock module(s) it replaces.

Every wrapper saves and loads in the stock layout (habit 8 of STYLE.md): a checkpoint of a fused
model loads into the original model and back. Wrappers that keep the original parameters
(linear+act, layernorm+act) get that for free; the ones that concatenate weights
(QKV, SwiGLU gate/up) override ``_save_to_state_dict``/``_load_from_state_dict`` to split and join.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import FusionError
from .ops.layernorm_gelu import layernorm_act
from .ops.linear_act import linear_act
from .ops.qkv import qkv_projection
from .ops.swiglu import swiglu

__all__ = [
    "FusedLinearAct", "FusedLayerNormAct", "FusedQKVProjection", "QKVSlice", "FusedSwiGLUMLP",
]


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force, or None: custom ops are not cast by autocast, so we do it."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _compute_dtype(x: Tensor, weight: Tensor) -> Optional[torch.dtype]:
    """The dtype a fused layer casts its operands to: autocast's when it is on; else the weight's when
    ``x`` is FP32 and the weight bf16/fp16 (a model held in low precision fed an FP32 activation it
    made itself: precision/keep_fp32.py casts a stock layer's input the same way); else None."""
    dtype = _autocast_dtype(x.device.type)
    if dtype is None and x.dtype is torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        return weight.dtype
    return dtype


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
        x, w, b = _cast(_compute_dtype(x, self.weight), x, self.weight, self.bias)
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
        if torch.compiler.is_compiling():
            # The cache below is Python state Dynamo breaks the graph on (x._version, identity).
            # Traced, each slice reads one concatenated GEMM on x; the three identical GEMMs are
            # one node after the graph's common-subexpression pass, so the fusion is kept.
            return F.linear(x, self.weight, self.bias)[..., self.offsets(index)]
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
    """down(silu(gate(x)) * up(x)) with gate and up as one (2*hidden, d) GEMM.

    ``names`` are the attribute names the stock MLP held them under (Llama's gate_proj/up_proj/
    down_proj, Mixtral's w1/w3/w2, ...): the down projection stays a child under its own name and
    gate/up save and load under theirs, so the state_dict keeps the stock layout.
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        if gate_proj.weight.shape != up_proj.weight.shape or (gate_proj.bias is None) != (up_proj.bias is None):
            raise FusionError("gate_proj and up_proj must have one shape and both or neither a bias to fuse")
        if len(set(names)) != 3 or any("." in n for n in names):
            raise FusionError(f"names={names!r} must be three distinct attribute names")
        self.names = tuple(names)
        self.hidden = gate_proj.out_features
        with torch.no_grad():
            weight = torch.cat([gate_proj.weight, up_proj.weight])
            bias = torch.cat([gate_proj.bias, up_proj.bias]) if gate_proj.bias is not None else None
        self.gate_up_weight = nn.Parameter(weight, requires_grad=gate_proj.weight.requires_grad)
        self.gate_up_bias = nn.Parameter(bias, requires_grad=gate_proj.bias.requires_grad) if bias is not None else None
        self.add_module(self.names[2], down_proj)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        return self._modules[self.names[2]](swiglu(gate_up))

    def _stock_names(self):
        gate, up, _ = self.names
        yield f"{gate}.weight", self.gate_up_weight, slice(0, self.hidden)
        yield f"{up}.weight", self.gate_up_weight, slice(self.hidden, 2 * self.hidden)
        if self.gate_up_bias is not None:
            yield f"{gate}.bias", self.gate_up_bias, slice(0, self.hidden)
            yield f"{up}.bias", self.gate_up_bias, slice(self.hidden, 2 * self.hidden)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t, rows in self._stock_names():
            destination[prefix + name] = (t if keep_vars else t.detach())[rows]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, t, rows in self._stock_names():
            _copy_rows(state_dict, prefix + name, t, rows, missing_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, gate/up fused"
