"""Compiled fastest-row config over a list of families: bf16-master + fuse + compile vs plain fp32 eager."""
import sys, time, warnings, logging, traceback
import torch
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from turbotrain import Config, Engine
from turbotrain.workloads import get_workload
S = dict(d=64, n_layer=2, n_head=4, T=32, B=2, vocab_size=512)
for mt in sys.argv[1:]:
    t0 = time.time()
    try:
        torch._dynamo.reset()
        wl = get_workload("hf:" + mt, **S)
        it = wl.batches("train", seed=0); data = [next(it) for _ in range(4)]
        torch.manual_seed(0); m = wl.build_model(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ref = []
        for b in data:
            l = m(**b).loss; l.backward(); opt.step(); opt.zero_grad(); ref.append(float(l))
        torch.manual_seed(0); m = wl.build_model()
        eng = Engine(m, torch.optim.AdamW(m.parameters(), lr=1e-3), config=Config(precision="bf16-master", fuse=True, compile=True))
        res = [eng.step(b) for b in data]
        ls = [float(r.loss) for r in res]
        gap = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
        rec = eng.step(data[0]).recompiles
        print(f"{mt:22s} {time.time()-t0:5.0f}s gap={gap:.1e} recompiles={rec}" + (" **GAP**" if gap > 5e-3 else ""), flush=True)
    except Exception as e:
        tb = traceback.format_exc().splitlines()
        where = [l for l in tb if "turbotrain" in l][-1:] 
        print(f"{mt:22s} FAIL {type(e).__name__}: {str(e)[:300]} {where}", flush=True)
