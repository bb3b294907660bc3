"""Ops that stay FP32 in every mixed-precision mode, on CPU as well as CUDA.

torch.autocast's CPU op lists run softmax and layer_norm in bf16, and a model held in bf16 (the
'-master' modes) has no autocast at all, so turbotrain intercepts the numerically fragile ops
itself with a TorchFunctionMode: their low-precision inputs are upcast, the op runs in FP32, and
normalisations hand their result back in the input dtype (so the next matmul stays fast) while
losses and reductions return FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..plan import NORM_MODULE_TYPES

__all__ = ["KeepFp32Mode", "KEEP_FP32_MODULES", "RETURN_INPUT_DTYPE", "RETURN_FP32"]

_LOW = (torch.float16, torch.bfloat16)

#: Normalisations and softmax: computed in FP32, result cast back to the input dtype.
RETURN_INPUT_DTYPE = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
    torch.Tensor.log_softmax, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.rms_norm, F.normalize,
}
#: Losses and reductions: computed and returned in FP32.
RETURN_FP32 = {
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, torch.logsumexp, torch.Tensor.logsumexp,
    torch.norm, torch.linalg.vector_norm,
}
#: Modules whose parameters stay FP32 when the model is held in low precision.
KEEP_FP32_MODULES = NORM_MODULE_TYPES


def _upcast(value):
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    if isinstance(value, list):
        return [_upcast(v) for v in value]
    if isinstance(value, tuple):  # a list comprehension, not a generator: Dynamo traces it inline
        return tuple([_upcast(v) for v in value])
    return value


def _low_dtype_of(args) -> torch.dtype | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype if a.dtype in _LOW else None
    return None


class KeepFp32Mode(TorchFunctionMode):
    """Run the ops in RETURN_INPUT_DTYPE / RETURN_FP32 in FP32 while active.

    >>> x = torch.randn(4, 8, dtype=torch.bfloat16)
    >>> with KeepFp32Mode():
    ...     y = torch.softmax(x, dim=-1)
    >>> y.dtype
    torch.bfloat16
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RETURN_INPUT_DTYPE:
            low = _low_dtype_of(args)
            if low is not None:
                out = func(*_upcast(args), **{k: _upcast(v) for k, v in kwargs.items()})
                return out.to(low)
        elif func in RETURN_FP32 and _low_dtype_of(args) is not None:
            return func(*_upcast(args), **{k: _upcast(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)
