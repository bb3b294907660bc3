"""Per-rank CPU tensor memory of gpt sharded by the Engine, built eagerly and on the meta device.

The figures of docs/parallel.md ("Building on the meta device", **Memory**):

    .venv/bin/python scripts/measure-fsdp-build-memory.py               # 2 ranks, build + Engine(...)
    .venv/bin/python scripts/measure-fsdp-build-memory.py --steps 1     # ... + the first step
    .venv/bin/python scripts/measure-fsdp-build-memory.py --steps 1 --ranks 4

Each build runs in its own spawn of gloo ranks on the CPU: gpt d=512, 8 layers, vocabulary 8192
(128.5 MiB of FP32 parameters), handed to Engine(..., Config(parallel=ParallelConfig())) with an AdamW
factory; with --steps, that many steps on the rank's rows of a T=128, B=2 batch (with more than two
ranks, every rank takes the first row). Printed per rank: the peak of
``turbotrain.memory.measure.step_tensor_peak`` over all of that (the CPU tensor bytes allocated, net of
frees, at their high-water mark), what is still held afterwards (``live_tensor_bytes``) and the process's
resident high-water mark (ru_maxrss, which counts what the allocator kept too). The peak moves from run
to run in steps of a block's unsharded weights; what is held does not.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.multiprocessing as mp

SHAPE = dict(d=512, n_layer=8, n_head=8, T=128, B=2, vocab_size=8192)


def _rank(rank: int, world: int, port: int, build: str, steps: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from turbotrain import Config, Engine, comm
    from turbotrain.memory.measure import live_tensor_bytes, step_tensor_peak
    from turbotrain.parallel import ParallelConfig, reset_parameters
    from turbotrain.workloads import get_workload

    comm.init(backend="gloo", timeout_s=120)
    wl = get_workload("gpt", **SHAPE)
    x, y = next(iter(wl.batches("train", 0)))
    batch = (x.chunk(world)[rank], y.chunk(world)[rank]) if world <= 2 else (x[:1], y[:1])
    made = []

    def run():
        if build == "meta":
            with torch.device("meta"):
                model = wl.build_model()
            torch.manual_seed(0)
            init = lambda m: (reset_parameters(m), m._init_weights(len(m.blocks)))  # noqa: E731 (gpt's recipe)
        else:
            model, init = wl.build_model(), None
        engine = Engine(model, lambda params: torch.optim.AdamW(params, lr=1e-3), wl.loss_fn,
                        config=Config(parallel=ParallelConfig(), device="cpu"), init_weights=init)
        for _ in range(steps):
            engine.step(batch)
        made.append(engine)

    before = live_tensor_bytes()
    peak = step_tensor_peak(run)
    shards = sum(p.to_local().numel() * p.element_size() for p in made[0].module.parameters())
    full = sum(p.numel() * p.element_size() for p in made[0].module.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    queue.put((rank, peak, live_tensor_bytes() - before, rss, shards, full))
    torch.distributed.destroy_process_group()


def measure(build: str, world: int, steps: int) -> list[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, build, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="steps to train after Engine(...)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.ranks} gloo ranks, build + Engine(...) + {args.steps} step(s); "
          "MiB per rank")
    for build in ("eager", "meta"):
        for rank, peak, held, rss, shards, full in measure(build, args.ranks, args.steps):
            print(f"{build:5s} rank {rank}: peak {peak / 2**20:.1f}, held after {held / 2**20:.1f}, max RSS "
                  f"{rss / 2**20:.0f} (shards {shards / 2**20:.1f}, whole model {full / 2**20:.1f})")


if __name__ == "__main__":
    main()
