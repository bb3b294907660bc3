"""distilgpt2's shape from config (6 layers, d768, 12 heads, vocab 50257, n_positions 1024), never
downloaded: transformers' GPT2LMHeadModel with its own labels= loss, T=256, B=8, on the same kind of
learnable token stream as the other pages. Nothing about it is in turbotrain."""
import os
import sys

import torch

V, T, B = 50257, int(os.environ.get("DG_T", "256")), 8


def build():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_positions=1024, n_embd=768, n_layer=6, n_head=12,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, V, (B, 1), generator=g) + torch.arange(T) * 7
        ids = torch.where(torch.rand(B, T, generator=g) < 0.2, torch.randint(0, V, (B, T), generator=g), base % V)
        out.append({"input_ids": ids, "labels": ids})
    return out


if __name__ == "__main__":
    from turbotrain.bench import compare

    compare(build, batches(24, 0), val_batches=batches(3, 1), configs=sys.argv[2],
            rounds=int(sys.argv[1]), out=sys.argv[3], unit="tokens")
