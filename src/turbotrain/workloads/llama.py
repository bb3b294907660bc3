"""``llama``: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, no biases) on the stdlib corpus.

Module names follow Hugging Face Llama (``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``gate_proj``/``up_proj``/``down_proj``, ``input_layernorm``/``post_attention_layernorm``,
``norm``, ``lm_head``); the SiLU is a module at ``mlp.act`` so the swiglu fusion can find it, and
the blocks sit in ``model.blocks``.

>>> from turbotrain.workloads import get_workload
>>> wl = get_workload("llama", d=64, n_layer=1, n_head=4, T=32, B=2)
>>> wl.build_model()(torch.zeros(2, 32, dtype=torch.long)).shape
torch.Size([2, 32, 8192])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, check_positive
from .base import Workload, cross_entropy_loss
from .data import corpus_batches, seeded_build
from .gpt import TransformerSettings, merge_heads, split_heads

__all__ = ["LlamaSettings", "Llama", "LlamaBlock", "LlamaAttention", "SwiGLU", "apply_rope", "make_workload"]


@dataclass(frozen=True)
class LlamaSettings(TransformerSettings):
    """Model and batch shape of the llama workload; the shared sizes match gpt so the two compare."""

    mlp_hidden: int = 0
    """SwiGLU hidden width; 0 means Llama's 8/3*d rounded up to a multiple of 64 (1408 at d=512),
    which keeps the MLP's parameter count at GPT's 4*d with three matrices instead of two."""
    rope_theta: float = 10000.0
    """RoPE base (Llama 2's)."""

    def __post_init__(self):
        super().__post_init__()
        check_positive("mlp_hidden", self.mlp_hidden, allow_zero=True)
        check_positive("rope_theta", self.rope_theta)
        if (self.d // self.n_head) % 2:
            raise ConfigError(
                f"n_head={self.n_head} with d={self.d} leaves an odd head size; RoPE needs an even "
                "head size: choose e.g. d=512, n_head=8"
            )

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 64 * -(-8 * self.d // (3 * 64))


def apply_rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x (B, H, T, hd) by position-dependent angles.

    ``positions``: (B or 1, T) token positions (default 0..T-1). The angles are computed in FP32 on
    every call rather than kept as a buffer, so casting the model to bf16 (bf16-master) cannot round
    the frequencies; at hd=64 this is T*32 sin/cos.
    """
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    if positions is None:
        angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    else:  # (B, T, hd/2) -> (B, 1, T, hd/2): the same angles for every head
        angles = (positions.to(torch.float32)[..., None] * inv_freq).unsqueeze(-3)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, d: int, n_head: int, rope_theta: float):
        super().__init__()
        self.n_head = n_head
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.n_head
        q = apply_rope(split_heads(self.q_proj(x), h), self.rope_theta, positions)
        k = apply_rope(split_heads(self.k_proj(x), h), self.rope_theta, positions)
        y = F.scaled_dot_product_attention(q, k, split_heads(self.v_proj(x), h), is_causal=True)
        return self.o_proj(merge_heads(y))


class SwiGLU(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with act = SiLU."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.act = nn.SiLU()
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, s: LlamaSettings):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(s.d, eps=1e-5)
        self.attn = LlamaAttention(s.d, s.n_head, s.rope_theta)
        self.post_attention_layernorm = nn.RMSNorm(s.d, eps=1e-5)
        self.mlp = SwiGLU(s.d, s.hidden)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions as a keyword only when given: tensor-parallel input hooks count positional inputs
        extra = {} if positions is None else {"positions": positions}
        x = x + self.attn(self.input_layernorm(x), **extra)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token embedding (no position embedding: RoPE), ``blocks``, ``norm``, untied ``lm_head``."""

    is_causal = True  # lets seq_buckets pad on the right without a mask

    def __init__(self, s: LlamaSettings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.d)
        self.blocks = nn.ModuleList(LlamaBlock(s) for _ in range(s.n_layer))
        self.norm = nn.RMSNorm(s.d, eps=1e-5)
        self.lm_head = nn.Linear(s.d, s.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)  # Llama's initializer_range

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx`` (B, T); ``position_ids`` (B or 1, T) place the tokens for RoPE (default 0..T-1)."""
        x = self.embed_tokens(idx)  # RoPE has no table, so any sequence length works
        extra = {} if position_ids is None else {"positions": position_ids}
        for block in self.blocks:
            x = block(x, **extra)
        return self.lm_head(self.norm(x))


def make_workload(settings: LlamaSettings | None = None) -> Workload:
    """The llama Workload; ``get_workload('llama', **overrides)`` validates overrides first."""
    s = settings or LlamaSettings()
    return Workload(
        name="llama",
        kind="text",
        unit="tokens",
        items_per_batch=s.B * s.T,
        build_model=seeded_build(lambda: Llama(s), s.init_seed),
        loss_fn=cross_entropy_loss,
        batches=corpus_batches(s.vocab_size, s.B, s.T),
        description=f"Llama decoder d={s.d} L={s.n_layer} H={s.n_head} T={s.T} on stdlib source",
        settings={**asdict(s), "mlp_hidden": s.hidden},
    )
