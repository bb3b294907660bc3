"""A sixth set: outputs and losses shaped the way other codebases shape them (none in turbotrain)."""
from dataclasses import dataclass
from typing import Optional
import torch
import torch.nn as nn
import torch.nn.functional as F
from models2 import V, D, H, L, T, B, _tokens, lm_loss
from models3 import Block
from models5 import GPT

PAD = 0


@dataclass
class LMOutput:  # a plain dataclass, not transformers' ModelOutput
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


class DataclassLM(GPT):
    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return LMOutput(logits, loss)


class TwoHeads(GPT):
    """Multi-task: next token and a 7-way tag per position, each with its own Linear; loss sums both."""
    def __init__(self):
        super().__init__()
        self.tag = nn.Linear(D, 7)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        h = self.norm(x)
        return self.head(h), self.tag(h)


def two_loss(out, y):
    lm, tag = out
    return lm_loss(lm, y) + 0.5 * F.cross_entropy(tag.flatten(0, 1), (y % 7).flatten())


class LastToken(GPT):
    """Sequence classification on a causal LM's last position, loss on logits[:, -1]."""


def last_loss(logits, y):
    return F.cross_entropy(logits[:, -1], y[:, -1])


class PaddedLM(nn.Module):
    """Padding: nn.Embedding(padding_idx), a boolean key-padding mask to sdpa, loss ignoring PAD."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=PAD)
        self.pos = nn.Embedding(T, D)
        self.qkv = nn.ModuleList([nn.Linear(D, 3 * D) for _ in range(L)])
        self.o = nn.ModuleList([nn.Linear(D, D) for _ in range(L)])
        self.ln = nn.ModuleList([nn.LayerNorm(D) for _ in range(L)])
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        b, t = ids.shape
        keep = ids != PAD
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=ids.device)  # a padded row still sees itself
        x = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        for qkv, o, ln in zip(self.qkv, self.o, self.ln):
            q, k, v = qkv(ln(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            x = x + o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, D))
        return self.head(x)


def pad_loss(logits, y):
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=PAD)


def padded_batches(n):
    out = []
    for i, (x, y) in enumerate(_tokens(n)):
        x, y = x.clone(), y.clone()
        x[x == PAD] = 1
        y[y == PAD] = 1
        cut = 40 + 5 * (i % 4)  # right padding, a different length each batch
        x[: B // 2, cut:] = PAD
        y[: B // 2, cut - 1:] = PAD
        out.append((x, y))
    return out


def distill_batches(n):
    g = torch.Generator().manual_seed(5)
    return [(x, {"y": y, "teacher": torch.randn(B, T, V, generator=g)}) for x, y in _tokens(n)]


def distill_loss(logits, t):
    """Hinton distillation: KL to a teacher's softened distribution plus the hard-label loss."""
    kd = F.kl_div(F.log_softmax(logits / 2.0, -1), F.softmax(t["teacher"] / 2.0, -1), reduction="batchmean") * 4.0
    return 0.5 * kd + 0.5 * lm_loss(logits, t["y"])


class UNetish(nn.Module):
    """A tiny denoiser: conv + GroupNorm + SiLU, down and up, MSE on the predicted noise."""
    def __init__(self, c=32):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1))
        self.mid = nn.Sequential(nn.GroupNorm(8, 2 * c), nn.SiLU(), nn.Conv2d(2 * c, 2 * c, 3, padding=1))
        self.up = nn.Sequential(nn.GroupNorm(8, 2 * c), nn.SiLU(), nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1))
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, x):
        h0 = self.inp(x)
        h = self.up(self.mid(self.down(h0)))
        return self.out(torch.cat([h, h0], 1))


def noise_batches(n):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        clean = torch.randn(8, 3, 32, 32, generator=g).cumsum(-1) / 8
        noise = torch.randn(8, 3, 32, 32, generator=g)
        out.append((clean + 0.5 * noise, noise))
    return out


def tuple_batches(n):
    return _tokens(n)


def hf_batches(n):
    return [{"input_ids": x, "labels": y} for x, y in _tokens(n)]


MODELS = {
    "dataclass-output": (DataclassLM, None, hf_batches),
    "two-heads": (TwoHeads, two_loss, tuple_batches),
    "last-token": (LastToken, last_loss, tuple_batches),
    "padded": (PaddedLM, pad_loss, padded_batches),
    "distill": (GPT, distill_loss, distill_batches),
    "unet-mse": (UNetish, F.mse_loss, noise_batches),
}
