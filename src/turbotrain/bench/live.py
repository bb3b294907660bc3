"""The terminal view of a running ladder: a rich table filled in row by row, with a progress bar."""

from __future__ import annotations

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .report import TABLE_COLUMNS, build_results, table_cells

__all__ = ["LiveLadder"]


class LiveLadder:
    """``start(name)``, ``progress(done, total)`` and ``finish(name, result)`` as rows run."""

    def __init__(self, names: list[str], header: dict, console, steps_per_row: int):
        self.names, self.header, self.console = names, header, console
        self.raw: dict[str, dict] = {}
        self.running: str | None = None
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        self.steps_per_row = steps_per_row
        self.task = self.bar.add_task("ladder", total=len(names) * steps_per_row)
        self.live = Live(self._render(), console=console, refresh_per_second=4)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.running = None
        self.live.update(self._render(with_bar=False))  # the finished table stays; the bar goes
        self.live.__exit__(*exc)

    def start(self, name: str) -> None:
        self.running = name
        self.bar.update(self.task, description=f"{name}: starting worker")
        self.live.update(self._render())

    def progress(self, done: int, total: int) -> None:
        finished = len(self.raw) * self.steps_per_row
        self.bar.update(self.task, completed=finished + done, description=f"{self.running}: step {done}/{total}")
        self.live.update(self._render())

    def finish(self, name: str, result: dict) -> None:
        self.raw[name] = result
        self.bar.update(self.task, completed=len(self.raw) * self.steps_per_row)
        self.live.update(self._render())

    def _render(self, with_bar: bool = True):
        table = Table(title=f"turbotrain bench: {self.header['workload']['name']} on {self.header['run']['device']}")
        for i, column in enumerate(TABLE_COLUMNS):  # the config name is never folded: it is what --configs takes
            table.add_column(column, overflow="fold", no_wrap=i == 0, min_width=max(map(len, self.names)) if i == 0 else None)
        configs = build_results(self.header, self.raw)["configs"] if self.raw else {}
        unit = self.header["workload"]["unit"]
        for name in self.names:
            if name in configs:
                cells = table_cells(name, configs[name], unit)
                style = "red" if configs[name].get("status") != "ok" else None
            else:
                cells = [name, "running" if name == self.running else "waiting"] + [""] * (len(TABLE_COLUMNS) - 2)
                style = "dim"
            table.add_row(*cells, style=style)
        return Group(table, self.bar) if with_bar else table
