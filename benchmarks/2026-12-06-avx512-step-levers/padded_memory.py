"""Tensor peak (and a few untimed-for-comparison steps) of HF Llama on right-padded batches, one arm per process:
tt-fused-compile with attention auto (plain) or stock, and torch-compile-step.  usage: padded_memory.py ARM [T]"""
import sys, time, statistics, torch
from turbotrain.workloads import get_workload
from turbotrain.memory.measure import step_tensor_peak, live_tensor_bytes
arm = sys.argv[1]; T = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
wl = get_workload("hf-llama", T=T)
base = live_tensor_bytes()
torch.manual_seed(0)
if arm == "peer":
    from turbotrain.bench.configs import get_config
    tr = get_config("torch-compile-step").build(wl, "cpu")
else:
    from turbotrain.bench.tt import EngineTrainer
    tr = EngineTrainer(wl, "cpu", precision="bf16-master", fuse=("linear_cross_entropy",), compile=True, attention=arm)
it = wl.batches("train", seed=0)
def padded(b):
    b = dict(b); m = b["attention_mask"].clone(); lab = b["labels"].clone()
    n = m.shape[1]
    for r in range(m.shape[0]):
        keep = n - (r * n // 16)  # row r loses r/16 of its tail: 0-44% padding
        m[r, keep:] = 0; lab[r, keep:] = -100
    b["attention_mask"] = m; b["labels"] = lab
    return b
bs = [padded(next(it)) for _ in range(8)]
losses = [float(tr.step(bs[i])) for i in range(2)]
ts = []
for i in range(2, 6):
    t = time.perf_counter(); losses.append(float(tr.step(bs[i]))); ts.append(time.perf_counter() - t)
held = live_tensor_bytes() - base
peak = held + step_tensor_peak(lambda: tr.step(bs[6]))
print(f"{arm}: step median {statistics.median(ts):.3f} s {[round(x, 3) for x in ts]}  tensor peak {peak / 2**20:,.0f} MiB  losses {[round(x, 4) for x in losses]}")
