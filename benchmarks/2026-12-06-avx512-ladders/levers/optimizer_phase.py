import sys, time, torch, statistics
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
from turbotrain.engine import Engine
torch.manual_seed(0)
row = sys.argv[1]; wln = sys.argv[2] if len(sys.argv) > 2 else "gpt"
wl = get_workload(wln)
tr = get_config(row).build(wl, "cpu")
times = []
orig = Engine._optimizer_step
def timed(self, stats):
    t = time.perf_counter(); orig(self, stats); times.append(time.perf_counter() - t)
Engine._optimizer_step = timed
it = wl.batches("train", seed=0)
for _ in range(3): tr.step(next(it))
times.clear(); steps = []
for _ in range(8):
    b = next(it); t = time.perf_counter(); tr.step(b); steps.append(time.perf_counter() - t)
print(row, wln, f"step {statistics.median(steps)*1e3:.1f} ms, optimizer phase {statistics.median(times)*1e3:.1f} ms", [round(x*1e3,1) for x in times])
