"""One row of the data-parallel ladder, run on every rank of a torchrun job.

    python -m turbotrain.comm.launch --nproc-per-node=2 --nnodes=1 -m turbotrain.bench.dp_worker SPEC.json RESULT.json

``mode='dp'`` trains through ``Engine(Config(data_parallel=...))``; ``mode='local'`` trains the
same model on the same per-rank batches with no DDP at all, so the two step times differ only by
what data parallelism adds (the exchange and the compression arithmetic). The process group is
started in both modes, but a local job uses it only outside the timed loop: a barrier so both
ranks start together (they share the CPU, as in the dp job) and the gather of step times.

Step time is per optimizer step (all its micro-batches), the slowest rank's for each step: a dp
step ends for everyone when the last rank's exchange does, and taking the same statistic for the
local job keeps the two comparable. Rank 0 writes RESULT.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .worker import error_result, write_result

__all__ = ["LadderSpec", "MODES", "run_rank", "main"]

MODES = ("dp", "local")


@dataclass(frozen=True)
class LadderSpec:
    """Everything one torchrun job needs; the ladder writes it as JSON."""

    row: str
    """Ladder row this job measures (e.g. 'ddp+powersgd'), or the local key for local jobs."""
    mode: str
    """'dp' (Engine with data_parallel) or 'local' (the same Engine without it)."""
    workload: str = "gpt"
    overrides: dict = field(default_factory=dict)
    """Workload settings changed from its defaults."""
    precision: str = "bf16-master"
    compression: str | None = None
    accumulate: int = 1
    comm_warmup: int = 2
    """DataParallelConfig.warmup_steps: uncompressed steps before PowerSGD / 1-bit start."""
    powersgd_rank: int = 4
    steps: int = 8
    """Measured optimizer steps."""
    warmup: int = 3
    """Untimed optimizer steps first (>= comm_warmup + 1, so every timed step is compressed)."""
    seed: int = 0
    val_batches: int = 4
    threads: int = 1
    timeout_s: float = 300.0
    """Bound on every collective, so a rank that dies fails the job instead of hanging it."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not valid; choose one of {MODES}")
        for name in ("accumulate", "steps", "threads", "val_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")


def _batches(workload, split: str, count: int, seed: int) -> list:
    stream = workload.batches(split=split, seed=seed, device="cpu")
    return [next(stream) for _ in range(count)]


def _build_engine(spec: LadderSpec, workload):
    from .. import Config, DataParallelConfig, Engine
    from .configs import make_optimizer

    torch.manual_seed(spec.seed)
    model = workload.build_model()  # seeded by the workload: the same initial weights on every rank
    dp = None
    if spec.mode == "dp":
        dp = DataParallelConfig(compression=spec.compression, warmup_steps=spec.comm_warmup,
                                powersgd_rank=spec.powersgd_rank)
    config = Config(precision=spec.precision, accumulate=spec.accumulate, data_parallel=dp, device="cpu")
    optimizer = make_optimizer(model.parameters())
    if spec.mode == "dp" and spec.compression == "onebit":
        from ..comm.ddp import to_onebit_adam

        optimizer = to_onebit_adam(optimizer, spec.comm_warmup)
    return Engine(model, optimizer, workload.loss_fn, config=config)


def _counters(engine) -> tuple[int, int, int]:
    c = engine.comm
    return (c.collective_count, c.collective_calls, c.aux_calls) if c is not None else (0, 0, 0)


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN; a diverged run reports None and says so in "diverged"
    return value if math.isfinite(value) else None


def _params_checksum(engine) -> float:
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in engine.module.parameters()))


def run_rank(spec: LadderSpec) -> dict | None:
    """Train and time this rank's share; rank 0 returns the result dict, other ranks None."""
    from ..comm.env import init
    from ..workloads import get_workload

    torch.set_num_threads(spec.threads)
    info = init(backend="gloo", timeout_s=spec.timeout_s)
    rank, world = info.rank, info.world_size
    workload = get_workload(spec.workload, **spec.overrides)
    total_steps = spec.warmup + spec.steps
    # Each rank reads its own stream (seed offset by rank), as a DistributedSampler would split it.
    train = _batches(workload, "train", total_steps * spec.accumulate, spec.seed * 1000 + rank)
    engine = _build_engine(spec, workload)

    times, losses = [], []
    start_counts = _counters(engine)
    dist.barrier()
    for step in range(total_steps):
        if step == spec.warmup:
            start_counts = _counters(engine)
        t0 = time.perf_counter()
        step_losses = [engine.step(train[step * spec.accumulate + m]).loss for m in range(spec.accumulate)]
        times.append(time.perf_counter() - t0)
        losses.append(float(torch.stack(step_losses).float().mean()))
    end_counts = _counters(engine)

    # Per step, the slowest rank (the ranks' clocks are compared after the loop, off the clock).
    measured = torch.tensor(times[spec.warmup:], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    checksums = [None] * world
    dist.all_gather_object(checksums, _params_checksum(engine))
    val_loss = None
    if spec.mode == "dp" and rank == 0:
        # Every replica holds the same weights (checked below), so rank 0's val loss is the job's.
        val_loss = engine.eval_loss(_batches(workload, "val", spec.val_batches, spec.seed))
    dist.barrier()
    if rank != 0:
        return None
    finite = all(math.isfinite(c) for c in checksums) and all(math.isfinite(x) for x in losses)
    rounds, calls, aux = (e - s for e, s in zip(end_counts, start_counts))
    return {
        "status": "ok",
        "step_seconds": measured.tolist(),
        "warmup_step_seconds": times[:spec.warmup],
        "losses": [_finite_or_none(x) for x in losses],
        "val_loss": None if val_loss is None else _finite_or_none(val_loss),
        "diverged": not finite or (val_loss is not None and not math.isfinite(val_loss)),
        "world_size": world,
        "backend": info.backend,
        "threads": torch.get_num_threads(),
        "micro_batches_per_step": spec.accumulate,
        "items_per_step": world * spec.accumulate * workload.items_per_batch,
        "unit": workload.unit,
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad),
        "exchange_rounds": rounds,
        "collective_calls": calls,
        "aux_collectives": aux,
        # In dp mode the replicas must agree exactly; in local mode they are expected to differ.
        "replicas_in_sync": (max(checksums) == min(checksums)) if finite else None,
        "optimizer": type(engine.optimizer).__name__,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m turbotrain.bench.dp_worker SPEC.json RESULT.json (under torchrun)", file=sys.stderr)
        return 2
    spec_path, result_path = map(Path, argv)
    spec = LadderSpec(**json.loads(spec_path.read_text()))
    try:
        result = run_rank(spec)
        rc = 0
    except Exception as exc:  # rank 0 records why; torchrun then stops the other ranks
        if int(os.environ.get("RANK", "0")) != 0:
            raise
        result = error_result(exc)
        rc = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result is not None:
        write_result(result, spec, result_path)
    return rc


if __name__ == "__main__":
    sys.exit(main())
