import os, sys, json, torch
torch.set_num_threads(1)
from turbotrain import comm, Config, Engine
from turbotrain.workloads import get_workload
mode = sys.argv[1]
comm.init(backend="gloo", timeout_s=60)
wl = get_workload("gpt", d=32, n_layer=2, n_head=4, T=16, B=4, vocab_size=512)
rank = int(os.environ["RANK"])
for run in range(2):
    model = wl.build_model()
    e = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), wl.loss_fn, config=Config(device="cpu", data_parallel=True),
               scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5))
    b = wl.batches("train", seed=rank)
    for _ in range(12):
        e.step(next(b))
if mode == "destroy":
    import torch.distributed as dist
    dist.destroy_process_group()
