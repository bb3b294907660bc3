import sys, time, torch, collections
import torch._inductor.config as ic
ic.cpp.enable_kernel_profile = True
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
torch.manual_seed(0)
row = sys.argv[1]; wl = get_workload(sys.argv[2] if len(sys.argv) > 2 else "gpt")
tr = get_config(row).build(wl, "cpu")
it = wl.batches("train", seed=0)
for _ in range(3): tr.step(next(it))
from torch.profiler import profile, ProfilerActivity
bs = [next(it) for _ in range(3)]
with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
    for b in bs: tr.step(b)
agg = collections.defaultdict(lambda: [0, 0.0])
for e in prof.key_averages():
    agg[e.key] = [e.count, e.self_cpu_time_total / 1e3 / 3]
tot = 0
for k, (n, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:60]:
    print(f"{ms:8.2f} ms/step  x{n/3:5.1f}  {k[:110]}")
