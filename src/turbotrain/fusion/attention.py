"""Attention as plain PyTorch, so torch.compile fuses it, in place of the CPU flash kernel.

On a CPU, ``F.scaled_dot_product_attention`` runs torch's flash-attention kernel: one opaque op
that Inductor calls as it is, whose backward runs far below the matmul peak. Written as ``q @ kᵀ``,
a mask, an FP32 softmax and ``@ v``, the same attention is matmuls Inductor hands to the BLAS and
elementwise work it fuses into one loop each way. For causal attention the queries go in blocks,
and each block multiplies only the keys at or before its last row, so the fully masked upper
blocks of ``q @ kᵀ`` are never computed (nor stored for the backward).

:class:`PlainAttentionMode` routes the ``scaled_dot_product_attention`` calls of any model (a
user's own ``F.scaled_dot_product_attention``, Hugging Face's sdpa attention interface) to
:func:`plain_attention` while it is entered; ``torch.compile`` traces through it in one graph.
The stock op is its own reference twin. ``nn.MultiheadAttention`` (and so
``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``) calls the op from inside
``F.multi_head_attention_forward``, past that function's own torch-function dispatch, where no mode
sees it (and Dynamo leaves the whole function as one opaque call), so the mode takes that function's
common training case itself: self-attention over the packed projection, no key padding mask, no
attention weights returned. The Engine uses the mode under ``compile=True`` on a CPU in bf16
(``Config(attention='auto')``; 'plain' and 'stock' force either), or enter the mode inside your own
compiled step: on a quiet 2-core AVX512-BF16 EPYC at T=256 it made the whole compiled step
1.07-1.15x faster than the same step with the flash kernel
(benchmarks/2026-12-04-avx512-plain-attention.md). It keeps FP32
scores for the backward, so it costs memory at long sequences.

>>> import torch
>>> import torch.nn.functional as F
>>> q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
>>> stock = F.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> with PlainAttentionMode(block=2):
...     plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> torch.allclose(plain, stock, atol=1e-6)
True
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["plain_attention", "PlainAttentionMode", "DEFAULT_BLOCK"]

logger = logging.getLogger(__name__)

#: Query rows per causal block. Smaller blocks skip more of the masked triangle (with n blocks,
#: (n + 1) / 2n of ``q @ kᵀ`` is computed) but make smaller, less efficient matmuls. For compiled
#: attention alone at T=256 on the (loaded) development CPU, 128 beat one block on one thread, and
#: 64 and 32 were slower than 128 on two. The whole step agrees (tt-fused-compile on gpt at T=256,
#: AVX512-BF16, three rounds of alternating processes): 128 was fastest in every round, 64 1-9%
#: and one block 6-16% slower (benchmarks/2026-12-06-avx512-families.md).
DEFAULT_BLOCK = 128
_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
# Its parameters, read once here: Dynamo does not trace inspect.signature(...).bind.
_MHA_NAMES = tuple(inspect.signature(_MHA).parameters)
_MHA_DEFAULTS = {n: p.default for n, p in inspect.signature(_MHA).parameters.items() if p.default is not p.empty}
_WARNED: set[str] = set()


def _say_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("scaled_dot_product_attention runs the stock kernel: %s", reason)


_KEYS = itertools.count(1)
_LEFT: dict[int, set[str]] = {}  # a mode's key -> why its calls went to the stock op


@torch.compiler.assume_constant_result
def _left_to_stock(key: int, reason: str) -> bool:
    """Note and say (once per reason) that a call of mode ``key`` stayed on the stock op.

    Traced by torch.compile, Dynamo runs it once while tracing and keeps its result as a constant,
    so it neither breaks the graph (as a log call would) nor makes Dynamo guard on the notes (a set
    mutated in traced code recompiled the step once).
    """
    _LEFT.setdefault(key, set()).add(reason)
    _say_once(reason)
    return True


def _causal_keep(rows: range, keys: int, device) -> Tensor:
    """(len(rows), keys) bool: query i sees key j <= i (sdpa's top-left-aligned causal mask)."""
    return torch.arange(rows.start, rows.stop, device=device)[:, None] >= torch.arange(keys, device=device)[None, :]


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Optional[Tensor] = None,
            bias: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """softmax(scale * q kᵀ + mask) v with the softmax in FP32. Under a user's mask a row with every
    key masked gives 0 (as the stock op's math backend does), not NaN; a causal mask never masks a
    whole row, so that check is left out there."""
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if bias is not None:
        scores = scores + bias.float()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if causal or (bias is None and keep is None):
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax of an all -inf row is NaN, and so would be its gradient: give that row zeros
        dead = scores.amax(dim=-1, keepdim=True) == float("-inf")
        probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(probs.to(v.dtype), v)


def plain_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                    block: Optional[int] = DEFAULT_BLOCK) -> Tensor:
    """``F.scaled_dot_product_attention`` without dropout, as matmuls and an FP32 softmax.

    ``attn_mask`` is a bool mask (True: attend) or an additive float mask, broadcast as sdpa does;
    ``enable_gqa`` repeats each key/value head for its group of query heads. With ``is_causal``
    and ``block``, query rows go in blocks of ``block`` that skip the keys after their last row
    (``block=None``: one block, the full masked square).

    >>> q = torch.randn(2, 4, 6, 8); kv = torch.randn(2, 2, 6, 8)
    >>> plain_attention(q, kv, kv, is_causal=True, enable_gqa=True).shape
    torch.Size([2, 4, 6, 8])
    """
    length, keys = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    keep = bias = None
    if attn_mask is not None:
        keep, bias = (attn_mask, None) if attn_mask.dtype == torch.bool else (None, attn_mask)
    if not is_causal:
        return _attend(query, key, value, scale, keep, bias)
    step = length if block is None else block
    outs = []
    for start in range(0, length, step):
        rows = range(start, min(start + step, length))
        seen = min(rows.stop, keys)  # keys after the block's last row are masked for all its rows
        outs.append(_attend(query[..., rows.start:rows.stop, :], key[..., :seen, :], value[..., :seen, :], scale,
                            _causal_keep(rows, seen, query.device), causal=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """Why a call is left to the stock op, or None."""
    if dropout_p:
        return f"dropout_p={dropout_p} (attention dropout is only in the stock kernel)"
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested tensors"
    if is_causal and attn_mask is not None:
        return "attn_mask with is_causal=True (the stock op refuses it, with its own message)"
    if key.shape[-3:-2] != query.shape[-3:-2] and not (
            enable_gqa and key.dim() >= 3 and query.shape[-3] % key.shape[-3] == 0):
        return "key heads differ from query heads without enable_gqa (the stock op explains)"
    return None


class PlainAttentionMode(TorchFunctionMode):
    """While entered, ``F.scaled_dot_product_attention`` calls run :func:`plain_attention`.

    A call with dropout (``dropout_p > 0``) or another case plain_attention does not cover runs
    the stock op, and the first of each kind is logged as a warning. ``calls`` counts the calls
    routed outside torch.compile (under compile the mode acts once, when the graph is traced);
    ``left_to_stock`` holds the reasons of the calls it left to the stock op, traced ones included.
    """

    def __init__(self, block: Optional[int] = DEFAULT_BLOCK):
        super().__init__()
        self.block = block
        self.calls = 0
        self._key = 0
        """Whose notes ``left_to_stock`` reads: 0 is shared; :meth:`keep_own_notes` gives a mode its
        own (outside torch.compile: __init__ may run inside a traced function, so it takes none)."""

    def keep_own_notes(self) -> "PlainAttentionMode":
        self._key = next(_KEYS)
        return self

    @property
    def left_to_stock(self) -> set[str]:
        """Why calls went to the stock op, eager or traced by torch.compile."""
        return set(_LEFT.get(self._key, ()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _MHA:
            return self._multi_head_attention(func, args, kwargs)
        if func is not _SDPA:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _multi_head_attention(self, func, args, kwargs):
        """``F.multi_head_attention_forward`` with its attention routed, in the case where its own code
        reduces to: the packed in-projection, sdpa over (batch, heads, sequence, head_dim), the
        out-projection. Any other case (cross-attention, a key padding mask, attention weights asked
        for, bias_k/bias_v, static keys) runs the stock function."""
        a = dict(_MHA_DEFAULTS)
        a.update(zip(_MHA_NAMES, args))
        a.update(kwargs)
        query, attn_mask, is_causal = a["query"], a["attn_mask"], a["is_causal"]
        if (a["need_weights"] or a["key_padding_mask"] is not None or a["use_separate_proj_weight"]
                or a["in_proj_weight"] is None or a["bias_k"] is not None or a["bias_v"] is not None
                or a["add_zero_attn"] or a["static_k"] is not None or a["static_v"] is not None
                or query.dim() != 3 or not (query is a["key"] and query is a["value"])
                or (is_causal and attn_mask is None)  # the stock function's own error
                or (attn_mask is not None and attn_mask.dim() != 2)):
            return func(*args, **kwargs)
        length, batch, embed = query.shape
        heads = a["num_heads"]
        if embed != a["embed_dim_to_check"] or embed % heads:
            return func(*args, **kwargs)  # the stock function's own error
        if is_causal:
            attn_mask = None  # the hint replaces the mask, as the stock function does without padding
        elif attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask  # nn.MultiheadAttention's True masks a key out; sdpa's True keeps it
        qkv = F.linear(query, a["in_proj_weight"], a["in_proj_bias"])  # (T, B, 3E)
        q, k, v = qkv.unflatten(-1, (3, heads, embed // heads)).permute(2, 1, 3, 0, 4).unbind(0)  # (B, H, T, d)
        out = self._attention(q, k, v, attn_mask=attn_mask, dropout_p=a["dropout_p"] if a["training"] else 0.0,
                              is_causal=is_causal)
        out = F.linear(out.permute(2, 0, 1, 3).reshape(length * batch, embed), a["out_proj_weight"],
                       a["out_proj_bias"])
        return out.view(length, batch, embed), None

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        reason = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if reason is not None:
            _left_to_stock(self._key, reason)
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if not torch.compiler.is_compiling():
            self.calls += 1
        return plain_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, self.block)
