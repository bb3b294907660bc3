#!/usr/bin/env python
"""Engine + FSDP2 on NCCL: the fsdp2 stage of scripts/gpu-check.sh.

    python scripts/gpu-check-fsdp.py [--nproc 2] [--backend nccl|gloo]

Started plainly, this script is its own launcher: it runs itself on ``--nproc`` ranks (through
turbotrain's loopback-only torchrun). With fewer GPUs than ranks the ranks share GPUs (rank r uses
GPU r mod count); where NCCL refuses ranks sharing a GPU (most releases), rank 0 says so and the
launcher runs the check again on one rank, which still drives ``fully_shard``, the bf16
``MixedPrecisionPolicy`` and DCP through NCCL on the GPU, only without a second shard.
``--backend gloo`` runs the same checks on CPU ranks, to try the script without a GPU.

On every rank: a small turbotrain gpt under ``Config(precision="bf16-master",
parallel=ParallelConfig())`` for 20 steps on learnable counting sequences, then a sharded
``engine.save`` loaded into a fresh Engine; on two ranks also tensor + sequence parallel (its
vocabulary-parallel loss) and context parallel (``cp=2``), 20 steps each, the loss falling. Rank 0 prints the checks and, last, the result line:
    gpu-check-fsdp: RESULT PASS fsdp2 world 2 on 1 GPU(s): loss 6.24->1.10, state 0.50x unsharded, ...
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile

TAG = "gpu-check-fsdp:"
REFUSED = "NCCL refuses ranks that share a GPU"
STEPS, LR = 20, 3e-3
SHAPE = dict(d=128, n_layer=2, n_head=4, T=64, B=16, vocab_size=512)  # 8 rows a rank: aligned for bf16


# -- the launcher ------------------------------------------------------------------------------
def launch(args) -> int:
    """Run the check on ``--nproc`` ranks; on one if NCCL refuses ranks that share a GPU."""
    from turbotrain.comm.launch import torchrun_command

    for nproc in dict.fromkeys((args.nproc, 1)):
        cmd = torchrun_command(nproc, os.path.abspath(__file__), ["--backend", args.backend])
        print(f"{TAG} launching {nproc} rank(s): {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        refused = False
        for line in proc.stdout:  # streamed, so a stage killed at its limit still has the log
            sys.stdout.write(line)
            sys.stdout.flush()
            refused |= REFUSED in line
        rc = proc.wait()
        if not refused or nproc == 1:
            return rc
        print(f"{TAG} NOTE {nproc} ranks on one GPU were refused; checking FSDP2 on 1 rank instead", flush=True)
    return 1


# -- on every rank -----------------------------------------------------------------------------
def say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"{TAG} {text}", flush=True)


def start(backend: str):
    import torch
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if backend == "gloo":
        device, where = torch.device("cpu"), "CPU"
    else:
        count = torch.cuda.device_count()
        device, where = torch.device("cuda", local % count), f"{count} GPU(s)"
        torch.cuda.set_device(device)
    # Made here, not by turbotrain's init() (which refuses more ranks than GPUs): NCCL itself is to say
    # whether ranks may share a GPU. The Engine's ParallelTransform then uses this group.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    return rank, world, device, where


def probe(rank: int, world: int, device, where: str) -> bool:
    """One all-reduce; False (after printing why) when NCCL refuses ranks sharing a GPU."""
    import torch
    import torch.distributed as dist

    try:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return float(t) == world
    except Exception as exc:  # NCCL reports a shared GPU as an error of the first collective
        if not (device.type == "cuda" and world > torch.cuda.device_count()):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        say(rank, f"SKIP world {world} on {where}: {REFUSED} ({first[:200]})")
        return False


def counting_batch(step: int, device):
    """Rows that count up by a stride mod 512 (next token learnable from the two before), same on every rank."""
    import torch

    g = torch.Generator().manual_seed(step)
    b, t, v = SHAPE["B"], SHAPE["T"], SHAPE["vocab_size"]
    start = torch.randint(0, v, (b, 1), generator=g)
    stride = torch.randint(1, 8, (b, 1), generator=g)
    ids = (start + stride * torch.arange(t + 1)) % v
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def full_state(engine) -> dict:
    """Every weight and Adam moment gathered whole (collectives: all ranks call it), keyed by name."""
    def whole(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = whole(p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = whole(engine.optimizer.state[p][key])
    return out


def build(device, parallel=None):
    import torch

    from turbotrain import Config, Engine
    from turbotrain.parallel import ParallelConfig
    from turbotrain.workloads import get_workload

    wl = get_workload("gpt", **SHAPE)
    model = wl.build_model()  # seeded: the same weights on every rank
    config = Config(device=device.type, precision="bf16-master", parallel=parallel or ParallelConfig())
    return Engine(model, torch.optim.AdamW(model.parameters(), lr=LR), wl.loss_fn, config=config), wl


#: The splits checked besides FSDP2 when there are two ranks: every rank trains on the same rows.
SPLITS = {"tp+sp": dict(dp_shard=1, tp=2, sequence_parallel=True),  # vocabulary-parallel loss (loss_parallel)
          "cp": dict(dp_shard=1, cp=2)}                             # attention by all-to-all over heads


def check_split(name: str, rank: int, world: int, device) -> str | None:
    """Tensor + sequence parallel, or context parallel, on two ranks for STEPS steps: None, or what went wrong."""
    import torch
    import torch.distributed as dist

    from turbotrain.parallel import ParallelConfig

    engine, _ = build(device, ParallelConfig(**SPLITS[name]))
    losses = []
    for step in range(STEPS):
        loss = engine.step(counting_batch(step, device)).loss.detach().float()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    first, last = losses[0], sum(losses[-5:]) / 5
    if not (torch.isfinite(torch.tensor(losses)).all() and last < first):
        return f"{name}: loss did not fall ({first:.3f} -> {last:.3f})"
    return None


def check(rank: int, world: int, device, where: str) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from turbotrain import Engine
    from turbotrain.bench.dp_worker import state_bytes

    engine, wl = build(device)
    rows = slice(rank * SHAPE["B"] // world, (rank + 1) * SHAPE["B"] // world)  # this rank's share
    losses = []
    for step in range(STEPS):
        x, y = counting_batch(step, device)
        loss = engine.step((x[rows], y[rows])).loss.detach().float()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    problems = []
    first, last = losses[0], sum(losses[-5:]) / 5
    if not (torch.isfinite(torch.tensor(losses)).all() and last < first):
        problems.append(f"loss did not fall ({first:.3f} -> {last:.3f})")
    params = list(engine.module.parameters())
    if not all(isinstance(p, DTensor) for p in params):
        problems.append("some parameters are not DTensor shards")
    if any(p.dtype != torch.float32 or p.device.type != device.type for p in params):
        problems.append("the shards are not FP32 on the rank's device (bf16-master keeps FP32 masters)")
    n = sum(p.numel() for p in params)
    # after the step the gradients are dropped: 12 bytes a parameter unsharded (FP32 weight + 2 Adam moments)
    ratio = state_bytes(engine.module, engine.optimizer) / (12 * n)
    if ratio > 1.1 / world:  # padding of odd shards and the replicated step counters: 10% of room
        problems.append(f"rank holds {ratio:.2f}x the unsharded weights + Adam state, expected ~{1 / world:.2f}")
    # A sharded checkpoint on this device, into a fresh Engine.
    shared = [tempfile.mkdtemp(prefix="gpu-check-fsdp-") if rank == 0 else None]
    dist.broadcast_object_list(shared)
    path = os.path.join(shared[0], "ckpt")
    engine.save(path)
    model2 = wl.build_model()
    fresh = Engine.load(path, model2, torch.optim.AdamW(model2.parameters(), lr=LR), wl.loss_fn,
                        config=engine.config)
    if fresh.steps != STEPS:
        problems.append(f"the reloaded Engine counts {fresh.steps} steps, not {STEPS}")
    want, got = full_state(engine), full_state(fresh)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    if differ or want.keys() != got.keys():
        problems.append(f"the reloaded weights or Adam moments differ: {', '.join(differ[:3]) or 'other keys'}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    splits = "tp+sp and cp not run (one rank)"
    if world == 2:
        problems += [p for p in (check_split(name, rank, world, device) for name in SPLITS) if p]
        splits = "tp+sp (loss_parallel) and cp trained"
    if problems:
        return False, f"fsdp2 world {world} on {where}: " + "; ".join(problems)
    return True, (f"fsdp2 world {world} on {where}: loss {first:.2f}->{last:.2f} in {STEPS} bf16-master steps, "
                  f"weights + Adam state {ratio:.2f}x unsharded per rank, sharded checkpoint reloaded exactly; "
                  f"{splits}")


def run_rank(backend: str) -> int:
    import torch
    import torch.distributed as dist

    rank, world, device, where = start(backend)
    try:
        if not probe(rank, world, device, where):
            return 0  # said above; the launcher runs one rank instead
        ok, line = check(rank, world, device, where)
        nccl = ", NCCL " + ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else ""
        say(rank, f"RESULT {'PASS' if ok else 'FAIL'} {line}{nccl}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under a launcher)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return run_rank(args.backend)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
