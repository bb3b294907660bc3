"""Record each GEMM in a tt step (shape, strides, dtype, out?) with its in-step time; then replay each alone."""
import sys, time, collections, torch
from torch.utils._python_dispatch import TorchDispatchMode
from turbotrain.bench.configs import get_config
from turbotrain.workloads import get_workload
row = sys.argv[1] if len(sys.argv) > 1 else "tt-fused-compile"
torch.manual_seed(0)
wl = get_workload("gpt"); tr = get_config(row).build(wl, "cpu"); it = wl.batches("train", seed=0)
for _ in range(3): tr.step(next(it))
MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.out, torch.ops.aten.bmm.out}
recs = []
class Trace(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MM:
            t0 = time.perf_counter(); r = func(*args, **kwargs); dt = time.perf_counter() - t0
            sig = (str(func), tuple((tuple(a.shape), tuple(a.stride()), str(a.dtype)[6:]) for a in args if isinstance(a, torch.Tensor)),
                   "out" in kwargs)
            recs.append((sig, dt)); return r
        return func(*args, **kwargs)
b = next(it)
for _ in range(2):
    with Trace(): tr.step(b)
agg = collections.defaultdict(list)
for sig, dt in recs: agg[sig].append(dt)
def replay(sig):
    f, ins, out = sig
    ts = []
    for shape, stride, dt in ins:
        dtype = getattr(torch, dt)
        base = torch.randn(max(1, sum((s - 1) * st for s, st in zip(shape, stride)) + 1)).to(dtype) * 0.1
        ts.append(base.as_strided(shape, stride))
    op = eval("torch.ops." + f.replace(".default", ".default").replace(".out", ".out"))
    if out:
        o = ts[-1]; args = ts[:-1]; call = lambda: op(*args, out=o)
    else: call = lambda: op(*ts)
    for _ in range(3): call()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter(); call(); best = min(best, time.perf_counter() - t0)
    return best
tot_in = tot_iso = 0
for sig, dts in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
    n = len(dts) / 2; ins = sum(dts) / 2
    iso = replay(sig) * n
    tot_in += ins; tot_iso += iso
    print(f"{sig[0][10:]:14s} x{n:4.0f} in-step {ins*1e3:7.1f} ms  alone {iso*1e3:7.1f} ms  ratio {ins/iso:5.2f}  {sig[1]} out={sig[2]}")
print(f"TOTAL in-step {tot_in*1e3:.1f} ms  alone {tot_iso*1e3:.1f} ms")
