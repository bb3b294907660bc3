import sys; sys.path.insert(0, "/tmp/foreign3")
import torch, torch.nn.functional as F, turbotrain
from models5 import GPT, V, _tokens
torch.set_num_threads(2)
def sum_loss(logits, y): return F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum") / y.numel()
def scaled(logits, y): return F.cross_entropy(logits.view(-1, V), y.view(-1)) * 0.99
for fn in (sum_loss, scaled):
  for cfg in (dict(precision="fp32", fuse=True), dict(precision="auto", fuse=True), dict(precision="auto", fuse=True, compile=True)):
    torch.manual_seed(0); m = GPT()
    eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), fn, config=turbotrain.Config(**cfg))
    ls = [float(eng.step(b).loss) for b in _tokens(4)]
    torch.manual_seed(0); m2 = GPT(); opt = torch.optim.AdamW(m2.parameters(), lr=1e-3); ref = []
    for x, y in _tokens(4):
        l = fn(m2(x), y); opt.zero_grad(); l.backward(); opt.step(); ref.append(l.item())
    print(fn.__name__, cfg, max(abs(a-b)/b for a, b in zip(ls, ref)))
    print([l for l in eng.describe().splitlines() if "head" in l][0][:200])
