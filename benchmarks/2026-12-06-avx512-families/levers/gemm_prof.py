"""Per-shape GEMM time in-step for rows; compares to isolated timing of the same shapes."""
import sys, os, time, collections, torch
from torch.profiler import profile, ProfilerActivity
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
rows = sys.argv[1].split(",")
torch.manual_seed(0)
wl = get_workload("gpt")
trs = {r: get_config(r).build(wl, "cpu") for r in rows}
it = wl.batches("train", seed=0)
for r, tr in trs.items():
    for _ in range(3): tr.step(next(it))
res = {}
for r, tr in trs.items():
    b = next(it)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for _ in range(2): tr.step(b)
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm", "aten::matmul", "aten::linear") and e.name in ("aten::mm","aten::addmm","aten::bmm"):
            key = (e.name, str(e.input_shapes[:3]))
            agg[key][0] += 1; agg[key][1] += e.cpu_time_total / 1e3
    res[r] = agg
    tot = sum(v[1] for v in agg.values()) / 2
    print(f"== {r}: GEMM ms/step {tot:.1f}")
    for k, (n, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"   {k[0]:12s} {k[1]:60s} calls/step {n/2:5.1f}  ms each {ms/n:7.3f}")
