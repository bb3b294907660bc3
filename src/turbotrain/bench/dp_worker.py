"""One row of the data-parallel ladder, run on every rank of a torchrun job.

    python -m turbotrain.comm.launch --nproc-per-node=2 --nnodes=1 -m turbotrain.bench.dp_worker SPEC.json RESULT.json

``mode='dp'`` trains through ``Engine(Config(data_parallel=...))``, or with ``parallel`` set through
``Engine(Config(parallel=ParallelConfig(...)))`` (FSDP2, tensor and sequence parallel);
``mode='local'`` trains the same model on the same per-rank batches with no DDP at all, so the two
step times differ only by what data parallelism adds (the exchange and the compression arithmetic). The process group is
started in both modes, but a local job uses it only outside the timed loop: a barrier so both
ranks start together (they share the CPU, as in the dp job) and the gather of step times.

Step time is per optimizer step (all its micro-batches), the slowest rank's for each step: a dp
step ends for everyone when the last rank's exchange does, and taking the same statistic for the
local job keeps the two comparable. Rank 0 writes RESULT.json.

Memory, per rank: ``state bytes`` are the parameters, gradients and optimizer state this rank
holds (each tensor's local shard, each storage counted once), read just before and just after
every optimizer step (gradients exist then, and Adam's moments from the first step on); the job
reports each rank's peak. Not counted: activations, FSDP's transient all-gather buffers, DDP's
gradient buckets. Beside it, the whole process's resident high-water mark (``ru_maxrss``: the
torch libraries, the corpus, activations, everything). With ``max_state_bytes`` the state bytes
are a cap, enforced: at every such check the largest rank's figure is agreed across the ranks and
every rank stops with StateCapExceeded if it is over, before the next forward.

Bytes on the wire (``count_wire``, when the job runs in a network namespace of its own, as the
ladder arranges): rank 0 reads the namespace loopback's transmit counter (``/proc/net/dev``) after a
barrier at the start of the measured steps and after one at their end. Every byte any rank sends
to another crosses that one interface once, so the difference over the measured steps is the
job's whole traffic, whatever sent it: DDP's hooks, 1-bit Adam's collectives, FSDP2's all-gathers
and reduce-scatters, DTensor's, TCP headers included. It needs no cooperation from the code
measured, which is the point: only DDP's hooks count their own payload (``hook_bytes``).

``fuse``, ``compile``, ``bucket_mb``, ``split_batch`` (``turbotrain tune --nproc``): the compute recipe
the single-process search picked, trained under data parallelism as it will be used: its fused
patterns, forward+loss compile, the DDP bucket size, and ``accumulate`` as tune means it (each
batch cut into that many micro-batches, one optimizer step) rather than the ladder's (that many
whole batches per step). Their defaults leave the ladder's jobs as they were.

``sparse_embedding``: the workload's token embedding (``wte``) is built ``sparse=True`` and the
optimizer is what a user writes for one: torch.optim.SparseAdam (the ladder's lr, betas and eps;
it has no weight decay) for the embedding, the ladder's fused AdamW for the rest, stepped as one
(``SteppedTogether``, since the Engine steps one optimizer). dp jobs set
``DataParallelConfig(sparse_embeddings=True)``, so the embedding's touched rows bypass DDP.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError, TurbotrainError
from ..utils import local_shard
from .worker import error_result, write_result

__all__ = ["LadderSpec", "MODES", "run_rank", "main", "state_bytes", "StateMeter", "StateCapExceeded",
           "rss_peak_bytes", "loopback_tx_bytes", "SteppedTogether", "sparse_embedding_optimizer", "split_batch"]

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
    strategy: str = "ring"
    """DataParallelConfig.strategy of a dp job."""
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
    parallel: dict | None = None
    """ParallelConfig fields (e.g. {"dp_shard": -1}): train through Config(parallel=...) instead of DDP."""
    checkpoint: str | None = None
    """Config.checkpoint (activation checkpointing), in dp and local jobs alike."""
    checkpoint_every: int = 1
    """Config.checkpoint_every: with ``checkpoint``, blocks 0, N, 2N, ... only (tune's blocks/2 recipe)."""
    max_state_bytes: int | None = None
    """Cap on any rank's parameter + gradient + optimizer-state bytes; over it the job stops (dp jobs)."""
    count_wire: bool = False
    """Read the loopback's transmit counter around the measured steps (the job has a namespace of its own)."""
    sparse_embedding: bool = False
    """Token embedding sparse=True, stepped by SparseAdam beside AdamW; dp jobs exchange its rows sparsely."""
    fuse: tuple[str, ...] = ()
    """Config.fuse: the fusion patterns applied (dp and local jobs alike)."""
    compile: bool = False
    """Config.compile: forward and loss compiled as one graph."""
    bucket_mb: float = 25.0
    """DataParallelConfig.bucket_mb of a dp job (DDP's default 25 MiB)."""
    split_batch: bool = False
    """Cut each batch into ``accumulate`` micro-batches (tune's accumulate) instead of stepping
    ``accumulate`` whole batches (the ladder's)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not valid; choose one of {MODES}")
        for name in ("accumulate", "steps", "threads", "val_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.parallel is not None and (self.mode != "dp" or self.compression is not None):
            raise ConfigError("parallel= is a dp-mode setting without compression (FSDP and tensor parallel "
                              "exchange their own way); drop compression or parallel")
        if self.sparse_embedding and (self.parallel is not None or self.compression == "onebit"):
            raise ConfigError("sparse_embedding=True trains through DDP with SparseAdam beside AdamW; it does not "
                              "combine with parallel= or compression='onebit' (an optimizer of its own)")
        if self.max_state_bytes is not None and self.max_state_bytes < 1:
            raise ConfigError(f"max_state_bytes={self.max_state_bytes} must be >= 1 (bytes), or None for no cap")

    def parallel_config(self):
        """The ParallelConfig of a parallel row, else None."""
        from ..parallel import ParallelConfig

        return None if self.parallel is None else ParallelConfig(**self.parallel)


class StateCapExceeded(TurbotrainError):
    """A rank's parameters, gradients and optimizer state outgrew LadderSpec.max_state_bytes."""


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds right now.

    Each tensor is taken as its local shard (a DTensor's ``to_local()``) and counted by its storage,
    once however many tensors view it: FSDP's padded shards, tied weights, and a precision mode's
    low-precision parameters beside their FP32 masters are all what they really occupy. A sparse
    gradient counts its indices and values.

    >>> net = torch.nn.Linear(4, 4)   # 20 FP32 parameters
    >>> state_bytes(net, torch.optim.SGD(net.parameters(), lr=0.1))
    80
    """
    params = [*module.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    storages = {}
    for t in map(local_shard, tensors):
        for part in (t._indices(), t._values()) if t.is_sparse else (t,):  # a sparse gradient: its two tensors
            storage = part.untyped_storage()
            storages[(part.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def rss_peak_bytes() -> int:
    """This process's resident-memory high-water mark since it started (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class StateMeter:
    """Reads ``state_bytes`` just before and just after every optimizer step; keeps the peak.

    With ``cap`` it is enforced: the largest rank's figure is agreed across the ranks (one MAX
    all-reduce per check, so every rank stops together instead of one waiting in a collective for a
    rank that stopped) and StateCapExceeded is raised on every rank when it is over.
    """

    def __init__(self, engine, cap: int | None = None):
        self.module, self.optimizer, self.cap = engine.module, engine.optimizer, cap
        self.peak = 0
        self._step = 0
        self._handles = [self.optimizer.register_step_pre_hook(lambda *_: self.check("before")),
                         self.optimizer.register_step_post_hook(lambda *_: self.check("after"))]

    def check(self, when: str) -> None:
        now = state_bytes(self.module, self.optimizer)
        self.peak = max(self.peak, now)
        if when == "after":
            self._step += 1
        if self.cap is None:
            return
        largest = torch.tensor(now, dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if int(largest) > self.cap:
            raise StateCapExceeded(
                f"a rank's parameters + gradients + optimizer state reach {_mb(int(largest))} {when} optimizer "
                f"step {self._step + (when == 'before')} (this rank: {_mb(now)}), over the cap of {_mb(self.cap)} "
                "(--max-state-bytes); shard them over the ranks (the fsdp rows) or raise the cap")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def loopback_tx_bytes(path: str = "/proc/net/dev") -> int | None:
    """Bytes sent so far on the loopback of this process's network namespace; None if unreadable.

    >>> isinstance(loopback_tx_bytes(), (int, type(None)))
    True
    """
    try:
        for line in Path(path).read_text().splitlines():
            name, sep, counters = line.partition(":")
            if sep and name.strip() == "lo":
                return int(counters.split()[8])  # 8 receive columns, then transmit bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


def _wire_mark(spec: LadderSpec) -> int | None:
    """The loopback counter with every rank at the same point (a barrier first); None unless counting."""
    if not spec.count_wire:
        return None
    dist.barrier()
    return loopback_tx_bytes()


class SteppedTogether(torch.optim.Optimizer):
    """Optimizers over disjoint parameters stepped as one, for the Engine, which steps one optimizer.

    Their parameter-group dicts and their state are this object's (shared, not copied), so the
    Engine re-pointing a group at FP32 masters re-points it for the optimizer that steps it.

    >>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    >>> opt = SteppedTogether(torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=0.5))
    >>> a.grad, b.grad = torch.ones(2), torch.ones(2)
    >>> opt.step(); a.tolist(), b.tolist()
    ([0.0, 0.0], [0.5, 0.5])
    """

    def __init__(self, *optimizers: torch.optim.Optimizer):
        super().__init__([group for opt in optimizers for group in opt.param_groups], defaults={})
        self.optimizers = optimizers
        for opt in optimizers:
            opt.state = self.state

    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("SteppedTogether.step takes no closure (it steps several optimizers once each)")
        for opt in self.optimizers:
            opt.step()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.state: share the new one again
        for opt in self.optimizers:
            opt.state = self.state

    def describe(self) -> str:
        return " + ".join(type(opt).__name__ for opt in self.optimizers)


def sparse_embedding_optimizer(model: torch.nn.Module) -> SteppedTogether:
    """Make ``model.wte`` sparse; SparseAdam for it, the ladder's AdamW for every other parameter."""
    from .configs import OPTIMIZER_SETTINGS, make_optimizer

    embedding = getattr(model, "wte", None)
    if not isinstance(embedding, torch.nn.Embedding):
        raise ConfigError(f"sparse_embedding=True needs a model whose token embedding is an nn.Embedding named "
                          f"'wte' (gpt, bert); {type(model).__name__} has none: use the gpt workload")
    embedding.sparse = True
    dense = [p for p in model.parameters() if p is not embedding.weight]
    sparse = torch.optim.SparseAdam([embedding.weight], lr=OPTIMIZER_SETTINGS["lr"],
                                    betas=OPTIMIZER_SETTINGS["betas"], eps=OPTIMIZER_SETTINGS["eps"])
    return SteppedTogether(sparse, make_optimizer(dense))


def split_batch(batch, parts: int) -> list:
    """``batch`` ((inputs, targets), a dict or a tensor) cut into ``parts`` equal micro-batches along rows.

    >>> [t.shape[0] for t in split_batch((torch.zeros(4, 3), torch.zeros(4)), 2)[1]]
    [2, 2]
    """
    if parts == 1:
        return [batch]
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    rows = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()}
    if len(rows) != 1 or next(iter(rows)) % parts:
        raise ConfigError(f"a batch with rows {sorted(rows)} does not split into {parts} equal micro-batches; "
                          f"use an accumulate that divides the batch size")
    pieces = [t.chunk(parts) if isinstance(t, torch.Tensor) and t.dim() else [t] * parts for t in leaves]
    return [torch.utils._pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def _batches(workload, split: str, count: int, seed: int) -> list:
    stream = workload.batches(split=split, seed=seed, device="cpu")
    return [next(stream) for _ in range(count)]


def _build_engine(spec: LadderSpec, workload):
    from .. import Config, DataParallelConfig, Engine
    from .configs import make_optimizer

    torch.manual_seed(spec.seed)
    model = workload.build_model()  # seeded by the workload: the same initial weights on every rank
    dp = None
    if spec.mode == "dp" and spec.parallel is None:
        dp = DataParallelConfig(compression=spec.compression, strategy=spec.strategy, warmup_steps=spec.comm_warmup,
                                powersgd_rank=spec.powersgd_rank, sparse_embeddings=spec.sparse_embedding,
                                bucket_mb=spec.bucket_mb)
    config = Config(precision=spec.precision, accumulate=spec.accumulate, data_parallel=dp,
                    parallel=spec.parallel_config(), checkpoint=spec.checkpoint,
                    checkpoint_every=spec.checkpoint_every, device="cpu",
                    fuse=tuple(spec.fuse), compile=spec.compile)
    optimizer = sparse_embedding_optimizer(model) if spec.sparse_embedding else make_optimizer(model.parameters())
    if spec.mode == "dp" and spec.compression == "onebit":
        from ..comm.ddp import to_onebit_adam

        optimizer = to_onebit_adam(optimizer, spec.comm_warmup)
    return Engine(model, optimizer, workload.loss_fn, config=config)


def _counters(engine) -> tuple[int, int, int, int]:
    c = engine.comm
    return (c.collective_count, c.collective_calls, c.aux_calls, c.bytes_sent) if c is not None else (0, 0, 0, 0)


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN; a diverged run reports None and says so in "diverged"
    return value if math.isfinite(value) else None


def _full(p: torch.Tensor) -> torch.Tensor:
    # a DTensor gathered whole (a collective: every rank calls it in the same order)
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _params_checksum(engine) -> float:
    with torch.no_grad():
        return float(sum(_full(p.detach()).double().sum() for p in engine.module.parameters()))


def _data_parallel_rank(spec: LadderSpec, rank: int, world: int) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel group: the tensor-parallel ranks of a group share rows."""
    cfg = spec.parallel_config()
    if cfg is None:
        return rank, world
    degrees = cfg.resolve(world)
    return rank // degrees.tp, degrees.dp  # tp is the innermost mesh dimension


def _gather_ints(value: int, world: int) -> list[int]:
    out = [None] * world
    dist.all_gather_object(out, int(value))
    return out


def run_rank(spec: LadderSpec) -> dict | None:
    """Train and time this rank's share; rank 0 returns the result dict, other ranks None."""
    from ..comm.env import init
    from ..workloads import get_workload

    torch.set_num_threads(spec.threads)
    info = init(backend="gloo", timeout_s=spec.timeout_s)
    rank, world = info.rank, info.world_size
    workload = get_workload(spec.workload, **spec.overrides)
    total_steps = spec.warmup + spec.steps
    dp_rank, dp_size = _data_parallel_rank(spec, rank, world)
    # Each data-parallel group reads its own stream (seed offset by its index), as a DistributedSampler
    # would split it; a tensor-parallel group's ranks read the same rows.
    per_step = 1 if spec.split_batch else spec.accumulate  # whole batches an optimizer step trains on
    train = _batches(workload, "train", total_steps * per_step, spec.seed * 1000 + dp_rank)
    engine = _build_engine(spec, workload)
    meter = StateMeter(engine, cap=spec.max_state_bytes if spec.mode == "dp" else None)

    times, losses = [], []
    start_counts = _counters(engine)
    dist.barrier()
    wire_start = None
    for step in range(total_steps):
        if step == spec.warmup:
            start_counts = _counters(engine)
            wire_start = _wire_mark(spec)
        t0 = time.perf_counter()
        micro = (split_batch(train[step], spec.accumulate) if spec.split_batch
                 else [train[step * spec.accumulate + m] for m in range(spec.accumulate)])
        step_losses = [engine.step(batch).loss for batch in micro]
        times.append(time.perf_counter() - t0)
        losses.append(float(torch.stack(step_losses).float().mean()))
    end_counts = _counters(engine)
    wire_end = _wire_mark(spec)
    meter.close()

    # Per step, the slowest rank (the ranks' clocks are compared after the loop, off the clock).
    measured = torch.tensor(times[spec.warmup:], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    checksums = [None] * world
    dist.all_gather_object(checksums, _params_checksum(engine))
    val_loss = None
    sharded = spec.parallel is not None
    if spec.mode == "dp" and (rank == 0 or sharded):
        # Every replica holds the same weights (checked below), so rank 0's val loss is the job's;
        # a sharded model's forward is collective, so there every rank evaluates (the same batches).
        val_loss = engine.eval_loss(_batches(workload, "val", spec.val_batches, spec.seed))
    state_peaks = _gather_ints(meter.peak, world)
    rss_peaks = _gather_ints(rss_peak_bytes(), world)
    dist.barrier()
    if rank != 0:
        return None
    finite = all(math.isfinite(c) for c in checksums) and all(math.isfinite(x) for x in losses)
    rounds, calls, aux, hook_bytes = (e - s for e, s in zip(end_counts, start_counts))
    if sharded:  # FSDP's and DTensor's collectives are not counted (CommState counts DDP's hook only)
        rounds = calls = aux = hook_bytes = None
    wire = None if None in (wire_start, wire_end) else wire_end - wire_start
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
        "items_per_step": dp_size * per_step * workload.items_per_batch,
        "data_parallel_size": dp_size,
        "unit": workload.unit,
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad),
        "exchange_rounds": rounds,
        "collective_calls": calls,
        "aux_collectives": aux,
        "hook_bytes": hook_bytes,
        "wire_bytes": wire,
        # In dp mode the replicas must agree exactly; in local mode they are expected to differ.
        "replicas_in_sync": (max(checksums) == min(checksums)) if finite else None,
        "params_checksum": checksums[0] if finite else None,
        "optimizer": engine.optimizer.describe() if isinstance(engine.optimizer, SteppedTogether)
        else type(engine.optimizer).__name__,
        "state_bytes_peak_per_rank": state_peaks,
        "state_bytes_peak": max(state_peaks),
        "rss_peak_bytes_per_rank": rss_peaks,
        "rss_peak_bytes": max(rss_peaks),
        "max_state_bytes": meter.cap,
        "engine": engine.describe(),
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
