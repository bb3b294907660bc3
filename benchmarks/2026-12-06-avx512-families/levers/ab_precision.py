"""A/B in one process: tt-fused-compile with precision bf16-master vs bf16-mixed, steps alternating."""
import sys, time, statistics, torch
from turbotrain.bench.tt import EngineTrainer
from turbotrain.workloads import get_workload
wl = get_workload(sys.argv[1] if len(sys.argv) > 1 else "gpt")
arms = {}
for prec in ("bf16-master", "bf16-mixed"):
    torch.manual_seed(0)
    arms[prec] = EngineTrainer(wl, "cpu", precision=prec, fuse=("linear_cross_entropy",), compile=True)
its = {k: wl.batches("train", seed=0) for k in arms}
losses = {k: [] for k in arms}
for k, tr in arms.items():
    for _ in range(3): losses[k].append(float(tr.step(next(its[k]))))
times = {k: [] for k in arms}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
    order = list(arms) if r % 2 == 0 else list(arms)[::-1]
    for k in order:
        b = next(its[k]); t = time.perf_counter(); losses[k].append(float(arms[k].step(b))); times[k].append(time.perf_counter() - t)
for k in arms:
    print(k, f"median {statistics.median(times[k]):.4f}", "loss", [round(x, 4) for x in losses[k][-3:]])
a, b = times["bf16-master"], times["bf16-mixed"]
ratios = sorted(x / y for x, y in zip(a, b))
print("master/mixed per-round ratios (>1: mixed faster)", [round(x, 3) for x in ratios])
