"""The fused linear+cross-entropy alone (forward and backward) at a head shape, per chunk size, against
the compiled unfused head + FP32 cross-entropy; bf16 operands, 2 threads; fastest of N after warm-up."""
import sys, time, torch
import torch.nn.functional as F
from turbotrain.fusion.ops.linear_cross_entropy import linear_cross_entropy
torch.set_num_threads(2)
rows, V, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
chunks = [int(c) for c in sys.argv[4].split(",")]
g = torch.Generator().manual_seed(0)
x = (torch.randn(rows, D, generator=g) * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (rows,), generator=g)
def fused(c):
    return lambda: linear_cross_entropy(x, w, None, t, chunk_rows=c)
@torch.compile
def unfused_loss(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)
arms = {f"chunk {c}": fused(c) for c in chunks}
arms["compiled unfused"] = lambda: unfused_loss(x, w, t)
best = {k: float("inf") for k in arms}
for rep in range(6):
    for k, f in arms.items():
        x.grad = w.grad = None
        t0 = time.perf_counter(); loss = f(); loss.backward(); dt = time.perf_counter() - t0
        if rep: best[k] = min(best[k], dt)
for k, v in best.items():
    print(f"{k:18s} {v*1e3:8.1f} ms  ({6 * rows * V * D / v / 1e9:6.1f} GFLOP/s)")
