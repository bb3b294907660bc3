"""``bert``: a bidirectional encoder trained with the masked-LM objective on the stdlib corpus.

The encoder is gpt's module tree with ``causal=False`` (same names, so the same fusion and
checkpointing passes apply), but pre-LayerNorm rather than BERT's original post-LN: at these
sizes and learning rates pre-LN trains without warm-up, and the compute is identical.

Masking follows BERT: 15% of positions are chosen; of those 80% become ``<|mask|>``, 10% a
random token and 10% stay; targets are the original token there and -100 everywhere else.
The choice comes from the batch stream's own generator, so it is as deterministic as the windows.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("bert", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.build_model()(torch.zeros(2, 32, dtype=torch.long)).shape
torch.Size([2, 32, 8192])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from .base import Workload, cross_entropy_loss
from .data import corpus_batches, seeded_build
from .gpt import GPT, GPTSettings

__all__ = ["BertSettings", "mask_tokens", "check_mask_prob", "make_workload"]


def check_mask_prob(value) -> None:
    """ConfigError unless ``value`` is a fraction in (0, 1] (the masked-LM rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"mask_prob={value!r} is not valid; it must be in (0, 1]")


@dataclass(frozen=True)
class BertSettings(GPTSettings):
    """gpt's shape fields plus the masking rate."""

    mask_prob: float = 0.15
    """Fraction of positions that carry a target (BERT's 15%)."""

    def __post_init__(self):
        super().__post_init__()
        check_mask_prob(self.mask_prob)


def mask_tokens(
    window: torch.Tensor, mask_id: int, vocab_size: int, mask_prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of a (B, T) window: returns (inputs, targets with -100 where not chosen)."""
    chosen = torch.rand(window.shape, generator=generator) < mask_prob
    if not chosen.any():
        chosen.view(-1)[0] = True  # an all-ignored batch would make the mean loss NaN
    roll = torch.rand(window.shape, generator=generator)
    random_tokens = torch.randint(0, vocab_size, window.shape, generator=generator)
    inputs = window.clone()
    inputs[chosen & (roll < 0.8)] = mask_id
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tokens[swap]
    targets = torch.where(chosen, window, torch.full_like(window, -100))
    return inputs, targets


def make_workload(settings: BertSettings | None = None) -> Workload:
    """The bert Workload; ``get_workload('bert', **overrides)`` validates overrides first."""
    s = settings or BertSettings()

    def masked(window, corpus, generator):
        return mask_tokens(window, corpus.mask_id, corpus.vocab_size, s.mask_prob, generator)

    return Workload(
        name="bert",
        kind="text",
        unit="tokens",
        items_per_batch=s.B * s.T,
        build_model=seeded_build(lambda: GPT(s, causal=False), s.init_seed),
        loss_fn=cross_entropy_loss,
        batches=corpus_batches(s.vocab_size, s.B, s.T, masked=masked),
        description=f"BERT-style encoder (MLM, {s.mask_prob:.0%} masked) d={s.d} L={s.n_layer} T={s.T}",
        settings=asdict(s),
    )
