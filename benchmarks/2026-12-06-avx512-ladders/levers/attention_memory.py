"""Tensor peak and step time of one Engine row (ROW, default tt-fused-compile) in one process.

    python attention_memory.py MODE T B [WORKLOAD] [STEPS]

MODE "old" loads a saved copy of fusion/attention.py (the arm before a change, at
/tmp/exp/old_attention.py) in place of the package's _attend; "ckpt" wraps each attention block in
torch.utils.checkpoint (whole recompute); anything else runs the package as it is. Used for the
attention-memory rows of benchmarks/2026-12-06-avx512-ladders.md.
"""
import sys, time, torch, statistics, functools
import turbotrain.fusion.attention as A
from torch.utils.checkpoint import checkpoint
mode, T, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "old":
    import importlib.util
    spec = importlib.util.spec_from_file_location("old_attention", "/tmp/exp/old_attention.py")
    old = importlib.util.module_from_spec(spec); sys.modules["old_attention"] = old; spec.loader.exec_module(old)
    A._attend = old._attend
if mode == "ckpt":
    orig = A._attend
    def _attend(q, k, v, scale, keep=None, bias=None, causal=False):
        fn = lambda q, k, v, keep, bias: orig(q, k, v, scale, keep, bias, causal)
        return checkpoint(fn, q, k, v, keep, bias, use_reentrant=False)
    A._attend = _attend
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
from turbotrain.memory.measure import step_tensor_peak, live_tensor_bytes
torch.manual_seed(0)
wl = get_workload(sys.argv[4] if len(sys.argv) > 4 else "gpt", T=T, B=B)
base = live_tensor_bytes()
import os; tr = get_config(os.environ.get("ROW", "tt-fused-compile")).build(wl, "cpu")
it = wl.batches("train", seed=0)
losses = [float(tr.step(next(it))) for _ in range(3)]
steps = []
for _ in range(int(sys.argv[5]) if len(sys.argv) > 5 else 6):
    b = next(it); t = time.perf_counter(); losses.append(float(tr.step(b))); steps.append(time.perf_counter() - t)
b = next(it)
held = live_tensor_bytes() - base
peak = step_tensor_peak(lambda: tr.step(b))
print(mode, T, B, f"step {statistics.median(steps):.3f} s", f"tensors {(held + peak) / 2**20:.0f} MiB", "loss", losses[-1], [round(s, 3) for s in steps])
