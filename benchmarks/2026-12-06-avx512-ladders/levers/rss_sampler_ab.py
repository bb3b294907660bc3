import sys, time, torch, statistics
from turbotrain.bench.tt import EngineTrainer, TT_CONFIGS
from turbotrain.bench.worker import RssSampler
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
from turbotrain.hardware import page_faults
torch.manual_seed(0)
row = sys.argv[1]
wl = get_workload("gpt")
tr = get_config(row).build(wl, "cpu")
it = wl.batches("train", seed=0)
for _ in range(3):
    tr.step(next(it))
def timed(n):
    out = []
    for _ in range(n):
        b = next(it)
        t = time.perf_counter(); l = tr.step(b); out.append(time.perf_counter() - t); float(l)
    return out
s = RssSampler().__enter__(); s.pause()
res = {"plain": [], "sampler": []}
for r in range(6):
    res["plain"] += timed(2)
    s.resume(); res["sampler"] += timed(2); s.pause()
for k, v in res.items():
    print(row, k, f"median {statistics.median(v):.3f}", " ".join(f"{x:.3f}" for x in v))
