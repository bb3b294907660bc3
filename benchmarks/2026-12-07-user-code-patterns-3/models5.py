"""A fifth set: the losses users write around a head, GQA via sdpa's enable_gqa, attention dropout,
a ViT, autocast written inside forward, a keyword-only forward (none in turbotrain)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from models2 import V, D, H, L, T, B, _tokens, lm_loss
from models3 import Block, image_batches


class GPT(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.blocks = nn.ModuleList([block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def smooth_loss(logits, y):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), label_smoothing=0.1)


def z_loss(logits, y):
    flat = logits.view(-1, V).float()
    return F.cross_entropy(flat, y.view(-1)) + 1e-4 * torch.logsumexp(flat, -1).pow(2).mean()


_W = torch.linspace(0.5, 1.5, V)


def weighted_loss(logits, y):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), weight=_W)


def sum_loss(logits, y):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum") / y.numel()


def fp32_loss(logits, y):
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


class GQABlock(nn.Module):
    """Llama-style grouped-query attention through sdpa's own enable_gqa (no repeat_kv)."""
    def __init__(self, kv=2, dropout=0.0):
        super().__init__()
        self.kv, self.dropout = kv, dropout
        self.n1, self.n2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, kv * D // H, bias=False)
        self.v = nn.Linear(D, kv * D // H, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, 3 * D, bias=False)
        self.gate = nn.Linear(D, 3 * D, bias=False)
        self.down = nn.Linear(3 * D, D, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, H, c // H).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv, c // H).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv, c // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != H,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DropBlock(GQABlock):
    def __init__(self):
        super().__init__(kv=H, dropout=0.1)


class AutocastLM(GPT):
    """The user already wrote autocast into forward (a common 'mixed precision' tutorial)."""
    def forward(self, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(ids)


class KwOnlyLM(GPT):
    def forward(self, *, input_ids, labels=None):
        logits = super().forward(input_ids)
        loss = None if labels is None else lm_loss(logits, labels)
        return {"logits": logits, "loss": loss}


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=L,
                    num_attention_heads=H, intermediate_size=4 * D, num_labels=10,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def vit_batches(n):
    return [{"pixel_values": x, "labels": y} for x, y in image_batches(n)]


def tuple_batches(n):
    return _tokens(n)


def kw_batches(n):
    return [{"input_ids": x, "labels": y} for x, y in _tokens(n)]


MODELS = {
    "label-smoothing": (GPT, smooth_loss, tuple_batches),
    "z-loss": (GPT, z_loss, tuple_batches),
    "class-weights": (GPT, weighted_loss, tuple_batches),
    "sum-reduction": (GPT, sum_loss, tuple_batches),
    "fp32-loss": (GPT, fp32_loss, tuple_batches),
    "gqa": (lambda: GPT(GQABlock), lm_loss, tuple_batches),
    "attn-dropout": (lambda: GPT(DropBlock), lm_loss, tuple_batches),
    "autocast-inside": (AutocastLM, lm_loss, tuple_batches),
    "kw-only": (KwOnlyLM, None, kw_batches),
    "hf-vit": (hf_vit, None, vit_batches),
}
