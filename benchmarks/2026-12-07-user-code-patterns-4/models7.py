"""A seventh set, none in turbotrain: cross-entropy with the classes on dim 1, spectral norm (power
iteration in every forward), a gradient-reversal autograd.Function, in-place activations and
residuals, sinusoidal positions computed in forward, straight-through fake quantisation, and two
more Hugging Face families (Gemma 1, Phi-2) from config, and a GPT whose Linears are modded-nanogpt's
CastedLinear (the head among them)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm

from models2 import V, D, H, L, T, _tokens, lm_loss
from models3 import Block, image_batches
from models5 import GPT


def transposed_loss(logits, y):  # (B, V, T) against (B, T), as some codebases score sequences
    return F.cross_entropy(logits.transpose(1, 2), y)


def transposed_smooth_loss(logits, y):
    return F.cross_entropy(logits.permute(0, 2, 1), y, label_smoothing=0.1)


class SpectralNet(nn.Module):
    """A GAN-discriminator-style classifier: every Linear spectrally normalised (u, v buffers updated by
    a power iteration in each training forward)."""
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), spectral_norm(nn.Linear(3 * 32 * 32, 4 * D)), nn.LeakyReLU(0.2),
                                  spectral_norm(nn.Linear(4 * D, D)), nn.LeakyReLU(0.2))
        self.out = spectral_norm(nn.Linear(D, 10))

    def forward(self, x):
        return self.out(self.body(x))


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class DomainAdversarialLM(GPT):
    """DANN: a domain classifier on the features through a gradient-reversal layer; the loss adds its
    cross-entropy to the LM's."""
    def __init__(self):
        super().__init__()
        self.domain = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 2))

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        h = self.norm(x)
        return self.head(h), self.domain(_Reverse.apply(h.mean(1), 0.1))


def dann_loss(out, y):
    logits, domain = out
    return lm_loss(logits, y) + F.cross_entropy(domain, (y[:, 0] % 2))


class InplaceBlock(nn.Module):
    """A pre-norm block with nn.ReLU(inplace=True) after a Linear and in-place residual adds."""
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.act, self.fc2 = nn.Linear(D, 4 * D), nn.ReLU(inplace=True), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.n1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        h = self.fc2(self.act(self.fc1(self.n2(x))))
        h += x  # in place on the MLP's output
        return h


class SinusoidalLM(nn.Module):
    """Positions as the original Transformer computes them, in forward (no buffer, no embedding)."""
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, D, 2, device=ids.device, dtype=torch.float32) * (-math.log(10000.0) / D))
        pe = torch.zeros(t, D, device=ids.device)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        x = self.wte(ids) * math.sqrt(D) + pe
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class FakeQuantLinear(nn.Linear):
    """Quantisation-aware training: int8 fake quantisation of the weight with a straight-through
    estimator (w + (q - w).detach())."""
    def forward(self, x):
        scale = self.weight.detach().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        q = torch.round(self.weight / scale).clamp(-127, 127) * scale
        return F.linear(x, self.weight + (q - self.weight).detach(), self.bias)


class QATBlock(Block):
    def __init__(self):
        super().__init__()
        for name in ("qkv", "proj"):
            old = getattr(self, name)
            new = FakeQuantLinear(old.in_features, old.out_features, bias=old.bias is not None)
            setattr(self, name, new)


class CastedLinear(nn.Linear):
    """modded-nanogpt's Linear: the weight cast to the input's dtype in forward."""
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class CastedBlock(Block):
    def __init__(self):
        super().__init__()
        for name in ("qkv", "proj"):
            old = getattr(self, name)
            setattr(self, name, CastedLinear(old.in_features, old.out_features))


class CastedGPT(GPT):
    def __init__(self):
        super().__init__(CastedBlock)
        self.head = CastedLinear(D, V)


def hf_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    cfg = GemmaConfig(vocab_size=V, hidden_size=D, intermediate_size=3 * D, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=H // 2, head_dim=D // H,
                      max_position_embeddings=T, attn_implementation="sdpa")
    return GemmaForCausalLM(cfg)


def hf_phi():
    from transformers import PhiConfig, PhiForCausalLM
    cfg = PhiConfig(vocab_size=V, hidden_size=D, intermediate_size=4 * D, num_hidden_layers=L,
                    num_attention_heads=H, max_position_embeddings=T, partial_rotary_factor=0.5,
                    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, attn_implementation="sdpa")
    return PhiForCausalLM(cfg)


def tuple_batches(n):
    return _tokens(n)


def hf_batches(n):
    return [{"input_ids": x, "labels": x} for x, _ in _tokens(n)]


MODELS = {
    "ce-transposed": (GPT, transposed_loss, tuple_batches),
    "ce-transposed-smooth": (GPT, transposed_smooth_loss, tuple_batches),
    "spectral-norm": (SpectralNet, F.cross_entropy, image_batches),
    "grad-reversal": (DomainAdversarialLM, dann_loss, tuple_batches),
    "inplace": (lambda: GPT(InplaceBlock), lm_loss, tuple_batches),
    "sinusoidal": (SinusoidalLM, lm_loss, tuple_batches),
    "qat-ste": (lambda: GPT(QATBlock), lm_loss, tuple_batches),
    "casted-linear": (CastedGPT, lm_loss, tuple_batches),
    "hf-gemma": (hf_gemma, None, hf_batches),
    "hf-phi": (hf_phi, None, hf_batches),
}
