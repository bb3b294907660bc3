"""Isolated: (bf16 grad -> FP32 copy, fused AdamW, FP32 -> bf16 copy) vs one compiled pass."""
import time, statistics, torch
from turbotrain.workloads import get_workload
torch.manual_seed(0)
model = get_workload("gpt").build_model()
shapes = [p.shape for p in model.parameters()]
print(len(shapes), "params", sum(p.numel() for p in model.parameters()) / 1e6, "M")
def make():
    masters = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    low = [m.detach().bfloat16() for m in masters]
    grads = [torch.randn(s).bfloat16() for s in shapes]
    return masters, low, grads
mA, lA, gA = make()
optA = torch.optim.AdamW(mA, lr=1e-3, fused=True)
def arm_a():
    for m, g in zip(mA, gA):
        if m.grad is None: m.grad = torch.empty_like(m)
    torch._foreach_copy_([m.grad for m in mA], gA)
    optA.step()
    torch._foreach_copy_(lA, [m.data for m in mA])
mB, lB, gB = make()
eA = [torch.zeros(s) for s in shapes]; eB = [torch.zeros(s) for s in shapes]
step_t = torch.zeros(())
@torch.compile(fullgraph=True)
def fused(masters, low, grads, m1, m2, step, lr, b1, b2, eps, wd):
    step += 1
    bc1 = 1 - b1 ** step; bc2 = 1 - b2 ** step
    for p, lo, g, a, s in zip(masters, low, grads, m1, m2):
        g = g.float()
        p.mul_(1 - lr * wd)
        a.lerp_(g, 1 - b1)
        s.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (s.sqrt() / bc2.sqrt()).add_(eps)
        p.addcdiv_(a, denom, value=-(lr / bc1))
        lo.copy_(p)
lr = torch.tensor(1e-3)
def arm_b():
    with torch.no_grad():
        fused([m.data for m in mB], lB, gB, eA, eB, step_t, lr, 0.9, 0.999, 1e-8, 0.01)
for f in (arm_a, arm_b): 
    for _ in range(3): f()
ta, tb = [], []
for _ in range(15):
    t = time.perf_counter(); arm_a(); ta.append(time.perf_counter() - t)
    t = time.perf_counter(); arm_b(); tb.append(time.perf_counter() - t)
print(f"copy+fused adamw+copy {statistics.median(ta)*1e3:.2f} ms; one compiled pass {statistics.median(tb)*1e3:.2f} ms")
