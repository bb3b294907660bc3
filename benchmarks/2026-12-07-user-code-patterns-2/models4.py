"""Two more quick probes: torch's nn.Transformer (encoder-decoder) and ALiBi (a float additive mask to sdpa)."""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from models2 import V, D, H, L, T, B, _tokens, lm_loss


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.tf = nn.Transformer(D, H, L, L, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.out = nn.Linear(D, V)

    def forward(self, src, tgt=None):
        tgt_in = src if tgt is None else tgt
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device)
        return self.out(self.tf(self.emb(src), self.emb(tgt_in), tgt_mask=mask, tgt_is_causal=True))


class AlibiLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.ModuleList([nn.Linear(D, 3 * D) for _ in range(L)])
        self.proj = nn.ModuleList([nn.Linear(D, D) for _ in range(L)])
        self.ln = nn.ModuleList([nn.LayerNorm(D) for _ in range(L)])
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)])
        self.register_buffer("slopes", slopes, persistent=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        b, t = ids.shape
        x = self.emb(ids)
        pos = torch.arange(t, device=ids.device)
        rel = (pos[None, :] - pos[:, None]).float()
        bias = self.slopes[:, None, None] * rel[None]
        bias = bias.masked_fill(rel[None] > 0, float("-inf"))
        for qkv, proj, ln in zip(self.qkv, self.proj, self.ln):
            q, k, v = qkv(ln(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
            x = x + proj(y.transpose(1, 2).reshape(b, t, D))
        return self.head(x)


def tuple_batches(n):
    return _tokens(n)


MODELS = {"seq2seq": (Seq2Seq, lm_loss, tuple_batches), "alibi": (AlibiLM, lm_loss, tuple_batches)}
