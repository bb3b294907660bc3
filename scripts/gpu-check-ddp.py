#!/usr/bin/env python
"""Engine + DDP on NCCL with each gradient compression and SyncBatchNorm: the nccl-ddp stage of
scripts/gpu-check.sh. Run under torchrun, one process per rank:

    python -m torch.distributed.run --standalone --nproc_per_node=2 scripts/gpu-check-ddp.py

With fewer GPUs than ranks, ranks share GPUs (rank r uses GPU r mod count). NCCL refuses two ranks
on one GPU in most releases; the first collective then fails and rank 0 prints a SKIP line saying
so, instead of a failure. ``--backend gloo`` runs the same checks on CPU (without SyncBatchNorm,
which is CUDA-only), to try this script on a machine without a GPU.

Per compression, rank 0 prints one line; the last line is the result the stage reports:
    gpu-check-ddp: compression=bf16 OK loss 2.10->0.61, parameters equal on 2 ranks, SyncBN stats equal
    gpu-check-ddp: RESULT PASS 4/4 compressions, world 2 on 1 GPU(s), NCCL 2.21.5
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

COMPRESSIONS = (None, "bf16", "fp16", "powersgd")
STEPS = 20
TAG = "gpu-check-ddp:"


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"{TAG} {text}", flush=True)


def start(backend: str) -> tuple[int, int, torch.device, str]:
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if backend == "gloo":
        device, where = torch.device("cpu"), "CPU"
    else:
        count = torch.cuda.device_count()
        device, where = torch.device("cuda", local % count), f"{count} GPU(s)"
        torch.cuda.set_device(device)
    # Made here, not by turbotrain's init(), which refuses more ranks than GPUs: this stage wants
    # NCCL itself to say whether ranks may share a GPU. The Engine then uses this group.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    return rank, world, device, where


def probe(rank: int, world: int, device: torch.device, where: str) -> bool:
    """One all-reduce; False (after printing why) when NCCL refuses ranks sharing a GPU."""
    try:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return float(t) == world
    except Exception as exc:  # NCCL reports a shared GPU as an error of the first collective
        shared = device.type == "cuda" and world > torch.cuda.device_count()
        if not shared:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        say(rank, f"SKIP world {world} on {where}: NCCL refuses ranks that share a GPU ({first[:200]})")
        return False


def model_with_batchnorm() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 8))


def gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def run_one(compression, rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    from turbotrain import Config, DataParallelConfig, Engine

    sync_bn = device.type == "cuda"
    dp = DataParallelConfig(compression=compression, sync_bn=sync_bn, warmup_steps=5)
    model = model_with_batchnorm()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = Engine(model, opt, nn.functional.cross_entropy,
                    config=Config(device=device.type, precision="fp32", data_parallel=dp))
    g = torch.Generator(device="cpu").manual_seed(100 + rank)  # each rank its own data
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 32, generator=g) + 0.5 * rank  # shifted per rank: local BN stats differ
        y = (x @ teacher).argmax(-1)
        losses.append(float(engine.step((x.to(device), y.to(device))).loss))
    mean_loss = torch.tensor([losses[0], sum(losses[-5:]) / 5], device=device)
    dist.all_reduce(mean_loss)
    first, last = (float(v) / world for v in mean_loss)
    problems = []
    if not last < first:
        problems.append(f"loss did not fall ({first:.3f} -> {last:.3f})")
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    spread = max(float((other - flat).abs().max()) for other in gathered(flat, world))
    if spread != 0.0:  # every rank applies the same averaged (decompressed) gradient
        problems.append(f"parameters differ across ranks by up to {spread:.3g}")
    bns = [m for m in engine.module.modules() if isinstance(m, nn.SyncBatchNorm)]
    if sync_bn:
        if not bns:
            problems.append("sync_bn=True left no SyncBatchNorm in the model")
        for bn in bns:
            stats = gathered(bn.running_mean.detach(), world)
            if max(float((s - stats[0]).abs().max()) for s in stats) > 1e-6:
                problems.append("SyncBatchNorm running means differ across ranks (statistics not synced)")
    bn_note = ", SyncBN stats equal" if sync_bn and not problems else ("" if sync_bn else ", SyncBN not checked on CPU")
    if problems:
        return False, f"compression={compression} FAIL: " + "; ".join(problems)
    return True, f"compression={compression} OK loss {first:.2f}->{last:.2f}, parameters equal on {world} ranks{bn_note}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    args = parser.parse_args()
    rank, world, device, where = start(args.backend)
    try:
        if not probe(rank, world, device, where):
            return 0  # a SKIP, said above; the stage reads it from the output
        passed = 0
        for compression in COMPRESSIONS:
            ok, line = run_one(compression, rank, world, device)
            passed += ok
            say(rank, line)
        nccl = ""
        if args.backend == "nccl":
            nccl = ", NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
        verdict = "PASS" if passed == len(COMPRESSIONS) else "FAIL"
        say(rank, f"RESULT {verdict} {passed}/{len(COMPRESSIONS)} compressions, world {world} on {where}{nccl}")
        return 0 if verdict == "PASS" else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
