import sys, torch, turbotrain, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, "/tmp/foreign3")
from models3 import MODELS
cls, loss_fn, mk = MODELS["bf16-model"]
for prec in ("bf16-master", "fp32"):
    torch.manual_seed(0); model = cls()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng = turbotrain.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn, config=turbotrain.Config(precision=prec))
    for b in mk(6):
        eng.step(b)
    moved = {n: float((p.detach().float() - before[n].float()).abs().max()) for n, p in model.named_parameters()}
    print(prec, {n: (str(p.dtype)[6:], moved[n]) for n, p in model.named_parameters() if "ln" in n or "blocks.0.n" in n})
    # plain bf16 loop
torch.manual_seed(0); model = cls(); opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
for x, y in mk(6):
    loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
print("plain bf16", {n: float((p.detach().float() - before[n].float()).abs().max()) for n, p in model.named_parameters() if "ln" in n or "blocks.0.n" in n})
