import sys, time, statistics, torch
import turbotrain.fusion.attention as A
blk = None if sys.argv[1] == "none" else int(sys.argv[1])
init = A.PlainAttentionMode.__init__
A.PlainAttentionMode.__init__ = lambda self, block=blk: init(self, block)
from turbotrain.bench.tt import EngineTrainer
from turbotrain.workloads import get_workload
wl = get_workload("gpt"); torch.manual_seed(0)
tr = EngineTrainer(wl, "cpu", precision="bf16-master", fuse=("linear_cross_entropy",), compile=True)
it = wl.batches("train", seed=0)
for _ in range(3): tr.step(next(it))
ts = []; 
for _ in range(10):
    b = next(it); t = time.perf_counter(); l = float(tr.step(b)); ts.append(time.perf_counter() - t)
print("block", sys.argv[1], f"median {statistics.median(ts):.4f}", "loss", round(l, 4))
