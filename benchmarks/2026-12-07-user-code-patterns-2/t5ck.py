import sys, torch, turbotrain, warnings, traceback
warnings.simplefilter("ignore")
sys.path.insert(0, "/tmp/foreign3")
from models3 import MODELS
cls, loss_fn, mk = MODELS["hf-t5"]
for prec in sys.argv[1].split(","):
    m = cls()
    if len(sys.argv) > 2: m.config.dropout_rate = 0.0; [setattr(mm, "p", 0.0) for mm in m.modules() if isinstance(mm, torch.nn.Dropout)]
    eng = turbotrain.Engine(m, lambda p: torch.optim.AdamW(p, lr=1e-3), None, config=turbotrain.Config(precision=prec, checkpoint="blocks"))
    try:
        for b in mk(2): print(prec, float(eng.step(b).loss))
        print(eng.describe())
    except Exception as e:
        print(prec, "FAILED", type(e).__name__, str(e)[:300])
