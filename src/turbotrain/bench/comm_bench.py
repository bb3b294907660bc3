"""``turbotrain comm-bench``: nccl-tests style bandwidth of the four collectives DDP-like training uses.

Conventions (those of nccl-tests, so the figures compare with theirs):
* ``size`` is the bytes of the full buffer: the all_reduce/broadcast tensor, the all_gather
  output, the reduce_scatter input. ``count`` is that in elements.
* ``algbw = size / time``; ``busbw = algbw * factor`` with factor 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather and reduce_scatter, 1 for broadcast: the traffic each rank's link
  carries in a bandwidth-optimal algorithm, comparable to the link's own speed.
* ``time`` is the median over iterations of the slowest rank's time for one collective.

Run ``turbotrain comm-bench --nproc 2 --backend gloo`` on a laptop; outside a launcher the command
re-runs itself under torchrun (``turbotrain.comm.launch``), and every rank calls ``run_bench``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_flat, reduce_scatter_flat
from ..errors import ConfigError, check_choice, check_number
from ..utils import atomic_write, sync_device
from .stats import percentile

__all__ = ["OPS", "DTYPES", "CommBenchSettings", "bus_factor", "parse_size", "size_sweep", "under_launcher",
           "run_bench", "format_table"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each link carries per byte of ``size``."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ConfigError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, name: str = "size") -> int:
    """'64', '4K', '1M', '2G', '1.5MiB' (binary units) -> bytes; ConfigError for anything else.

    >>> parse_size("64M")
    67108864
    """
    match = _SIZE.match(str(text).strip().upper())
    if not match:
        raise ConfigError(f"{name} {text!r} is not a size; write bytes with an optional binary unit, "
                          "e.g. 1024, 1K, 64M or 1G")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise ConfigError(f"{name} {text!r} is less than one byte")
    return size


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric sizes from ``min_bytes`` up to and including ``max_bytes``."""
    sizes, size = [], max(1, min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


@dataclass(frozen=True)
class CommBenchSettings:
    """One comm-bench run; validated before any process starts."""

    backend: str = "auto"
    """'auto' (NCCL on GPUs, else gloo), 'gloo' or 'nccl'."""
    ops: tuple[str, ...] = OPS
    min_bytes: int = 1 << 10
    max_bytes: int = 16 << 20
    factor: int = 4
    """Size multiplier between rows."""
    iters: int = 20
    warmup: int = 3
    dtype: str = "float32"
    link_gbps: float | None = None
    """Link speed in Gbit/s, printed as the busbw limit."""
    out: str | None = None
    """Where rank 0 writes the rows as JSON."""

    def __post_init__(self):
        check_choice("--backend", self.backend, ("auto", "gloo", "nccl"))
        if not self.ops:
            raise ConfigError(f"--ops is empty; give a comma list from {', '.join(OPS)}")
        for op in self.ops:
            check_choice("--ops entry", op, OPS)
        check_number("--min-bytes", self.min_bytes, integer=True, minimum=1)
        check_number("--max-bytes", self.max_bytes, integer=True, minimum=self.min_bytes)
        check_number("--factor", self.factor, integer=True, minimum=2)
        check_number("--iters", self.iters, integer=True, minimum=1)
        check_number("--warmup", self.warmup, integer=True, minimum=0)
        check_choice("--dtype", self.dtype, tuple(DTYPES))
        if self.link_gbps is not None:
            check_number("--link-gbps", self.link_gbps, minimum=0, exclusive=True)


def _buffers(op: str, count: int, world: int, dtype, device):
    """(input, output) for one collective whose full buffer is ``count`` elements."""
    rank = dist.get_rank()
    if op in ("all_reduce", "broadcast"):
        t = torch.full((count,), float(rank + 1), dtype=dtype, device=device)
        return t, t
    if op == "all_gather":
        return torch.full((count // world,), float(rank + 1), dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device)
    return torch.full((count,), float(rank + 1), dtype=dtype, device=device), torch.empty(count // world, dtype=dtype, device=device)


def _run_once(op: str, inp, out) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "all_gather":
        all_gather_flat(out, inp)
    else:
        reduce_scatter_flat(out, inp)


def _wrong(op: str, out: torch.Tensor, world: int, count: int) -> int:
    """Elements that differ from the known answer of one untimed run (nccl-tests' #wrong)."""
    if op == "broadcast":
        expect = torch.ones_like(out)
    elif op == "all_gather":
        expect = torch.arange(1, world + 1, dtype=out.dtype, device=out.device).repeat_interleave(count // world)
    else:  # sums of rank+1
        expect = torch.full_like(out, world * (world + 1) / 2)
    return int((out.float() != expect.float()).sum())


def measure(op: str, size: int, dtype, device, iters: int, warmup: int) -> dict | None:
    """One row: median/p20/p80 of the slowest rank's time; None if the size does not split evenly."""
    world = dist.get_world_size()
    elem = torch.tensor([], dtype=dtype).element_size()
    count = (size // elem) // world * world
    if count == 0:
        return None
    inp, out = _buffers(op, count, world, dtype, device)
    _run_once(op, inp, out)
    sync_device(device)
    wrong = _wrong(op, out, world, count)
    for _ in range(warmup):
        _run_once(op, inp, out)
    sync_device(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        _run_once(op, inp, out)
        sync_device(device)
        times.append(time.perf_counter() - start)
    # Slowest rank per iteration: a collective is only done when every rank is.
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    median = statistics.median(times)
    nbytes = count * elem
    algbw = nbytes / median / 1e9
    return {
        "op": op, "size": nbytes, "count": count, "type": str(dtype).removeprefix("torch."),
        "redop": "sum" if op in ("all_reduce", "reduce_scatter") else "none",
        "time_us": median * 1e6, "p20_us": percentile(times, 20) * 1e6, "p80_us": percentile(times, 80) * 1e6,
        "algbw": algbw, "busbw": algbw * bus_factor(op, world), "wrong": wrong,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"#{'size':>11} {'count':>12} {'type':>9} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}\n"
            f"#{'(B)':>11} {'(elements)':>12} {'':>9} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    lines = [head]
    for r in rows:
        lines.append(f" {r['size']:>11} {r['count']:>12} {r['type']:>9} {r['redop']:>6} {r['time_us']:>10.1f} "
                     f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7}")
    return "\n".join(lines)


def _environment(info) -> dict:
    return {
        "device": str(info.device) if info.device.type == "cpu" else torch.cuda.get_device_name(info.device),
        "backend": info.backend, "world_size": info.world_size, "host": platform.node(),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if info.backend == "nccl" else None},
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }


def run_bench(settings: CommBenchSettings) -> int:
    """Inside a launched job: measure on every rank, print the tables and write the rows on rank 0.

    Returns 1 if any collective gave a wrong answer, else 0.
    """
    from ..comm.env import init

    info = init(None if settings.backend == "auto" else settings.backend)
    env = _environment(info)
    dtype = DTYPES[settings.dtype]
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sizes = size_sweep(settings.min_bytes, settings.max_bytes, settings.factor)
    rows = []
    if info.is_main:
        print("# comm-bench: " + json.dumps(env))
        print("# time = median of the slowest rank; busbw = algbw x nccl-tests bus factor")
        if settings.link_gbps:
            print(f"# link limit: {settings.link_gbps:g} Gbit/s = {settings.link_gbps / 8:.3f} GB/s of busbw")
    for op in settings.ops:
        op_rows = [r for r in (measure(op, s, dtype, info.device, settings.iters, settings.warmup) for s in sizes) if r]
        if info.is_main:
            print(f"\n# {op}  (bus factor {bus_factor(op, info.world_size):.3f})")
            print(format_table(op_rows))
        for r in op_rows:
            config = {k: r[k] for k in ("op", "size", "count", "type", "redop")}
            config.update(backend=info.backend, world_size=info.world_size)
            rows.append({
                "workload": "comm-bench", "config": config, "metric": "busbw", "unit": "GB/s",
                "median": r["busbw"], "p20": r["busbw"] * r["time_us"] / r["p80_us"],
                "p80": r["busbw"] * r["time_us"] / r["p20_us"],
                "time_us": r["time_us"], "algbw": r["algbw"], "busbw": r["busbw"], "wrong": r["wrong"],
                "limit_GBps": settings.link_gbps / 8 if settings.link_gbps else None,
                "device": env["device"], "versions": env["versions"], "timestamp": stamp,
            })
    if info.is_main and settings.out:
        Path(settings.out).absolute().parent.mkdir(parents=True, exist_ok=True)
        atomic_write(settings.out, json.dumps(rows, indent=1))
        print(f"\n# wrote {len(rows)} rows to {settings.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(r["wrong"] for r in rows) else 0


def under_launcher() -> bool:
    """True inside a torchrun / MPI / Slurm job (its rank variable is set)."""
    from ..comm.env import LAUNCHERS

    return any(rank_var in os.environ for _, rank_var, _, _ in LAUNCHERS)
