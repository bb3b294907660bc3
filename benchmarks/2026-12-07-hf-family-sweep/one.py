import sys, torch, traceback, warnings
warnings.filterwarnings("ignore")
from turbotrain import Config, Engine
from turbotrain.workloads import get_workload
mt = sys.argv[1]; prec = sys.argv[2] if len(sys.argv) > 2 else "bf16-master"
wl = get_workload("hf:" + mt, d=64, n_layer=2, n_head=4, T=32, B=2, vocab_size=512)
it = wl.batches("train", seed=0); b = next(it)
torch.manual_seed(0); m = wl.build_model()
eng = Engine(m, torch.optim.AdamW(m.parameters(), lr=1e-3), config=Config(precision=prec))
try:
    print(float(eng.step(b).loss))
except Exception:
    tb = traceback.format_exc().splitlines(); print("\n".join(tb[-40:]))
