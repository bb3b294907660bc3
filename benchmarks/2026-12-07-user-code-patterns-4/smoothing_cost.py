"""What label smoothing and class weights cost the fused linear+cross-entropy alone (forward and
backward) at a head shape, against plain cross-entropy in the same kernel and the compiled unfused
head computing the same smoothed loss; bf16 operands, 2 threads, arms interleaved, fastest of N
after warm-up.

    python smoothing_cost.py ROWS VOCAB DIM [REPS]
"""
import sys
import time

import torch
import torch.nn.functional as F

from turbotrain.fusion.ops.linear_cross_entropy import linear_cross_entropy

torch.set_num_threads(2)
rows, V, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
g = torch.Generator().manual_seed(0)
x = (torch.randn(rows, D, generator=g) * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (rows,), generator=g)
cw = torch.rand(V, generator=g) + 0.5


@torch.compile
def unfused_smoothed(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t, label_smoothing=0.1)


arms = {
    "fused, plain": lambda: linear_cross_entropy(x, w, None, t),
    "fused, smoothing 0.1": lambda: linear_cross_entropy(x, w, None, t, label_smoothing=0.1),
    "fused, smoothing + class weights": lambda: linear_cross_entropy(x, w, None, t, label_smoothing=0.1,
                                                                     class_weight=cw),
    "compiled unfused, smoothing 0.1": lambda: unfused_smoothed(x, w, t),
}
best = {k: float("inf") for k in arms}
for rep in range(reps):
    for k, f in arms.items():
        x.grad = w.grad = None
        t0 = time.perf_counter()
        f().backward()
        dt = time.perf_counter() - t0
        if rep:
            best[k] = min(best[k], dt)
for k, v in best.items():
    print(f"{k:34s} {v * 1e3:8.1f} ms  ({6 * rows * V * D / v / 1e9:6.1f} GFLOP/s)")
