import time, torch, statistics, importlib
m = importlib.import_module("turbotrain.fusion.ops.linear_cross_entropy")
h = torch.randn(2048, 512).bfloat16().requires_grad_()
w = (torch.randn(8192, 512) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, 8192, (2048,))
def run(c):
    loss = m.linear_cross_entropy(h, w, None, t, chunk_rows=c)
    loss.backward()
    h.grad = w.grad = None
cs = [256, 512, 1024, 2048]
res = {c: [] for c in cs}
for c in cs * 2: run(c)
for r in range(12):
    for c in cs:
        t0 = time.perf_counter(); run(c); res[c].append(time.perf_counter() - t0)
for k, v in res.items(): print(k, f"{statistics.median(v)*1e3:.1f} ms")
