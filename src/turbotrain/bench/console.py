"""The terminal the benchmarks print to (rich, from the ``bench`` extra)."""

from __future__ import annotations

import sys

from ..utils import require

__all__ = ["make_console", "escape"]


def make_console(console=None):
    """``console`` if given, else a rich Console; a log file or pipe gets 160 columns rather than
    rich's 80-column default, which folds every table cell."""
    if console is not None:
        return console
    rich_console = require("rich.console", "bench", "the benchmark's terminal output")
    return rich_console.Console() if sys.stdout.isatty() else rich_console.Console(width=160)


def escape(text) -> str:
    """``text`` with rich markup made literal: an error message holding ``[/]`` or ``[red]`` is
    printed as it is instead of being parsed (an unmatched ``[/]`` raises MarkupError)."""
    from rich.markup import escape as _escape

    return _escape(str(text))
