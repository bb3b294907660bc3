import sys, time, warnings, logging, traceback, copy
import torch, torch.nn as nn, torch.nn.functional as F
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from turbotrain import Config, Engine
V, T, B, D = 128, 16, 4, 32

class Enc(nn.Module):
    def __init__(s, norm_first=True, act="gelu"):
        super().__init__(); s.emb = nn.Embedding(V, D)
        s.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first), 2)
        s.head = nn.Linear(D, V)
    def forward(s, x):
        m = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return s.head(s.enc(s.emb(x), mask=m, is_causal=True))
class MHA(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(V, D); s.ln = nn.LayerNorm(D); s.att = nn.MultiheadAttention(D, 4, batch_first=True)
        s.ff = nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D)); s.ln2 = nn.RMSNorm(D); s.head = nn.Linear(D, V, bias=False)
        s.head.weight = s.emb.weight  # tied
    def forward(s, x):
        h = s.emb(x); a = s.ln(h); h = h + s.att(a, a, a, need_weights=False, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))[0]
        h = h + s.ff(s.ln2(h)); return s.head(h)
class LSTMLM(nn.Module):
    def __init__(s, cell=nn.LSTM):
        super().__init__(); s.emb = nn.Embedding(V, D); s.rnn = cell(D, D, num_layers=2, batch_first=True); s.head = nn.Linear(D, V)
    def forward(s, x): return s.head(s.rnn(s.emb(x))[0])
class CNN(nn.Module):
    def __init__(s):
        super().__init__()
        s.f = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    def forward(s, x): return s.f(x)
class Func(nn.Module):  # functional style: F.gelu, F.scaled_dot_product_attention, einsum
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(V, D); s.qkv = nn.Linear(D, 3 * D); s.o = nn.Linear(D, D); s.w1 = nn.Linear(D, 64); s.w2 = nn.Linear(64, D); s.n1 = nn.LayerNorm(D); s.n2 = nn.LayerNorm(D); s.head = nn.Linear(D, V)
    def forward(s, x):
        h = s.emb(x); q, k, v = s.qkv(s.n1(h)).view(x.shape[0], x.shape[1], 3, 4, D // 4).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + s.o(a.transpose(1, 2).reshape(h.shape)); h = h + s.w2(F.gelu(s.w1(s.n2(h))))
        return torch.einsum("btd,vd->btv", h, s.head.weight) + s.head.bias
lm_loss = lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
cls_loss = lambda out, y: F.cross_entropy(out.float(), y)
g = torch.Generator().manual_seed(0)
tok = [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(4)]
img = [(torch.randn(B, 3, 16, 16, generator=g), torch.randint(0, 10, (B,), generator=g)) for _ in range(4)]
cases = {"encoder": (lambda: Enc(), tok, lm_loss), "encoder-postln-relu": (lambda: Enc(False, "relu"), tok, lm_loss),
         "mha-tied-rmsnorm": (MHA, tok, lm_loss), "lstm": (LSTMLM, tok, lm_loss), "gru": (lambda: LSTMLM(nn.GRU), tok, lm_loss),
         "cnn-bn": (CNN, img, cls_loss), "functional": (Func, tok, lm_loss)}
for name in (sys.argv[1:] or cases):
    build, data, loss_fn = cases[name]
    torch.manual_seed(0); m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3); ref = []
    for x, y in data:
        l = loss_fn(m(x), y); l.backward(); opt.step(); opt.zero_grad(); ref.append(float(l))
    out = []
    for cfg in (Config(precision="bf16-master", fuse=True), Config(precision="bf16-master", fuse=True, compile=True), Config(precision="bf16-mixed", fuse=True, compile=True)):
        torch._dynamo.reset(); t0 = time.time()
        try:
            torch.manual_seed(0); m = build()
            e = Engine(m, torch.optim.AdamW(m.parameters(), lr=1e-3), loss_fn, config=cfg)
            ls = [float(e.step(b).loss) for b in data]
            fused = sorted({s.pattern for s in e.fusion_report.fused}) if e.fusion_report else []
            gap = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
            out.append(f"{cfg.precision}{'+c' if cfg.compile else ''} gap={gap:.1e} fused={','.join(fused)} {time.time()-t0:.0f}s" + (" **GAP**" if gap > 2e-2 else ""))
        except Exception as ex:
            tb = [l for l in traceback.format_exc().splitlines() if "turbotrain" in l][-1:]
            out.append(f"{cfg.precision}{'+c' if cfg.compile else ''} FAIL {type(ex).__name__}: {str(ex)[:200]} {tb}")
    print(f"{name:20s} | " + " | ".join(out), flush=True)
