import torch, turbotrain, torch.nn as nn, torch.nn.functional as F, logging, sys
torch.set_num_threads(2)
from torch._dynamo.utils import counters
prec = sys.argv[1] if len(sys.argv) > 1 else "auto"
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.e = nn.Embedding(64, 32); s.l = nn.Linear(32, 32); s.h = nn.Linear(32, 64)
    def forward(s, x):
        h = s.l(s.e(x)); q = h.view(2, 8, 4, 8).transpose(1, 2)
        return s.h(F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 8, 32))
x = torch.randint(0, 64, (2, 8)); y = torch.randint(0, 64, (2, 8))
lf = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
for i in range(11):
    torch.manual_seed(0); m = M()
    eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), lf, config=turbotrain.Config(precision=prec, compile=True))
    before = dict(counters["stats"])
    for _ in range(2): eng.step((x, y))
    print(i, "frames", counters["frames"]["total"], "ok", counters["frames"]["ok"], "unique_graphs", counters["stats"]["unique_graphs"], flush=True)
