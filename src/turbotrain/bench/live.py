"""The terminal view of a running ladder: a rich table refreshed after every round, with a progress bar.

Cells are escaped: they hold error messages, and an unmatched ``[/]`` in one would make rich raise
while it draws the table.
"""

from __future__ import annotations

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .report import TABLE_COLUMNS, build_results, table_cells

__all__ = ["LiveLadder", "TERMINAL_COLUMNS"]

#: The report's columns that fit a 160-column terminal unfolded; report.html has all of them.
TERMINAL_COLUMNS = tuple(c for c in TABLE_COLUMNS if c not in ("MFU@bf16", "ops/step", "train loss"))
_KEEP = [TABLE_COLUMNS.index(c) for c in TERMINAL_COLUMNS]


class LiveLadder:
    """``phase(row, text)``, ``event(row, message)`` and ``update(results)`` as the interleaved ladder runs.

    The bar counts one unit per row for its set-up, one per row and round, and one per row for
    its val loss; ``update`` recomputes the table from the results so far (metrics appear once a
    row has finished).
    """

    def __init__(self, names: list[str], header: dict, console, rounds: int):
        self.names, self.header, self.console = names, header, console
        self.results: dict[str, dict] = {}
        self.phases: dict[str, str] = {}
        self.done = 0
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        self.task = self.bar.add_task("ladder", total=len(names) * (rounds + 2))
        # redrawn only when something changed: an auto-refresh thread would take CPU from the row
        # being timed (a few percent of a core on a 2-core machine)
        self.live = Live(self._render(), console=console, auto_refresh=False)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.phases.clear()
        self.live.update(self._render(with_bar=False), refresh=True)  # the finished table stays; the bar goes
        self.live.__exit__(*exc)

    def phase(self, row: str, text: str) -> None:
        if row in self.phases:
            self.done += 1  # the row's previous phase has ended
        self.phases[row] = text
        self.bar.update(self.task, completed=self.done, description=escape(f"{row}: {text}"))
        self.live.update(self._render(), refresh=True)

    def event(self, row: str, message: dict) -> None:
        if message.get("event") == "progress":
            self.bar.update(self.task, description=escape(
                f"{row}: warm-up step {message['done']}/{message['total']}"))
            self.live.refresh()

    def update(self, results: dict) -> None:
        self.results = dict(results)
        self.live.update(self._render(), refresh=True)

    def _render(self, with_bar: bool = True):
        title = f"turbotrain bench: {self.header['workload']['name']} on {self.header['run']['device']}"
        table = Table(title=escape(title))
        for i, column in enumerate(TERMINAL_COLUMNS):  # the config name is never folded: it is what --configs takes
            table.add_column(column, overflow="fold", no_wrap=i == 0, min_width=max(map(len, self.names)) if i == 0 else None)
        configs = build_results(self.header, self.results)["configs"] if self.results else {}
        unit = self.header["workload"]["unit"]
        for name in self.names:
            if name in configs and "running" != configs[name].get("status"):
                cells = [table_cells(name, configs[name], unit)[i] for i in _KEEP]
                style = {"ok": None, "FAILED": "bold red"}.get(configs[name].get("status"), "red")
            else:
                cells = [name, self.phases.get(name, "waiting")] + [""] * (len(TERMINAL_COLUMNS) - 2)
                style = "dim"
            table.add_row(*map(escape, cells), style=style)
        return Group(table, self.bar) if with_bar else table
