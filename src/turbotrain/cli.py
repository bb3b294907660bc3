"""The `turbotrain` command: one subcommand per feature, each registered by its own subpackage."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import TurbotrainError

__all__ = ["main", "build_parser"]

#: Modules that each define add_cli(subparsers), in the order `turbotrain --help` lists them.
_COMMAND_MODULES = (
    "turbotrain.bench",
    "turbotrain.hardware",
    "turbotrain.profile",
    "turbotrain.diagnose",
    "turbotrain.comm",
    "turbotrain.comm.ladder",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turbotrain", description="Faster PyTorch training, same results.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TurbotrainError as exc:
        print(f"turbotrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
