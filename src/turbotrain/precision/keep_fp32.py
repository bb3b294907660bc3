"""Ops that stay FP32 in every mixed-precision mode, on CPU as well as CUDA.

torch.autocast's CPU op lists run softmax and layer_norm in bf16, and a model held in bf16 (the
'-master' modes) has no autocast at all, so turbotrain intercepts the numerically fragile ops
itself with a TorchFunctionMode: their low-precision inputs are upcast, the op runs in FP32, and
normalisations hand their result back in the input dtype (so the next matmul stays fast) while
losses, reductions and FFTs (which have no bf16 CPU kernel; autocast upcasts them too) return FP32.

A model held in low precision also meets FP32 activations its own code made: a norm fed
``x.to(self.norm.weight.dtype)`` (turbotrain keeps norm weights FP32), attention computed in FP32
on purpose, an FFT. Autocast would cast such an input at the next matmul; without autocast the
matmul would fail on the mixed dtypes. With ``match_operands`` the mode does autocast's cast there:
a layer's input goes to its weight's dtype, and the FP32 operand of a product of two tensors goes
to the other's low dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..plan import NORM_MODULE_TYPES

__all__ = ["KeepFp32Mode", "KEEP_FP32_MODULES", "RETURN_INPUT_DTYPE", "RETURN_FP32", "WEIGHT_OPS", "PRODUCT_OPS"]

logger = logging.getLogger(__name__)

_LOW = (torch.float16, torch.bfloat16)

#: Normalisations and softmax: computed in FP32, result cast back to the input dtype. Under
#: torch.compile the mode sees ``torch.rms_norm`` where eager code sees ``F.rms_norm`` (Dynamo inlines
#: the Python wrapper), so both are listed.
RETURN_INPUT_DTYPE = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
    torch.Tensor.log_softmax, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.rms_norm, torch.rms_norm, F.normalize,
}
#: Losses and reductions: computed and returned in FP32.
RETURN_FP32 = {
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, torch.logsumexp, torch.Tensor.logsumexp,
    torch.norm, torch.linalg.vector_norm,
    torch.fft.fft, torch.fft.ifft, torch.fft.fft2, torch.fft.ifft2, torch.fft.fftn, torch.fft.ifftn,
    torch.fft.rfft, torch.fft.irfft, torch.fft.rfft2, torch.fft.irfft2, torch.fft.rfftn, torch.fft.irfftn,
    torch.fft.hfft, torch.fft.ihfft,
}
#: Layers called as ``op(input, weight, ...)``: with match_operands, an input of another float dtype
#: is cast to the weight's (and so is the bias).
WEIGHT_OPS = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
}
#: Products of tensors: with match_operands, FP32 operands are cast to the low dtype of the others.
PRODUCT_OPS = {
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
    torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
    torch.Tensor.baddbmm, torch.einsum, F.scaled_dot_product_attention,
}
#: Modules whose parameters stay FP32 when the model is held in low precision.
KEEP_FP32_MODULES = NORM_MODULE_TYPES


def _cast_tensors(value, dtype: torch.dtype, only_low: bool):
    """``value`` (a tensor, or a list/tuple holding some) with its floating tensors cast to ``dtype``;
    with ``only_low``, only its bf16/fp16 ones."""
    if isinstance(value, torch.Tensor):
        cast = value.dtype in _LOW if only_low else value.is_floating_point() and value.dtype != dtype
        return value.to(dtype) if cast else value
    if isinstance(value, list):
        return [_cast_tensors(v, dtype, only_low) for v in value]
    if isinstance(value, tuple):  # a list comprehension, not a generator: Dynamo traces it inline
        return tuple([_cast_tensors(v, dtype, only_low) for v in value])
    return value


def _upcast(value):
    return _cast_tensors(value, torch.float32, only_low=True)


def _low_dtype_of(args) -> torch.dtype | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype if a.dtype in _LOW else None
    return None


_reported: set[str] = set()


def _matched_dtype(func, args, kwargs) -> torch.dtype | None:
    """The dtype autocast would run ``func`` in when its floating operands mix FP32 with one low
    dtype (WEIGHT_OPS: the weight's; PRODUCT_OPS: the low one); None when they do not mix."""
    dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) != 2 or torch.float32 not in dtypes:
        return None
    low = (dtypes - {torch.float32}).pop()
    if low not in _LOW:
        return None
    if func in WEIGHT_OPS:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if not isinstance(weight, torch.Tensor):
            return None
        target = weight.dtype
    else:
        target = low
    name = getattr(func, "__name__", str(func))
    if name not in _reported and not torch.compiler.is_compiling():
        _reported.add(name)
        logger.info("%s got float32 and %s operands (the model made an FP32 activation); it runs in %s, "
                    "as autocast would run it", name, str(low)[6:], str(target)[6:])
    return target


class KeepFp32Mode(TorchFunctionMode):
    """Run the ops in RETURN_INPUT_DTYPE / RETURN_FP32 in FP32 while active; with ``match_operands``
    (a model held in low precision, no autocast), cast mixed FP32 / low-precision operands of
    WEIGHT_OPS and PRODUCT_OPS the way autocast would.

    >>> x = torch.randn(4, 8, dtype=torch.bfloat16)
    >>> with KeepFp32Mode():
    ...     y = torch.softmax(x, dim=-1)
    >>> y.dtype
    torch.bfloat16
    >>> w = torch.randn(3, 8, dtype=torch.bfloat16)
    >>> with KeepFp32Mode(match_operands=True):
    ...     z = torch.nn.functional.linear(x.float(), w)
    >>> z.dtype
    torch.bfloat16
    """

    def __init__(self, match_operands: bool = False):
        super().__init__()
        self.match_operands = match_operands

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.match_operands and (func in WEIGHT_OPS or func in PRODUCT_OPS):
            target = _matched_dtype(func, args, kwargs)
            if target is not None:
                return func(*_cast_tensors(args, target, only_low=False),
                            **{k: _cast_tensors(v, target, only_low=False) for k, v in kwargs.items()})
        elif func in RETURN_INPUT_DTYPE:
            low = _low_dtype_of(args)
            if low is not None:
                out = func(*_upcast(args), **{k: _upcast(v) for k, v in kwargs.items()})
                return out.to(low)
        elif func in RETURN_FP32 and _low_dtype_of(args) is not None:
            return func(*_upcast(args), **{k: _upcast(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)
