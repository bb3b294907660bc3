import time, torch, statistics
import importlib; m = importlib.import_module("turbotrain.fusion.ops.linear_cross_entropy")
new_acc = m._accumulate
def old_acc(total, part): total += part
h = torch.randn(2048, 512).bfloat16().requires_grad_()
w = (torch.randn(8192, 512) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, 8192, (2048,))
def run():
    loss = m.linear_cross_entropy(h, w, None, t)
    loss.backward()
    h.grad = w.grad = None
res = {"old": [], "new": []}
for name, acc in [("old", old_acc), ("new", new_acc)] * 2:
    m._accumulate = acc; run()
for r in range(15):
    for name, acc in [("old", old_acc), ("new", new_acc)]:
        m._accumulate = acc
        t0 = time.perf_counter(); run(); res[name].append(time.perf_counter() - t0)
for k, v in res.items(): print(k, f"{statistics.median(v)*1e3:.1f} ms")
