import sys, time, logging, os, importlib
import torch
sys.path.insert(0, "/tmp/foreign3")
import turbotrain
MODELS = importlib.import_module(os.environ.get("MODELS_MODULE", "models3")).MODELS  # models4: the last two

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(2)
STEPS = 6
CONFIGS = {
    "fp32": dict(precision="fp32"),
    "auto": dict(precision="auto"),
    "fuse": dict(precision="auto", fuse=True),
    "compile": dict(precision="auto", compile=True),
    "fuse-compile": dict(precision="auto", fuse=True, compile=True),
    "fuse-all": dict(precision="auto", fuse="all"),
    "fuse-all-fp32": dict(precision="fp32", fuse="all"),
    "ckpt": dict(precision="auto", checkpoint="blocks"),
}

def loss_of(model, b, loss_fn):
    if isinstance(b, dict):
        out = model(**b)
        return out["loss"] if isinstance(out, dict) else out.loss
    x, y = b
    if loss_fn is None:
        return model(x, y)[1]
    return loss_fn(model(x), y)

def plain(name):
    cls, loss_fn, mk = MODELS[name]
    torch.manual_seed(0); model = cls()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for b in mk(STEPS):
        torch.manual_seed(1)
        loss = loss_of(model, b, loss_fn)
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    return losses, model

names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(MODELS)
cfgs = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
for name in names:
    ref, ref_model = plain(name)
    print(f"== {name} plain fp32: {ref[0]:.4f} -> {ref[-1]:.4f}", flush=True)
    cls, loss_fn, mk = MODELS[name]
    for c in cfgs:
        torch.manual_seed(0); model = cls()
        t0 = time.time()
        try:
            eng = turbotrain.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn, config=turbotrain.Config(**CONFIGS[c]))
            losses = []
            for b in mk(STEPS):
                torch.manual_seed(1)
                losses.append(float(eng.step(b).loss))
            dev = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
            moved = [n for n, p in model.named_parameters() if not p.requires_grad
                     and not torch.equal(p.detach().float(), dict(ref_model.named_parameters())[n].detach().float())]
            print(f"  {c:14s} last {losses[-1]:.4f} max rel dev {dev:.2e} ({time.time()-t0:.1f}s)"
                  + (f" frozen {len(frozen)} moved {len(moved)}" if frozen else ""), flush=True)
            d = eng.describe()
            for line in d.splitlines():
                if any(w in line.lower() for w in ("fus", "attention", "compile", "checkpoint", "refus", "not ")):
                    print("     |", line[:220])
        except Exception as e:
            print(f"  {c:14s} FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
