"""``turbotrain launch`` (torchrun with an NCCL preset) and ``turbotrain comm-bench``.

    turbotrain launch --nproc 2 --nccl-preset ethernet train.py --lr 3e-4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..errors import ConfigError
from .nccl import PRESETS, apply_preset, format_env

__all__ = ["add_cli", "launch_command", "run_launch"]


def _parse_overrides(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--nccl-env {pair!r} must look like NCCL_NAME=value")
        out[key.strip()] = value.strip()
    return out


def launch_command(args) -> list[str]:
    """The torchrun command line for parsed ``launch`` arguments."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be >= 1: processes to start on this node")
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes} must be >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--nnodes={args.nnodes}"]
    if args.nnodes == 1 and args.master_addr is None:
        # One node: torchrun picks a free port itself, so two jobs on one box cannot collide.
        cmd.append("--standalone")
    else:
        if args.master_addr is None:
            raise ConfigError(
                f"--nnodes {args.nnodes} needs --master-addr (host of node 0) and --node-rank on every node"
            )
        cmd += [f"--node_rank={args.node_rank}", f"--master_addr={args.master_addr}",
                f"--master_port={args.master_port}"]
    if args.module:
        cmd.append("-m")
    return cmd + [args.script, *args.script_args]


def run_launch(args) -> int:
    env = dict(os.environ)
    chosen = apply_preset(args.nccl_preset, _parse_overrides(args.nccl_env), environ=env)
    cmd = launch_command(args)
    print(f"turbotrain launch: NCCL preset {args.nccl_preset!r}\n{format_env(chosen)}", flush=True)
    print("turbotrain launch: " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)


def add_cli(subparsers) -> None:
    """Register ``launch`` and ``comm-bench``."""
    from . import bench

    p = subparsers.add_parser("launch", help="run a script on N processes (torchrun) with an NCCL preset",
                              description=run_launch.__doc__ or "torchrun with an NCCL preset applied")
    p.add_argument("--nproc", type=int, required=True, help="processes on this node (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default=None, help="host of node 0 (multi-node)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--nccl-preset", choices=tuple(PRESETS), default="default")
    p.add_argument("--nccl-env", action="append", metavar="NCCL_X=VALUE", help="extra NCCL variable (repeatable)")
    p.add_argument("--module", "-m", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, start nothing")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_launch)

    b = subparsers.add_parser("comm-bench", help="nccl-tests style collective bandwidth table (gloo or NCCL)",
                              description=(bench.__doc__ or "").split("\n\n")[0])
    bench.add_arguments(b)
    b.set_defaults(func=bench.cli_main)
