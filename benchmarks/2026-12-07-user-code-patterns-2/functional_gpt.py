"""A GPT whose head is its tied embedding written out, Gemma's reference style
(``torch.matmul(h, self.wte.weight.t())``: no nn.Linear produces the logits), torch's nn.RMSNorm,
a fused qkv, trained with a loss_fn on (inputs, targets) batches, at the ladder's scale."""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, L, B = 8192, 512, 8, 4, 8
T = int(os.environ.get("FG_T", "256"))  # FG_T=1024 for the memory rows (read by the bench's workers too)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.n1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.n2(x)), approximate="tanh"))


class TiedGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        nn.init.normal_(self.wte.weight, std=0.02)
        self.wpe = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.RMSNorm(D)

    def forward(self, ids):
        x = self.wte(ids) * D ** 0.5 + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return torch.matmul(self.norm(x), self.wte.weight.t())


def lm_loss(logits, y):
    if os.environ.get("FG_LOSS") == "sum":  # summed, over the tokens scored (accumulation-correct loops)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum") / y.numel()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def build():
    torch.manual_seed(0)
    return TiedGPT()


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, V, (B, 1), generator=g) + torch.arange(T + 1) * 7
        ids = torch.where(torch.rand(B, T + 1, generator=g) < 0.2, torch.randint(0, V, (B, T + 1), generator=g), base % V)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


if __name__ == "__main__":
    from turbotrain.bench import compare

    compare(build, batches(24, 0), val_batches=batches(4, 1), loss_fn=lm_loss, configs=sys.argv[2],
            rounds=int(sys.argv[1]), out=sys.argv[3], unit="tokens")
