"""BART from config (models8.py): six steps in Configs against the plain FP32 loop, each step's
relative loss gap. Run with the configs tuple edited to bisect (fp32 + compile, bf16-mixed +
compile, attention="stock" were the others tried)."""
import sys, torch, turbotrain
from models8 import hf_bart, seq2seq_batches
torch.set_num_threads(2)
def plain():
    torch.manual_seed(0); m = hf_bart(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3); out = []
    for b in seq2seq_batches(6):
        torch.manual_seed(1); loss = m(**b).loss; opt.zero_grad(); loss.backward(); opt.step(); out.append(loss.item())
    return out
ref = plain()
for cfg in (dict(precision="auto", compile=True), dict(precision="auto")):
    torch.manual_seed(0); m = hf_bart()
    try:
        e = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), config=turbotrain.Config(**cfg))
        ls = []
        for b in seq2seq_batches(6):
            torch.manual_seed(1); ls.append(float(e.step(b).loss))
        print(cfg, [f"{a/r-1:+.1e}" for a, r in zip(ls, ref)])
    except Exception as ex:
        print(cfg, "ERR", type(ex).__name__, str(ex)[:200])
print([e for e in e.describe().splitlines() if "lm_head" in e or "linear_cross" in e])
