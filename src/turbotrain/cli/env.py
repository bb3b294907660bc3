"""``turbotrain env``: the hardware, its measured peaks, and the precision to train in."""

from __future__ import annotations

import json

from ..utils import require

__all__ = ["add_parsers"]


def _env(args) -> int:
    from ..hardware import environment_report, print_environment

    if not args.json:  # before the measuring, so a missing extra costs no time
        require("rich", "bench", "turbotrain env's text output (or use --json)")
    if args.remeasure:  # the ladder's peaks too, so the next `turbotrain bench` measures them again
        from ..bench.peak import clear_cache

        clear_cache()
    report = environment_report(args.device, force=args.remeasure)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_environment(report)
    return 0


def add_parsers(subparsers, parents=()) -> None:
    """Register ``turbotrain env``."""
    p = subparsers.add_parser("env", parents=parents,
                              help="describe the hardware, measure matmul peaks, recommend a precision")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--remeasure", action="store_true", help="ignore cached peaks and measure again (the benchmark ladder's cached peaks are dropped too)")
    p.set_defaults(func=_env)
