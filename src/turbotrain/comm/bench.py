"""``turbotrain comm-bench``: nccl-tests style bandwidth of the four collectives DDP-like training uses.

Conventions (those of nccl-tests, so the figures compare with theirs):
* ``size`` is the bytes of the full buffer: the all_reduce/broadcast tensor, the all_gather
  output, the reduce_scatter input. ``count`` is that in elements.
* ``algbw = size / time``; ``busbw = algbw * factor`` with factor 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather and reduce_scatter, 1 for broadcast: the traffic each rank's link
  carries in a bandwidth-optimal algorithm, comparable to the link's own speed.
* ``time`` is the median over iterations of the slowest rank's time for one collective.

Run ``turbotrain comm-bench --nproc 2 --backend gloo`` on a laptop; with ``--nproc`` outside a
launcher it re-runs itself under torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, reduce_scatter_flat

__all__ = ["OPS", "bus_factor", "parse_size", "size_sweep", "add_arguments", "run_bench", "main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each link carries per byte of ``size``."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def parse_size(text: str) -> int:
    """'64', '4K', '1M', '2G' (binary units) -> bytes."""
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Geometric sizes from ``min_bytes`` up to and including ``max_bytes``."""
    sizes, size = [], max(1, min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    _sync(device)
    wrong = _wrong(op, out, world, count)
    for _ in range(warmup):
        _run_once(op, inp, out)
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        _run_once(op, inp, out)
        _sync(device)
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
        "time_us": median * 1e6, "p20_us": percentile(times, 0.2) * 1e6, "p80_us": percentile(times, 0.8) * 1e6,
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None, help="local ranks to spawn through torchrun (default: GPUs, or 2 on CPU)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--ops", default=",".join(OPS), help="comma list from " + ", ".join(OPS))
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    p.add_argument("--link-gbps", type=float, default=None, help="link speed in Gbit/s, printed as the busbw limit")
    p.add_argument("--nccl-preset", default=None, help="NCCL preset applied before spawning (see `turbotrain launch`)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")


def _environment(info) -> dict:
    return {
        "device": str(info.device) if info.device.type == "cpu" else torch.cuda.get_device_name(info.device),
        "backend": info.backend, "world_size": info.world_size, "host": platform.node(),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if info.backend == "nccl" else None},
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }


def run_bench(args) -> int:
    """Inside a launched job: measure on every rank, print and write on rank 0."""
    from .env import init

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for op in ops:
        bus_factor(op, 2)  # validates the name
    info = init(None if args.backend == "auto" else args.backend)
    env = _environment(info)
    dtype = _DTYPES[args.dtype]
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    rows = []
    if info.is_main:
        print("# comm-bench: " + json.dumps(env))
        print("# time = median of the slowest rank; busbw = algbw x nccl-tests bus factor")
        if args.link_gbps:
            print(f"# link limit: {args.link_gbps:g} Gbit/s = {args.link_gbps / 8:.3f} GB/s of busbw")
    for op in ops:
        op_rows = [r for r in (measure(op, s, dtype, info.device, args.iters, args.warmup) for s in sizes) if r]
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
                "limit_GBps": args.link_gbps / 8 if args.link_gbps else None,
                "device": env["device"], "versions": env["versions"], "timestamp": stamp,
            })
    if info.is_main and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\n# wrote {len(rows)} rows to {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(r["wrong"] for r in rows) else 0


def _under_launcher() -> bool:
    from .env import LAUNCHERS

    return any(rank_var in os.environ for _, rank_var, _, _ in LAUNCHERS)


def cli_main(args) -> int:
    """``turbotrain comm-bench``: run here if launched, else spawn ``--nproc`` ranks via torchrun."""
    if _under_launcher():
        return run_bench(args)
    nproc = args.nproc
    if nproc is None:
        nproc = torch.cuda.device_count() or 2
        print(f"# comm-bench: --nproc not given; using {nproc} ({'GPUs visible' if torch.cuda.is_available() else 'CPU default'})")
    env = dict(os.environ)
    if args.nccl_preset:
        from .nccl import apply_preset, format_env

        print("# NCCL environment:\n" + format_env(apply_preset(args.nccl_preset, environ=env)))
    # Rebuilt from our own options only: the top-level parser may have added others to args.
    own = argparse.ArgumentParser(add_help=False)
    add_arguments(own)
    passthrough: list[str] = []
    for action in own._actions:
        value = getattr(args, action.dest, None)
        if action.dest in ("nproc", "nccl_preset") or value is None:
            continue
        passthrough += [action.option_strings[0], str(value)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "turbotrain.comm.bench", *passthrough]
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="turbotrain comm-bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
