import sys; sys.path.insert(0, "/tmp/foreign3")
import torch, turbotrain, warnings
from models5 import GPT, AutocastLM, _tokens, lm_loss
torch.set_num_threads(2)
def plain(cls, steps=6):
    torch.manual_seed(0); m = cls(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3); out = []
    for x, y in _tokens(steps):
        l = lm_loss(m(x), y); opt.zero_grad(); l.backward(); opt.step(); out.append(l.item())
    return out
def tt(cls, cfg, steps=6):
    torch.manual_seed(0); m = cls()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), lm_loss, config=turbotrain.Config(**cfg))
        out = [float(eng.step(b).loss) for b in _tokens(steps)]
    return out, [str(x.message)[:150] for x in w if "advisor" not in str(x.message)]
true = plain(GPT)
dev = lambda a: max(abs(x - y) / y for x, y in zip(a, true))
print("plain autocast-inside vs true fp32:", dev(plain(AutocastLM)))
print("plain autocast-inside logits dtype:", AutocastLM()(torch.zeros(1, 4, dtype=torch.long)).dtype)
for cfg in (dict(precision="fp32"), dict(precision="auto"), dict(precision="bf16-mixed")):
    o, w = tt(AutocastLM, cfg); print(cfg, "tt autocast-inside vs true fp32:", dev(o), w)
o, w = tt(GPT, dict(precision="auto")); print("tt auto, no user autocast vs true fp32:", dev(o))
