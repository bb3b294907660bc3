"""The ``turbotrain`` command. Every subcommand is registered here, in one module per command
family, and calls functions its feature package owns; no feature package imports this one.

    turbotrain [-v | -q] COMMAND ...

Errors turbotrain raises on purpose (TurbotrainError: bad names, sizes, paths) print one line,
``turbotrain COMMAND: error: ...``, on stderr and exit 2. Library logging goes to stderr at INFO
(``-v``: DEBUG, ``-q``: warnings only); tables and results go to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import TurbotrainError

__all__ = ["main", "build_parser", "configure_logging"]

#: Modules of this package that each define ``add_parsers(subparsers, parents)``, in the order
#: ``turbotrain --help`` lists their commands.
_COMMAND_MODULES = ("bench", "tune", "env", "profile", "diagnose", "comm", "ckpt")


def _verbosity_parser(default) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, default=default,
                       help="log DEBUG messages too")
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=default,
                       help="log warnings and errors only")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turbotrain", description="Faster PyTorch training, same results.",
                                     parents=[_verbosity_parser(0)])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # SUPPRESS: -v/-q after the command must not reset one given before it
    parents = [_verbosity_parser(argparse.SUPPRESS)]
    for name in _COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parsers(sub, parents)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test may swap it between calls)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure_logging(verbosity: int = 0) -> None:
    """Send the ``turbotrain`` loggers to stderr: INFO, DEBUG for verbosity > 0, WARNING below 0."""
    level = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
    root = logging.getLogger("turbotrain")
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)  # main() may run more than once in a process
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("turbotrain: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    configure_logging(args.verbosity)
    try:
        return int(args.func(args) or 0)
    except TurbotrainError as exc:
        print(f"turbotrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
