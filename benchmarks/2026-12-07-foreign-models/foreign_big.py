"""User models not in turbotrain at the ladder's scale, through turbotrain.bench.compare."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, L, T, B = 8192, 512, 8, 4, 256, 8


class EncoderLM(nn.Module):
    """A causal LM on nn.TransformerEncoder (pre-norm, GELU)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(1, T, D) * 0.02)
        layer = nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, V)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.out(self.norm(self.enc(self.emb(ids) + self.pos[:, :t], mask=mask, is_causal=True)))


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, mask):
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.ff(self.n2(x))


class MHAGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.ModuleList([MHABlock() for _ in range(L)])
        self.head = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, V, bias=False))

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(x)


def build_encoder():
    torch.manual_seed(0)
    return EncoderLM()


def build_mha():
    torch.manual_seed(0)
    return MHAGPT()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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

    build = {"encoder": build_encoder, "mha": build_mha}[sys.argv[1]]
    rounds = int(sys.argv[2])
    configs = sys.argv[3]
    compare(build, batches(24, 0), loss_fn=loss_fn, val_batches=batches(4, 1), configs=configs, rounds=rounds,
            out=sys.argv[4], unit="tokens")
