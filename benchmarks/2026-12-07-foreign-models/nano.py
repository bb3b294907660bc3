"""nanoGPT (its model.py's structure, written here from its description) through turbotrain.bench.compare."""
import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, L, T, B = 8192, 512, 8, 4, 256, 8


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(D), CausalSelfAttention(), nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, D), wpe=nn.Embedding(T, D),
                                              h=nn.ModuleList([Block() for _ in range(L)]), ln_f=nn.LayerNorm(D)))
        self.lm_head = nn.Linear(D, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


def build():
    torch.manual_seed(0)
    return GPT()


def batches(n, seed):
    # a repeating pattern with noise, so the loss moves in a few hundred steps
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, V, (B, 1), generator=g) + torch.arange(T + 1) * 7
        ids = torch.where(torch.rand(B, T + 1, generator=g) < 0.2, torch.randint(0, V, (B, T + 1), generator=g), base % V)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


if __name__ == "__main__":
    from turbotrain.bench import compare

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    configs = sys.argv[2] if len(sys.argv) > 2 else "fp32-eager,torch-compile-step,tt-compile,tt-fused-compile"
    out = sys.argv[3] if len(sys.argv) > 3 else "nano-out"
    compare(build, batches(24, 0), val_batches=batches(4, 1), configs=configs, rounds=rounds, out=out, unit="tokens")
