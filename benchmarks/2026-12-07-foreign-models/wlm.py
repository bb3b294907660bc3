"""A word-language-model Transformer in the style of pytorch/examples (seq-first, log_softmax in the
forward, NLLLoss outside), written here for the check; run through the Engine and compare()."""
import math, sys, time
import torch
from torch import nn
import torch.nn.functional as F

V, D, H, NHID, L, T, B = 8192, 512, 8, 2048, 4, 256, 8


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.0, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Module):
    def __init__(self, ntoken=V, ninp=D, nhead=H, nhid=NHID, nlayers=L, dropout=0.0):
        super().__init__()
        self.ninp = ninp
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.decoder = nn.Linear(ninp, ntoken)
        nn.init.uniform_(self.input_emb.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1)


def nll(output, targets):
    return F.nll_loss(output.view(-1, output.size(-1)), targets.reshape(-1))


def build():
    torch.manual_seed(0)
    return TransformerModel()


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, V, (T + 1, B), generator=g)
        out.append((data[:-1], data[1:]))
    return out


if __name__ == "__main__":
    import turbotrain, turbotrain.bench
    from turbotrain import Config, Engine
    if sys.argv[1] == "engine":
        model = build()
        e = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), nll,
                   config=Config(precision="bf16-master", fuse=True, compile=True))
        print(e.describe())
        bs = batches(8)
        for i, b in enumerate(bs):
            t0 = time.perf_counter(); loss = float(e.step(b).loss); print(i, round(time.perf_counter() - t0, 3), loss)
        print(e.describe())
    else:
        turbotrain.bench.compare(build, batches(16), loss_fn=nll, unit="tokens", out=sys.argv[2],
                                 configs=sys.argv[3], steps=int(sys.argv[4]), rounds=int(sys.argv[5]))
