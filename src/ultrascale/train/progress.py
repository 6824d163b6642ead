"""The console progress bar (rank 0 only): step, loss and tokens/s, through rich."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"),
                TextColumn("[green]{task.fields[tps]} tok/s"), TimeElapsedColumn(),
                transient=False)
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-",
                                            tps="-")

    def __enter__(self):
        if self.enabled:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._bar.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.enabled:
            self._bar.update(self._task, completed=step, loss=f"{loss:.3f}",
                             tps=f"{tokens_per_s:,.0f}")
