import os, sys, threading, time
import torch
import torch.distributed as dist
from turbotrain import comm
comm.init(backend="gloo", timeout_s=30)
if sys.argv[1] == "nofix":
    import atexit; atexit.unregister(comm.env._drain_at_exit)
entered = threading.Event()
def callback(fut):
    entered.set()
    time.sleep(float(sys.argv[2]))  # still on gloo's thread when the main thread reaches the end
    return fut.value()[0]
t = torch.ones(1)
chained = dist.all_reduce(t, async_op=True).get_future().then(callback)
entered.wait()
print("sum", t.item(), flush=True)
