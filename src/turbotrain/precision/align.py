"""Alignment advisor: matmul dimensions that are not multiples of the hardware's tile size.

Tensor Cores (and the CPU's bf16 dot-product units) work on tiles: a GEMM with a dimension that is
not a multiple of 8 elements (16-bit types; 64 for the vocabulary, which feeds the largest GEMM)
pads internally or falls back to slower kernels.
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["alignment_advice", "warn_misaligned"]

_MULTIPLE = 8
_VOCAB_MULTIPLE = 64
#: A Linear holding less than this share of the model's Linear weights (a 10-class classifier, a
#: 7-way tag head, a router) does a negligible share of the GEMM work, and its sizes are often the
#: task's own (the number of labels): no advice for it.
_SMALL_SHARE = 0.01


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def alignment_advice(model: nn.Module, batch_size: int | None = None) -> list[str]:
    """One line per misaligned size: what it is, its value, and the size to pad it to."""
    advice, seen = [], set()

    def check(what: str, value: int, multiple: int = _MULTIPLE):
        if value % multiple and (what, value) not in seen:
            seen.add((what, value))
            advice.append(f"{what}={value} is not a multiple of {multiple}; pad it to {_round_up(value, multiple)}")

    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max(embeddings, key=lambda m: m.num_embeddings) if embeddings else None  # not positions
    linear_weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            if m is vocab:
                check(f"{name}.num_embeddings (vocab)", m.num_embeddings, _VOCAB_MULTIPLE)
            check(f"{name}.embedding_dim", m.embedding_dim)
        elif isinstance(m, nn.Linear) and m.in_features * m.out_features >= _SMALL_SHARE * linear_weights:
            check(f"{name}.in_features", m.in_features)
            check(f"{name}.out_features", m.out_features)
        n_head = getattr(m, "n_head", None) or getattr(m, "num_heads", None)
        d = getattr(m, "d_model", None) or getattr(m, "embed_dim", None)
        if isinstance(n_head, int) and isinstance(d, int) and n_head and d % n_head == 0:
            check(f"{name} head_dim", d // n_head)
    if batch_size is not None:
        check("batch size", batch_size)
    return advice


def warn_misaligned(model: nn.Module, batch_size: int | None = None) -> list[str]:
    """Warn once, listing every misaligned size with its padding."""
    advice = alignment_advice(model, batch_size)
    if advice:
        warnings.warn("turbotrain alignment advisor:\n  " + "\n  ".join(advice), stacklevel=3)
    return advice
