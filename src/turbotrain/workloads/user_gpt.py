"""``user-gpt``: a GPT written the way a user writes one, not the way turbotrain's passes expect.

The gpt workload names its modules the Hugging Face way (``q_proj``, ``mlp.fc``, ``ln_1``,
``model.blocks``) so the structural passes have an easy time; this one is the same computation
in a stranger's vocabulary, so the ladder also shows what the Engine does with a model it was not
shaped around:

- attention with separate ``query_proj``/``key_proj``/``value_proj``/``output_proj`` Linears,
- a ``feed_forward`` of ``fc1`` -> ``act`` (``nn.GELU(approximate="tanh")``, GPT-2's) -> ``fc2``,
- ``norm1``/``norm2``/``final_norm``, embeddings ``tok_emb``/``pos_emb``, head ``to_logits``,
- the layers in one ``nn.Sequential`` (not a ModuleList the model loops over),
- and the loss in a plain user function, ``next_token_loss``, that does what most training
  scripts do: ``F.cross_entropy`` on the flattened logits, with no FP32 up-cast of its own.

The shape fields are gpt's (GPTSettings), so the two workloads compare at one size.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("user-gpt", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.build_model()(torch.zeros(2, 32, dtype=torch.long)).shape
torch.Size([2, 32, 8192])
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from .base import Workload
from .data import corpus_batches, seeded_build
from .gpt import GPTSettings

__all__ = ["UserGPT", "DecoderLayer", "CausalSelfAttention", "FeedForward", "next_token_loss", "make_workload"]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query_proj = nn.Linear(dim, dim)
        self.key_proj = nn.Linear(dim, dim)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        head_dim = dim // self.heads

        def heads(t):
            return t.view(batch, length, self.heads, head_dim).transpose(1, 2)

        q, k, v = heads(self.query_proj(x)), heads(self.key_proj(x)), heads(self.value_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(y.transpose(1, 2).contiguous().view(batch, length, dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class UserGPT(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab)."""

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, context: int, mlp_ratio: int = 4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(context, dim)
        self.layers = nn.Sequential(*[DecoderLayer(dim, heads, mlp_ratio * dim) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # the usual N(0, 0.02) of GPT-2-like scripts; PyTorch's default Embedding init (N(0, 1))
        # would start the loss far above ln(vocab)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        return self.to_logits(self.final_norm(self.layers(x)))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The user's own loss: mean cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_workload(settings: GPTSettings | None = None) -> Workload:
    """The user-gpt Workload; ``get_workload('user-gpt', **overrides)`` validates overrides first."""
    s = settings or GPTSettings()
    return Workload(
        name="user-gpt",
        kind="text",
        unit="tokens",
        items_per_batch=s.B * s.T,
        build_model=seeded_build(lambda: UserGPT(s.vocab_size, s.d, s.n_layer, s.n_head, s.T, s.mlp_ratio),
                                 s.init_seed),
        loss_fn=next_token_loss,
        batches=corpus_batches(s.vocab_size, s.B, s.T),
        description=f"a user's GPT (nn.Sequential layers, query/key/value_proj, fc1/GELU-tanh/fc2, own loss) "
        f"d={s.d} L={s.n_layer} H={s.n_head} T={s.T} on stdlib source",
        settings=asdict(s),
    )
