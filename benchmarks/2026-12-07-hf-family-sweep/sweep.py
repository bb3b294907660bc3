"""For every transformers causal/masked LM family: build at a tiny size via make_auto, train 3 steps
plain fp32 vs Engine(fp32, fuse=True) and Engine(bf16-master, fuse=True); report errors / loss gaps."""
import sys, traceback, time, warnings, logging
import torch
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from transformers.models.auto import modeling_auto as auto
from turbotrain import Config, Engine
from turbotrain.workloads import get_workload
types = sorted(set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES))
if len(sys.argv) > 1: types = [t for t in types if t in sys.argv[1:]] if sys.argv[1] != "--from" else [t for t in types if t >= sys.argv[2]]
S = dict(d=64, n_layer=2, n_head=4, T=32, B=2, vocab_size=512)
for mt in types:
    t0 = time.time()
    try:
        wl = get_workload("hf:" + mt, **S)
    except Exception as e:
        print(f"{mt:28s} BUILD-SKIP {type(e).__name__}: {str(e)[:150]}", flush=True); continue
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in wl.build_model().parameters())
        if n > 50e6:
            print(f"{mt:28s} HUGE {n/1e6:.0f}M params", flush=True); continue
    except Exception as e:
        print(f"{mt:28s} META-FAIL {type(e).__name__}: {str(e)[:150]}", flush=True)
    try:
        it = wl.batches("train", seed=0); data = [next(it) for _ in range(3)]
        torch.manual_seed(0); m = wl.build_model(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ref = []
        for b in data:
            out = m(**b); loss = out.loss; loss.backward(); opt.step(); opt.zero_grad(); ref.append(float(loss))
    except Exception as e:
        print(f"{mt:28s} PLAIN-FAIL {type(e).__name__}: {str(e)[:150]}", flush=True); continue
    res = []
    for name, cfg in (("fp32fuse", Config(precision="fp32", fuse=True)), ("bf16fuse", Config(precision="bf16-master", fuse=True))):
        try:
            torch.manual_seed(0); m = wl.build_model(); eng = Engine(m, torch.optim.AdamW(m.parameters(), lr=1e-3), config=cfg)
            ls = [float(eng.step(b).loss) for b in data]
            fused = sorted({s.pattern for s in eng.fusion_report.fused}) if eng.fusion_report else []
            gap = max(abs(a - b) / abs(b) for a, b in zip(ls, ref))
            res.append(f"{name} gap={gap:.1e} fused={','.join(fused)}" + (" **GAP**" if (gap > 1e-4 and name == 'fp32fuse') or gap > 2e-2 else ""))
        except Exception as e:
            res.append(f"{name} FAIL {type(e).__name__}: {str(e)[:200]}")
    print(f"{mt:28s} {time.time()-t0:5.1f}s ref={ref[0]:.3f} | " + " | ".join(res), flush=True)
