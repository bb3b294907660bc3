"""``turbotrain bench``: the benchmark ladder, and with ``--nproc`` the data-parallel ladder."""

from __future__ import annotations

import os
import sys

from ..errors import ConfigError

__all__ = ["add_parsers", "parse_overrides"]


def parse_overrides(items: list[str]) -> dict:
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


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(c.strip() for c in text.split(",") if c.strip()) if text else None


def _bench(args) -> int:
    if args.malloc_tuned:  # every worker and rank inherits it, peers and turbotrain rows alike
        from ..hardware import TUNED_MALLOC_ENV

        os.environ.update(TUNED_MALLOC_ENV)
    if args.config_file and args.nproc is not None:
        raise ConfigError("--config-file adds a row to the single-process ladder; it does not combine with --nproc")
    if args.nproc is not None:  # 0 too: the dp ladder refuses it, rather than running the other ladder
        return _dp_bench(args)
    from ..bench.runner import (DEFAULT_ROUNDS, DEFAULT_STEPS, DEFAULT_WARMUP, QUICK_ROUNDS, QUICK_STEPS, QUICK_WARMUP,
                                LadderSettings, run_ladder)

    quick = args.quick
    configs = _names(args.configs)
    if args.config_file:  # the tuned Config as row tt-tuned: in the default ladder, or added to --configs
        from ..bench.runner import QUICK_CONFIGS
        from ..tune.row import register_tuned_row

        row = register_tuned_row(args.config_file)
        if configs is None and quick:
            configs = (*QUICK_CONFIGS, row)
        elif configs is not None and row not in configs:
            configs = (*configs, row)
    settings = LadderSettings(
        workload=args.workload, configs=configs,
        steps=args.steps if args.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS),
        warmup=args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP),
        rounds=args.rounds if args.rounds is not None else (QUICK_ROUNDS if quick else DEFAULT_ROUNDS),
        device=args.device, quick=quick, seed=args.seed, val_batches=2 if quick else 4,
        timeout=args.timeout if args.timeout is not None else 1200.0,
        overrides=parse_overrides(args.set), reference=args.reference, aa=not args.no_aa,
    )
    if args.list:
        return _list_configs(settings)
    results = run_ladder(settings, args.out)  # checks --out before any work
    return _exit_code(results["configs"], strict=args.strict)


def _dp_bench(args) -> int:
    from ..bench.comm_bench import parse_size
    from ..bench.dp_ladder import run_dp_ladder

    cap = None if args.max_state_bytes is None else parse_size(args.max_state_bytes, "--max-state-bytes")
    doc = run_dp_ladder(  # checks --out and every name before any job
        workload=args.workload, nproc=args.nproc, steps=args.steps, configs=_names(args.configs), link=args.link,
        out_dir=args.out, quick=args.quick, overrides=parse_overrides(args.set), warmup=args.warmup,
        precision=args.dp_precision, seed=args.seed, rounds=args.rounds,
        timeout=args.timeout if args.timeout is not None else 900.0, max_state_bytes=cap)
    return _exit_code(doc["configs"], strict=args.strict)


def _exit_code(configs: dict, *, strict: bool) -> int:
    failed = [n for n, c in configs.items() if c.get("status") != "ok"]
    if failed:
        print(f"turbotrain bench: {len(failed)} row(s) failed: {', '.join(failed)} (see the results JSON)",
              file=sys.stderr)
    return 1 if failed and (strict or len(failed) == len(configs)) else 0


def _list_configs(settings) -> int:
    from ..bench.configs import list_configs
    from ..hardware import resolve_device

    device = resolve_device(settings.device)
    for c in list_configs():
        mark = "*" if c.is_default_on(device) else " "
        print(f"{mark} {c.name:<24} [{c.group}, {c.dtype_on(device)}, val loss ±{c.tolerance_on(device):g}%] "
              f"{c.description}")
    print(f"(* = in the default ladder on {device}; every ladder adds the reference's A/A row unless --no-aa)")
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain bench``."""
    from ..bench.dp_ladder import DEFAULT_CONFIGS, DEFAULT_PRECISION, DP_ROWS
    from ..bench.runner import DEFAULT_ROUNDS, DEFAULT_STEPS, DEFAULT_WARMUP, QUICK_ROUNDS, QUICK_STEPS, QUICK_WARMUP

    p = subparsers.add_parser("bench", parents=parents,
                              help="run the benchmark ladder: peer PyTorch recipes vs turbotrain configs, "
                                   "interleaved round by round")
    p.add_argument("--workload", default="gpt",
                   help="workload name (default gpt), or hf:<model_type> for any transformers LM (e.g. hf:qwen2)")
    p.add_argument("--configs", default=None,
                   help="comma-separated config names (default: the device's default set; with --nproc: "
                        + ", ".join(DEFAULT_CONFIGS) + "; also "
                        + ", ".join(n for n in DP_ROWS if n not in DEFAULT_CONFIGS) + ")")
    p.add_argument("--steps", type=int, default=None,
                   help=f"measured steps per row (default {DEFAULT_STEPS}, quick {QUICK_STEPS}; with --nproc 30 over all rounds)")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up steps (default {DEFAULT_WARMUP}, quick {QUICK_WARMUP})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved rounds the measured steps are spread over (default {DEFAULT_ROUNDS}, "
                        f"quick {QUICK_ROUNDS}; at most --steps; with --nproc: every job run that many times in "
                        "alternating order, default 2)")
    p.add_argument("--reference", default=None,
                   help="the row 'vs best peer' ratios are taken against (default torch-compile-step, or its "
                        "fp32 twin where bf16 is slow; added to the ladder if not in it)")
    p.add_argument("--no-aa", action="store_true",
                   help="do not run the reference a second time (the A/A row that shows the noise floor)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, 5 rows + the A/A row: a smoke test of about a minute")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default="bench-out", help="directory for results.json, report.html and PNGs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="workload override, repeatable (e.g. --set T=1024 --set B=4)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds one worker command (build + warm-up, one round, val) may take before the row is "
                        "killed (default 1200; with --nproc, a whole job: 900)")
    p.add_argument("--malloc-tuned", action="store_true",
                   help="start every row's process with glibc's MALLOC_MMAP_MAX_=0 and a high MALLOC_TRIM_THRESHOLD_ "
                        "(turbotrain.hardware.TUNED_MALLOC_ENV): freed tensors stay mapped instead of faulting in "
                        "afresh each step; it applies to peers and turbotrain rows alike, and the header records it")
    p.add_argument("--strict", action="store_true", help="exit 1 if any row failed (default: only if all did)")
    p.add_argument("--list", action="store_true", help="list the registered configs and exit")
    p.add_argument("--config-file", default=None, metavar="JSON",
                   help="add row tt-tuned, the Engine with this Config (the tuned.json turbotrain tune wrote)")
    dp = p.add_argument_group("data-parallel ladder (turbotrain.bench.dp_ladder)")
    dp.add_argument("--nproc", type=int, default=None,
                    help="ranks per job; giving it runs the data-parallel ladder instead (gloo on loopback)")
    dp.add_argument("--link", default=None, metavar="RATE",
                    help="shape the ranks' loopback to a tc rate, e.g. 1gbit (needs root, ip, tc)")
    dp.add_argument("--dp-precision", default=DEFAULT_PRECISION, help="Engine precision of every row")
    dp.add_argument("--max-state-bytes", default=None, metavar="SIZE",
                    help="cap on a rank's parameter + gradient + optimizer-state bytes (e.g. 30M), enforced at "
                         "every optimizer step: a row over it stops with an error")
    p.set_defaults(func=_bench)
