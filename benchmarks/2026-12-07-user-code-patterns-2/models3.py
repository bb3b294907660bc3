"""A third set of models written the way users write them (none in turbotrain)."""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from models2 import V, D, H, L, T, B, _tokens, lm_loss


class Block(nn.Module):
    """Pre-norm block with torch's own nn.RMSNorm and a fused qkv."""
    def __init__(self, ffn=None, norm=nn.RMSNorm):
        super().__init__()
        self.n1, self.n2 = norm(D), norm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.ffn = ffn if ffn is not None else nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(approximate="tanh"), nn.Linear(4 * D, D))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.n1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.ffn(self.n2(x))


# A. tied head written functionally: F.linear(h, wte.weight) (OLMo, many hand-written GPTs)
class FunctionalHeadLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.RMSNorm(D)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.norm(x), self.wte.weight)


# B. mixture of experts: top-2 routing with data-dependent token counts, load-balancing aux loss,
#    forward(idx, targets) -> (logits, loss) as nanoGPT-style code returns
class MoE(nn.Module):
    def __init__(self, n_exp=4, k=2):
        super().__init__()
        self.k, self.n = k, n_exp
        self.router = nn.Linear(D, n_exp, bias=False)
        self.w1 = nn.ModuleList([nn.Linear(D, 2 * D) for _ in range(n_exp)])
        self.w2 = nn.ModuleList([nn.Linear(2 * D, D) for _ in range(n_exp)])
        self.aux = None

    def forward(self, x):
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        w, idx = probs.topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.n):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = self.w2[e](F.silu(self.w1[e](flat[rows])))
            out.index_add_(0, rows, h * w[rows, slot, None])
        frac = F.one_hot(idx[:, 0], self.n).float().mean(0)
        self.aux = self.n * (frac * probs.mean(0)).sum()
        return out.view(b, t, c)


class MoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(ffn=MoE(), norm=nn.LayerNorm) for _ in range(L)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        aux = sum(blk.ffn.aux for blk in self.blocks)
        return logits, loss + 0.01 * aux


# C. weight-normalised Linears (torch.nn.utils.parametrizations.weight_norm)
class WeightNormLM(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(norm=nn.LayerNorm) for _ in range(L)])
        for blk in self.blocks:
            blk.ffn[0] = weight_norm(blk.ffn[0])
            blk.ffn[2] = weight_norm(blk.ffn[2])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# D. the user compiled the model before handing it over
class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(norm=nn.LayerNorm) for _ in range(L)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def precompiled():
    return torch.compile(_Plain())


# E. the user cast the model to bf16 first (pure-bf16 training, as many fine-tuning scripts do)
def bf16_model():
    return _Plain().to(torch.bfloat16)


def bf16_loss(logits, y):
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


# F. an LSTM language model
class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = nn.LSTM(D, D, num_layers=2, batch_first=True, dropout=0.0)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


# G. a small ResNet with BatchNorm classifying 32x32 images
class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(32), nn.MaxPool2d(2), ResBlock(32), ResBlock(32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def image_batches(n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        y = torch.randint(0, 10, (16,), generator=g)
        x = torch.randn(16, 3, 32, 32, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() / 10
        out.append((x, y))
    return out


def tuple_batches(n):
    return _tokens(n)


def hf_bert_cls():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                     intermediate_size=4 * D, max_position_embeddings=T, num_labels=3)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


def cls_batches(n):
    out = []
    for x, _ in _tokens(n):
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": (x[:, 0] % 3)})
    return out


def hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=V, d_model=D, d_kv=D // H, d_ff=4 * D, num_layers=L, num_heads=H,
                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg)


def s2s_batches(n):
    return [{"input_ids": x, "labels": y.flip(1)} for x, y in _tokens(n)]


MODELS = {
    "functional-head": (FunctionalHeadLM, lm_loss, tuple_batches),
    "moe": (MoELM, None, tuple_batches),
    "weight-norm": (WeightNormLM, lm_loss, tuple_batches),
    "precompiled": (precompiled, lm_loss, tuple_batches),
    "bf16-model": (bf16_model, bf16_loss, tuple_batches),
    "lstm": (LSTMLM, lm_loss, tuple_batches),
    "resnet": (ResNet, F.cross_entropy, image_batches),
    "hf-bert-cls": (hf_bert_cls, None, cls_batches),
    "hf-t5": (hf_t5, None, s2s_batches),
}
