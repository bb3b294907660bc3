"""``turbotrain tune``: search the Config space for a workload within a time and a memory budget.

    turbotrain tune --workload gpt --budget 5m [--max-memory 8G] [--nproc 2 [--link 1gbit | --fit-json FILE]]
"""

from __future__ import annotations

import json
import time

__all__ = ["add_parsers"]


def _tune(args) -> int:
    started = time.monotonic()  # the budget counts from here: imports and analysis are part of it
    from ..bench.runner import quick_overrides
    from ..bench.worker import load_workload
    from ..tune.dp_search import check_dp_settings
    from ..tune.search import TuneSettings, parse_duration, parse_memory, run_tune
    from ..errors import ConfigError
    from ..hardware import check_idle_threads_sleep
    from ..utils import check_output_dir
    from .bench import parse_overrides

    if args.nproc is not None and args.nproc < 2:
        raise ConfigError(f"--nproc {args.nproc}: the data-parallel stage needs at least 2 ranks; leave --nproc out "
                          "to tune one process")
    if args.link is not None and args.nproc is None:
        raise ConfigError(f"--link {args.link} shapes the link of a data-parallel run; give --nproc N (N >= 2) "
                          "with it, or drop --link")
    if args.fit_json is not None:  # a file no link can be fitted from costs a line, not a compute search
        check_dp_settings(args.nproc or 1, args.link, fit_json=args.fit_json)
    budget = parse_duration(args.budget)
    max_memory = parse_memory(args.max_memory)
    check_output_dir(args.out)
    check_idle_threads_sleep()  # before the workload is built: the search's timings could not be trusted
    overrides = parse_overrides(args.set)
    if args.quick:
        overrides = {**quick_overrides(args.workload), **overrides}
    workload = load_workload(args.workload, overrides)  # a bad name or setting costs a line, not a search
    settings = TuneSettings(budget_s=budget, max_memory=max_memory, steps=args.steps, rounds=args.rounds,
                            warmup=args.warmup, seed=args.seed, val_batches=2 if args.quick else 4,
                            device=args.device, max_candidates=args.max_candidates, world_size=args.nproc or 1,
                            link=args.link, fit_json=args.fit_json)
    result = run_tune(workload, settings, args.out, workload_spec={"workload": args.workload, "overrides": overrides},
                      say=print, started=started)
    doc = result.document
    print()
    with open(result.paths[2]) as f:  # tune.md: the table
        table = [line for line in f.read().splitlines() if line.startswith("|")]
    print("\n".join(table))
    print(f"\nwinner {result.winner.name}; tuner wall time {doc['tuner_wall_seconds']:.0f} s "
          f"of {budget:.0f} s")
    print(json.dumps(result.config.to_dict(), indent=2))
    print("wrote " + ", ".join(str(p) for p in result.paths))
    quick = " --quick" if args.quick else ""
    print(f"compare it with the ladder: turbotrain bench --workload {args.workload} --config-file "
          f"{result.paths[0]}{quick}" + (" (its compute recipe, one process)" if args.nproc else ""))
    if args.nproc:
        print(f"and the data-parallel rows: turbotrain bench --nproc {args.nproc}{quick}"
              + (f" --link {args.link}" if args.link else ""))
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain tune``."""
    p = subparsers.add_parser("tune", parents=parents,
                              help="find the fastest Config for a workload here that keeps the loss, within a "
                                   "time (and memory) budget")
    p.add_argument("--workload", default="gpt",
                   help="workload name (default gpt), or hf:<model_type> for any transformers LM (e.g. hf:qwen2)")
    p.add_argument("--budget", default="5m", help="wall time of the whole search: 300, 300s, 5m (default 5m)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="memory a candidate may use, e.g. 8G (estimated before it runs, measured after)")
    p.add_argument("--out", default="tune-out", help="directory for tuned.json, tune.json, tune.md, tune.html")
    p.add_argument("--quick", action="store_true", help="the workload's small quick-mode model (a smoke test)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=5, help="measured steps per candidate (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds they are spread over (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per candidate (default 2)")
    p.add_argument("--max-candidates", type=int, default=None,
                   help="measure at most this many candidates besides the baseline")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="then search gradient compression x DDP bucket size for the chosen recipe as torchrun "
                        "jobs of N ranks on this machine (within the same --budget)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="with --nproc: shape the jobs' loopback to a tc rate, e.g. 1gbit (needs root and network "
                        "namespaces); default plain loopback")
    p.add_argument("--fit-json", default=None, metavar="FILE",
                   help="with --nproc: price the data-parallel candidates on the link fitted from this comm-bench "
                        "JSON (turbotrain comm-bench --out) instead of the built-in loopback fit; the jobs still run "
                        "on this machine's loopback")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="workload override, repeatable (e.g. --set T=512)")
    p.set_defaults(func=_tune)
