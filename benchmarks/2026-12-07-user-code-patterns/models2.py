"""More models written the way users write them (none in turbotrain)."""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

V, D, H, L, T, B = 512, 128, 4, 2, 64, 4


# A. Meta's reference Llama style: complex rotary (view_as_complex), RMSNorm in float, SwiGLU, logits .float()
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D // H
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(b, t, H, self.hd)
        xk = xk.view(b, t, H, self.hd)
        xv = xv.view(b, t, H, self.hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = 3 * D
        self.w1 = nn.Linear(D, hidden, bias=False)
        self.w2 = nn.Linear(hidden, D, bias=False)
        self.w3 = nn.Linear(D, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(D)
        self.ffn_norm = RMSNorm(D)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList([TransformerBlock() for _ in range(L)])
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(D // H, T * 2), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        fc = self.freqs_cis[:t]
        for layer in self.layers:
            h = layer(h, fc)
        return self.output(self.norm(h)).float()


def lm_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


# B. ALBERT-like: one block applied L times (shared weights), user-applied activation checkpointing
class SharedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.act = nn.GELU()

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class SharedLM(nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.block = SharedBlock()
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.ckpt = ckpt

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for _ in range(L + 1):
            x = checkpoint(self.block, x, use_reentrant=False) if self.ckpt and self.training else self.block(x)
        return self.head(self.ln(x))


class CkptLM(SharedLM):
    def __init__(self):
        super().__init__(ckpt=True)


# C. LoRA fine-tuning: frozen base weights and embedding, trainable low-rank adapters
class LoRALinear(nn.Module):
    def __init__(self, i, o, r=8):
        super().__init__()
        self.base = nn.Linear(i, o)
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, i) / math.sqrt(i))
        self.B = nn.Parameter(torch.zeros(o, r))

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * 2.0


class LoRABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v = LoRALinear(D, D), nn.Linear(D, D), LoRALinear(D, D)
        self.o = nn.Linear(D, D)
        self.ff1, self.ff2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        for m in (self.k, self.o, self.ff1, self.ff2, self.ln1, self.ln2):
            m.requires_grad_(False)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (self.q(h), self.k(h), self.v(h)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class LoRALM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.emb.requires_grad_(False)
        self.blocks = nn.Sequential(*[LoRABlock() for _ in range(L)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight.requires_grad_(False)

    def forward(self, ids):
        return self.head(self.ln(self.blocks(self.emb(ids))))


# D. dict batch with its own key names; forward returns a dict with "loss"; dropout in training
class DictLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.1, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.drop = nn.Dropout(0.1)
        self.lm = nn.Linear(D, V)

    def forward(self, tokens, targets=None):
        t = tokens.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), 1)
        logits = self.lm(self.drop(self.enc(self.emb(tokens), mask=mask)))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return out


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, V, (n * B * T + 1,), generator=g)
    # a learnable pattern so the loss falls: next token = (tok * 7 + 3) % V half the time
    for i in range(1, data.numel()):
        if i % 2 == 0:
            data[i] = (data[i - 1] * 7 + 3) % V
    out = []
    for s in range(n):
        chunk = data[s * B * T: (s + 1) * B * T + 1]
        out.append((chunk[:-1].view(B, T), chunk[1:].view(B, T)))
    return out


def tuple_batches(n):
    return _tokens(n)


def dict_batches(n):
    return [{"tokens": x, "targets": y} for x, y in _tokens(n)]


MODELS = {
    "meta-llama": (MetaLlama, lm_loss, tuple_batches),
    "shared": (SharedLM, lm_loss, tuple_batches),
    "user-ckpt": (CkptLM, lm_loss, tuple_batches),
    "lora": (LoRALM, lm_loss, tuple_batches),
    "dict": (DictLM, None, dict_batches),
}


class ReentrantCkptLM(SharedLM):
    def __init__(self):
        super().__init__(ckpt=True)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for _ in range(L + 1):
            x = checkpoint(self.block, x, use_reentrant=True) if self.training else self.block(x)
        return self.head(self.ln(x))


MODELS["user-ckpt-reentrant"] = (ReentrantCkptLM, lm_loss, tuple_batches)
