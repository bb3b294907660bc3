import sys, time, traceback, logging
import torch
sys.path.insert(0, "/tmp/foreign")
import turbotrain
from models import MODELS

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(2)
STEPS = 6
CONFIGS = {
    "fp32": dict(precision="fp32"),
    "auto": dict(precision="auto"),
    "fuse": dict(precision="auto", fuse=True),
    "fuse-compile": dict(precision="auto", fuse=True, compile=True),
    "fuse-all": dict(precision="auto", fuse="all"),
    "fuse-all-fp32": dict(precision="fp32", fuse="all"),
    "ckpt": dict(precision="auto", checkpoint="blocks"),
}

def plain(name):
    cls, loss_fn, mk = MODELS[name]
    torch.manual_seed(0); model = cls()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in mk(STEPS):
        out = model(x, y) if loss_fn is None else model(x)
        loss = out[1] if loss_fn is None else loss_fn(out, y)
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    return losses

names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(MODELS)
cfgs = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
for name in names:
    ref = plain(name)
    print(f"== {name} plain fp32: {ref[0]:.4f} -> {ref[-1]:.4f}", flush=True)
    cls, loss_fn, mk = MODELS[name]
    for c in cfgs:
        torch.manual_seed(0); model = cls()
        t0 = time.time()
        try:
            eng = turbotrain.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn, config=turbotrain.Config(**CONFIGS[c]))
            losses = [float(eng.step(b).loss) for b in mk(STEPS)]
            dev = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            print(f"  {c:14s} last {losses[-1]:.4f} max rel dev {dev:.2e} ({time.time()-t0:.1f}s)", flush=True)
            d = eng.describe()
            for line in d.splitlines():
                if "fus" in line.lower() or "attention" in line.lower() or "compile" in line.lower():
                    print("     |", line[:200])
        except Exception as e:
            print(f"  {c:14s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
