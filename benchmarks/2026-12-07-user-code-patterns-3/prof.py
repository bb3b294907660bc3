import os, sys, torch, turbotrain
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07-user-code-patterns-2"))
from functional_gpt import build, batches, lm_loss
torch.set_num_threads(2)
cfg = turbotrain.Config(precision="auto", fuse=True, compile=True)
eng = turbotrain.Engine(build(), lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True), lm_loss, config=cfg)
bs = batches(12, 0)
for b in bs[:6]: eng.step(b)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for b in bs[6:10]: eng.step(b)
ka = prof.key_averages()
rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)
tot = sum(e.self_cpu_time_total for e in ka)
print(f"total self {tot/4/1e3:.1f} ms/step")
for e in rows[:45]:
    print(f"{e.self_cpu_time_total/4/1e3:8.2f} ms/step  {e.count//4:5d}  {e.key[:110]}")
