"""``gpt``: a nanoGPT-style decoder trained on next-token prediction over the stdlib corpus.

Module names follow Hugging Face GPT-2/OPT conventions (``q_proj``/``k_proj``/``v_proj``/
``out_proj``, ``ln_1``/``ln_2``/``ln_f``, ``mlp.fc``/``mlp.act``/``mlp.proj``, ``lm_head``) and
the blocks sit in ``model.blocks``, so turbotrain's fusion and checkpointing passes find them
without model-specific code.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("gpt", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.build_model()(torch.zeros(2, 32, dtype=torch.long)).shape
torch.Size([2, 32, 8192])
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, check_positive
from .base import Workload, cross_entropy_loss
from .data import CorpusSpec, corpus_batches, seeded_build

__all__ = [
    "TransformerSettings",
    "GPTSettings",
    "GPT",
    "Block",
    "SelfAttention",
    "MLP",
    "split_heads",
    "merge_heads",
    "make_workload",
]


@dataclass(frozen=True)
class TransformerSettings:
    """The shape fields every text workload shares (gpt, llama, bert)."""

    d: int = 512
    """Model width."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 8
    """Attention heads; must divide d (head size 64 at the defaults)."""
    T: int = 256
    """Sequence length (tokens per row)."""
    B: int = 8
    """Rows per batch; a batch is B*T tokens."""
    vocab_size: int = 8192
    """BPE vocabulary; the corpus is tokenized with a tokenizer of this size."""
    init_seed: int = 0
    """Seed of the weight initialisation (independent of the global RNG)."""

    def __post_init__(self):
        for name in ("d", "n_layer", "n_head", "T", "B", "vocab_size"):
            check_positive(name, getattr(self, name))
        check_positive("init_seed", self.init_seed, allow_zero=True)
        CorpusSpec(vocab_size=self.vocab_size)  # the tokenizer's limits, checked now rather than at the first batch
        if self.d % self.n_head:
            raise ConfigError(f"n_head={self.n_head} must divide d={self.d}; choose e.g. n_head={_divisor(self.d)}")


@dataclass(frozen=True)
class GPTSettings(TransformerSettings):
    """Model and batch shape of the gpt workload (bert extends it)."""

    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio * d (GPT-2's 4)."""

    def __post_init__(self):
        super().__post_init__()
        check_positive("mlp_ratio", self.mlp_ratio)


def _divisor(d: int) -> int:
    """A head count giving head size 64 when possible (what fast attention kernels like)."""
    return d // 64 if d % 64 == 0 else 1


def split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, d) -> (B, H, T, d/H), the layout SDPA takes."""
    b, s, d = t.shape
    return t.view(b, s, n_head, d // n_head).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, hd) -> (B, T, H*hd)."""
    b, h, s, hd = t.shape
    return t.transpose(1, 2).reshape(b, s, h * hd)


class SelfAttention(nn.Module):
    """Multi-head attention with separate q/k/v projections, through SDPA (flash on GPU)."""

    def __init__(self, d: int, n_head: int, *, causal: bool, bias: bool = True):
        super().__init__()
        self.n_head = n_head
        self.causal = causal
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n_head
        q, k, v = split_heads(self.q_proj(x), h), split_heads(self.k_proj(x), h), split_heads(self.v_proj(x), h)
        return self.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2): x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d: int, n_head: int, mlp_ratio: int, *, causal: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, n_head, causal=causal)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d, mlp_ratio * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``blocks``, ``ln_f``, untied ``lm_head``.

    ``causal=False`` gives the bidirectional encoder bert uses; everything else is shared.
    """

    def __init__(self, s: GPTSettings, *, causal: bool = True):
        super().__init__()
        self.max_len = s.T
        self.wte = nn.Embedding(s.vocab_size, s.d)
        self.wpe = nn.Embedding(s.T, s.d)
        self.is_causal = causal  # lets seq_buckets pad on the right without a mask
        self.blocks = nn.ModuleList(Block(s.d, s.n_head, s.mlp_ratio, causal=causal) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.d)
        self.lm_head = nn.Linear(s.d, s.vocab_size, bias=False)
        self._init_weights(s.n_layer)

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2 init: N(0, 0.02) everywhere, and the projections that write into the residual
        # stream scaled by 1/sqrt(2*n_layer) so its variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.out_proj, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx`` (B, T); ``position_ids`` (B or 1, T) say where the tokens sit (default 0..T-1),
        as context parallel needs for a rank's slice of a longer sequence."""
        t = idx.shape[1]
        if t > self.max_len:
            raise ConfigError(f"sequence length {t} exceeds the model's T={self.max_len}; build it with a larger T")
        if position_ids is None:
            position_ids = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_workload(settings: GPTSettings | None = None) -> Workload:
    """The gpt Workload; ``turbotrain.workloads.get_workload('gpt', **overrides)`` validates
    override names and types before calling this."""
    s = settings or GPTSettings()
    return Workload(
        name="gpt",
        kind="text",
        unit="tokens",
        items_per_batch=s.B * s.T,
        build_model=seeded_build(lambda: GPT(s), s.init_seed),
        loss_fn=cross_entropy_loss,
        batches=corpus_batches(s.vocab_size, s.B, s.T),
        description=f"GPT decoder d={s.d} L={s.n_layer} H={s.n_head} T={s.T} on stdlib source",
        settings=asdict(s),
    )
