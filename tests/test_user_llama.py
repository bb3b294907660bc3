"""A Llama written the way Meta's reference code writes one (an RMSNorm class, rotary embeddings as
complex numbers, a FeedForward that calls F.silu, the loss in a user function), trained through the
Engine against the plain loop: the same losses step by step in fp32, and the sites fuse='all' finds
in a model whose names and activations turbotrain has never seen."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from turbotrain import Config, Engine

VOCAB, DIM, LAYERS, HEADS, T, B, STEPS = 128, 64, 2, 4, 16, 4, 4


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(head_dim, length, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(length, head_dim // 2), torch.outer(torch.arange(length).float(), freqs))


def rotate(x, table):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, table):
        b, t, dim = x.shape
        q, k, v = (w(x).view(b, t, self.heads, dim // self.heads) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, table), rotate(k, table)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, dim))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, table):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Sizes as keywords (the defaults are this file's); the ladder builds it at its own shape
    (benchmarks/2026-12-06-avx2-user-llama/compare_user_llama.py)."""

    def __init__(self, vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, hidden=96, max_len=2 * T):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("table", rotary_table(dim // heads, max_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        table = self.table[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, table)
        return self.output(self.norm(h)).float()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (B, T + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


@pytest.fixture(scope="module")
def stock():
    torch.manual_seed(0)
    model = Transformer()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=2e-3)
    losses = []
    for tokens, targets in batches():
        loss = loss_fn(plain(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return model, losses


def engine_losses(model, config):
    model = copy.deepcopy(model)
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=2e-3), loss_fn, config=config)
    return [float(engine.step(b).loss) for b in batches()], engine


def test_fuse_all_finds_every_site_and_trains_as_the_plain_loop(stock):
    model, expected = stock
    losses, engine = engine_losses(model, Config(device="cpu", fuse="all"))
    fused = sorted((s.path, s.pattern) for s in engine.fusion_report.fused)
    assert fused == [(f"layers.{i}.{path}", pattern) for i in range(LAYERS)
                     for path, pattern in (("attention", "qkv"), ("feed_forward", "swiglu"))]
    assert engine._transform("fusion").loss_head.fused
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-6, atol=0)
    assert set(engine.module.state_dict()) == set(model.state_dict())  # the stock layout


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [None, "selective"])
def test_fuse_and_compile_train_as_the_plain_loop(stock, checkpoint):
    torch._dynamo.reset()
    model, expected = stock
    losses, engine = engine_losses(model, Config(device="cpu", fuse="all", compile=True, checkpoint=checkpoint))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-5, atol=0)
    assert engine.step(batches()[0]).recompiles == 0
