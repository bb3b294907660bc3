import torch, time
from torch.profiler import profile, ProfilerActivity
from turbotrain.fusion.ops.linear_cross_entropy import linear_cross_entropy
torch.set_num_threads(2)
rows, V, D, c = 2048, 50257, 768, 1024
g = torch.Generator().manual_seed(0)
x = (torch.randn(rows, D, generator=g) * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (rows,), generator=g)
for _ in range(2):
    linear_cross_entropy(x, w, None, t, chunk_rows=c).backward()
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(2):
        x.grad = w.grad = None
        linear_cross_entropy(x, w, None, t, chunk_rows=c).backward()
for e in sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
    print(f"{e.self_cpu_time_total/2/1e3:8.1f} ms {e.count//2:4d} {e.key[:90]}")
