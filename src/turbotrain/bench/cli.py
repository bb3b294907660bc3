"""``turbotrain bench``: the benchmark ladder from the command line."""

from __future__ import annotations

import sys

from ..errors import ConfigError, TurbotrainError
from .runner import DEFAULT_STEPS, DEFAULT_WARMUP, QUICK_STEPS, QUICK_WARMUP, LadderSettings, run_ladder

__all__ = ["add_cli", "bench_main"]


def bench_main(args) -> int:
    if args.nproc:  # the data-parallel ladder (turbotrain.comm.ladder) shares the bench's options
        from ..comm.ladder import dp_bench_main

        return dp_bench_main(args)
    quick = args.quick
    try:
        settings = LadderSettings(
            workload=args.workload,
            configs=tuple(c.strip() for c in args.configs.split(",") if c.strip()) if args.configs else None,
            steps=args.steps if args.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS),
            warmup=args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP),
            device=args.device, quick=quick, seed=args.seed,
            val_batches=2 if quick else 4, timeout=args.timeout,
            overrides=_parse_overrides(args.set),
        )
        if args.list:
            return _list_configs(settings)
        results = run_ladder(settings, args.out)
    except TurbotrainError as exc:  # bad names or settings: one line, no traceback
        print(f"turbotrain bench: {exc}", file=sys.stderr)
        return 2
    failed = [n for n, c in results["configs"].items() if c.get("status") != "ok"]
    if failed:
        print(f"turbotrain bench: {len(failed)} row(s) failed: {', '.join(failed)} (see results.json)", file=sys.stderr)
    return 1 if failed and (args.strict or len(failed) == len(results["configs"])) else 0


def _parse_overrides(items: list[str]) -> dict:
    """``["T=1024", "B=4"]`` -> ``{"T": 1024, "B": 4}``; the workload validates the keys."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE; e.g. --set T=1024")
        for parse in (int, float):
            try:
                out[key] = parse(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = raw
    return out


def _list_configs(settings: LadderSettings) -> int:
    from ..hardware import resolve_device
    from .configs import list_configs

    device = resolve_device(settings.device)
    for c in list_configs():
        mark = "*" if c.is_default_on(device) else " "
        print(f"{mark} {c.name:<20} [{c.group}] {c.description}")
    print(f"(* = in the default ladder on {device})")
    return 0


def add_cli(subparsers) -> None:
    """Register ``turbotrain bench``."""
    p = subparsers.add_parser("bench", help="run the benchmark ladder: peer PyTorch recipes vs turbotrain configs")
    p.add_argument("--workload", default="gpt", help="workload name (default gpt)")
    p.add_argument("--configs", default=None, help="comma-separated config names (default: the device's default set)")
    p.add_argument("--steps", type=int, default=None, help=f"measured steps per row (default {DEFAULT_STEPS}, quick {QUICK_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up steps (default {DEFAULT_WARMUP}, quick {QUICK_WARMUP})")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, 4 rows: a smoke test under a minute")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default="bench-out", help="directory for results.json, report.html and PNGs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="workload override, repeatable (e.g. --set T=1024 --set B=4)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one row may take before it is killed")
    p.add_argument("--strict", action="store_true", help="exit 1 if any row failed (default: only if all did)")
    p.add_argument("--list", action="store_true", help="list the registered configs and exit")
    from ..comm.ladder import add_dp_arguments

    add_dp_arguments(p, shared=False)
    p.set_defaults(func=bench_main)
