"""``turbotrain launch`` (torchrun with an NCCL preset) and ``turbotrain comm-bench``.

    turbotrain launch --nproc 2 --nccl-preset ethernet train.py --lr 3e-4

On one node the job's rendezvous listens on 127.0.0.1 only (see turbotrain.comm.launch); several
nodes need ``--master-addr``, the host of node 0, on every node.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess

from ..comm.nccl import PRESETS
from ..errors import ConfigError

__all__ = ["add_parsers", "parse_nccl_overrides"]


def parse_nccl_overrides(pairs: list[str] | None) -> dict[str, str]:
    """``["NCCL_ALGO=Ring"]`` -> ``{"NCCL_ALGO": "Ring"}``; apply_preset validates the values."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--nccl-env {pair!r} must look like NCCL_NAME=value")
        out[key.strip()] = value.strip()
    return out


def _launch(args) -> int:
    from ..comm.launch import torchrun_command
    from ..comm.nccl import apply_preset, format_env

    # everything is checked before anything is printed or started
    env = dict(os.environ)
    chosen = apply_preset(args.nccl_preset, parse_nccl_overrides(args.nccl_env), environ=env)
    cmd = torchrun_command(args.nproc, args.script, args.script_args, module=args.module, nnodes=args.nnodes,
                           node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)
    print(f"turbotrain launch: NCCL preset {args.nccl_preset!r}\n{format_env(chosen)}", flush=True)
    print("turbotrain launch: " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)


def _comm_bench(args) -> int:
    from ..bench.comm_bench import CommBenchSettings, parse_size, run_bench, under_launcher
    from ..utils import check_output_file

    settings = CommBenchSettings(
        backend=args.backend, ops=tuple(o.strip() for o in args.ops.split(",") if o.strip()),
        min_bytes=parse_size(args.min_bytes, "--min-bytes"), max_bytes=parse_size(args.max_bytes, "--max-bytes"),
        factor=args.factor, iters=args.iters, warmup=args.warmup, dtype=args.dtype, link_gbps=args.link_gbps,
        out=args.out)
    if args.out:
        check_output_file(args.out)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be >= 1: ranks to start on this node")
    if under_launcher():
        return run_bench(settings)
    return _spawn_comm_bench(args, settings)


def _spawn_comm_bench(args, settings) -> int:
    """Outside a launcher: this same command on ``--nproc`` local ranks, rendezvous on loopback."""
    import torch

    from ..comm.launch import torchrun_command

    nproc = args.nproc
    if nproc is None:
        nproc = torch.cuda.device_count() or 2
        print(f"# comm-bench: --nproc not given; using {nproc} "
              f"({'GPUs visible' if torch.cuda.is_available() else 'CPU default'})")
    env = dict(os.environ)
    if args.nccl_preset:
        from ..comm.nccl import apply_preset, format_env

        print("# NCCL environment:\n" + format_env(apply_preset(args.nccl_preset, environ=env)))
    rank_args = ["comm-bench", "--backend", settings.backend, "--ops", ",".join(settings.ops),
                 "--min-bytes", str(settings.min_bytes), "--max-bytes", str(settings.max_bytes),
                 "--factor", str(settings.factor), "--iters", str(settings.iters), "--warmup", str(settings.warmup),
                 "--dtype", settings.dtype]
    if settings.link_gbps is not None:
        rank_args += ["--link-gbps", str(settings.link_gbps)]
    if settings.out:
        rank_args += ["--out", settings.out]
    cmd = torchrun_command(nproc, "turbotrain.cli", rank_args, module=True)
    return subprocess.call(cmd, env=env)


def add_parsers(subparsers, parents=()) -> None:
    """Register ``launch``, ``comm-bench`` and ``comm-plan``."""
    from ..bench.comm_bench import DTYPES, OPS

    p = subparsers.add_parser("launch", parents=parents,
                              help="run a script on N processes (torchrun) with an NCCL preset",
                              description="torchrun with an NCCL preset applied; on one node its rendezvous "
                                          "listens on 127.0.0.1 only")
    p.add_argument("--nproc", type=int, required=True, help="processes on this node (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None, help="host of node 0 (needed with --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=29500, help="port on node 0 (multi-node)")
    p.add_argument("--nccl-preset", choices=tuple(PRESETS), default="default")
    p.add_argument("--nccl-env", action="append", metavar="NCCL_X=VALUE", help="extra NCCL variable (repeatable)")
    p.add_argument("--module", "-m", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, start nothing")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_launch)

    b = subparsers.add_parser("comm-bench", parents=parents,
                              help="nccl-tests style collective bandwidth table (gloo or NCCL)",
                              description="nccl-tests style bandwidth of all_reduce, all_gather, reduce_scatter "
                                          "and broadcast (turbotrain.bench.comm_bench)")
    b.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (default: GPUs, or 2 on CPU)")
    b.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    b.add_argument("--ops", default=",".join(OPS), help="comma list from " + ", ".join(OPS))
    b.add_argument("--min-bytes", default="1K", help="smallest buffer, e.g. 1K (binary units K, M, G)")
    b.add_argument("--max-bytes", default="16M", help="largest buffer, e.g. 64M or 1G")
    b.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    b.add_argument("--iters", type=int, default=20)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    b.add_argument("--link-gbps", type=float, default=None, help="link speed in Gbit/s, printed as the busbw limit")
    b.add_argument("--nccl-preset", choices=tuple(PRESETS), default=None,
                   help="NCCL preset applied before spawning (see `turbotrain launch`)")
    b.add_argument("--out", default=None, help="write the rows as JSON here")
    b.set_defaults(func=_comm_bench)

    c = subparsers.add_parser("comm-plan", parents=parents,
                              help="predict step time and comm overhead at 8..1024 ranks (alpha-beta model)",
                              description="alpha-beta model of ring, tree, parameter server, hierarchical and "
                                          "each compressor, with the NCCL settings it would pick "
                                          "(docs/comm-plan.md states its assumptions)")
    c.add_argument("--model-params", type=float, required=True, help="parameters in the model, e.g. 7e9")
    c.add_argument("--link", required=True, help="inter-node link preset: 10gbe, 25gbe, 100gbe, 200ib, 400ib, nvlink")
    c.add_argument("--nodes", type=int, required=True)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--compute-s", type=float, default=None, help="compute time of one step (default: estimated)")
    c.add_argument("--fit-json", "--fit", dest="fit", default=None, metavar="FILE",
                   help="comm-bench JSON (turbotrain comm-bench --out) to fit latency and bandwidth from")
    c.add_argument("--plot", default=None, help="write a PNG of the predictions here")
    c.set_defaults(func=_comm_plan)


def _comm_plan(args) -> int:
    from ..comm.model import run_comm_plan

    if args.nodes < 1 or args.gpus_per_node < 1 or args.model_params <= 0:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1 and --model-params > 0")
    print(run_comm_plan(args.model_params, args.link, args.nodes, args.gpus_per_node, args.compute_s,
                        args.fit, args.plot))
    return 0
