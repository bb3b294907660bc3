"""Fused QKV projection: one GEMM over the concatenated q/k/v weights, then three views.

Reading the input once and running one (q+k+v, d) GEMM instead of three smaller ones keeps the
matrix unit busier; in the backward autograd concatenates the three output grads and again runs one
GEMM for the input grad and one for the weight grad (stock: three each, plus two adds).
The sizes may differ (grouped-query attention has smaller k and v).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn.functional as F
from torch import Tensor

__all__ = ["qkv_projection", "qkv_projection_reference"]


def qkv_projection(x: Tensor, weight: Tensor, bias: Optional[Tensor], sizes: Sequence[int]) -> tuple[Tensor, ...]:
    """(q, k, v) from one GEMM; ``weight`` is ``cat([Wq, Wk, Wv])`` and ``sizes`` their out_features.

    >>> import torch
    >>> x, w = torch.randn(2, 8), torch.randn(12, 8)
    >>> [t.shape[-1] for t in qkv_projection(x, w, None, (4, 4, 4))]
    [4, 4, 4]
    """
    out = F.linear(x, weight, bias)
    # narrow, not split: a view of one base may be modified in place (split's multi-output views may not)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(out.narrow(-1, o, s) for o, s in zip(offsets, sizes))


def qkv_projection_reference(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]]):
    """Plain PyTorch twin of :func:`qkv_projection`: three separate Linears."""
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
