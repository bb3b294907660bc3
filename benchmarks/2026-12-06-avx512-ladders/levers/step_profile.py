import sys, time, torch
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
torch.manual_seed(0)
row = sys.argv[1]; wl = sys.argv[2] if len(sys.argv) > 2 else "gpt"
wl = get_workload(wl)
tr = get_config(row).build(wl, "cpu")
it = wl.batches("train", seed=0)
for _ in range(3):
    tr.step(next(it))
from torch.profiler import profile, ProfilerActivity
bs = [next(it) for _ in range(3)]
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    t = time.perf_counter()
    for b in bs: tr.step(b)
    print("wall/step", (time.perf_counter() - t) / 3)
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60, max_shapes_column_width=70))
