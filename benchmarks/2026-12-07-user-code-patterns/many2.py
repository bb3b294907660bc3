import torch, turbotrain, torch.nn as nn, torch.nn.functional as F, warnings
torch.set_num_threads(2)
from torch._dynamo.utils import counters
class M(nn.Module):
    def __init__(s, d):
        super().__init__(); s.e = nn.Embedding(64, d); s.l = nn.Linear(d, d); s.h = nn.Linear(d, 64)
    def forward(s, x):
        return s.h(torch.relu(s.l(s.e(x))))
x = torch.randint(0, 64, (2, 8)); y = torch.randint(0, 64, (2, 8))
lf = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
for i in range(11):
    torch.manual_seed(0); m = M(8 * (i + 1))
    eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), lf, config=turbotrain.Config(precision="fp32", compile=True))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2): eng.step((x, y))
    print(i, "unique_graphs", counters["stats"]["unique_graphs"], "frames ok", counters["frames"]["ok"], [str(x.message)[:90] for x in w if "compil" in str(x.message)], flush=True)
