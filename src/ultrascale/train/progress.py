"""Rank 0's console: a progress bar with an ETA on a terminal, and a plain line every
`logging.every` steps where the console is not a terminal (a Slurm log, `| tee`), so that a log
file shows how the run goes while it goes.

Under our launcher the console is a copy of the launcher's stdout (`rank_guard.CONSOLE_FD_ENV`)
while the rank's own stdout is its log: the step lines go to both.
"""

from __future__ import annotations

import os
import resource
import sys
import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.progress import Progress as RichProgress

from ultrascale.memory.report import size
from ultrascale.rank_guard import CONSOLE_FD_ENV

_console = None


def console_stream():
    """Where rank 0 talks to the user: the launcher's stdout, or this process's."""
    global _console
    if _console is None:
        fd = os.environ.get(CONSOLE_FD_ENV)
        try:
            _console = os.fdopen(int(fd), "w", buffering=1) if fd else sys.stdout
        except (OSError, ValueError):
            _console = sys.stdout
    return _console


def tell(text: str) -> None:
    """Rank 0's lines to the user: on the console, and in the rank's own log where that differs."""
    text = text if text.endswith("\n") else text + "\n"
    out = console_stream()
    out.write(text)
    out.flush()
    if out is not sys.stdout:
        sys.stdout.write(text)
        sys.stdout.flush()


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def step_line(record: dict, total: int, eta_s: float | None) -> str:
    """`step 10/200  loss 4.321  lr 3.00e-03  12,345 tok/s  mfu 41.2%  mem 1.23 GiB  eta 0:01:23`"""
    mem = record.get("memory") or {}
    peak = mem.get("peak_allocated_bytes")
    memory = f"mem {size(peak)}" if peak else f"rss {size(peak_rss_bytes())}"
    mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "-"
    eta = _duration(eta_s) if eta_s is not None else "-"
    val = f"  eval_loss {record['eval_loss']:.4f}" if record.get("eval_loss") is not None else ""
    return (f"step {record['step']}/{total}  loss {record['loss']:.4f}{val}  lr "
            f"{record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s  mfu {mfu}  {memory}  "
            f"eta {eta}")


class Progress:
    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled, self.total, self.start = enabled, total, start
        self.t0 = time.perf_counter()
        self.console = console_stream() if enabled else None
        self.bar = enabled and self.console.isatty()
        if self.bar:
            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"),
                TextColumn("[green]{task.fields[tps]} tok/s"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(),
                # The rank's own stdout and stderr are its log: rich must not take them over.
                console=Console(file=self.console), transient=False, redirect_stdout=False,
                redirect_stderr=False)
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-",
                                            tps="-")

    def __enter__(self):
        if self.bar:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self._bar.__exit__(*exc)

    def update(self, step: int, loss: float | None = None,
               tokens_per_s: float | None = None) -> None:
        """The bar at `step`; the loss and tokens/s where given (the steps the trainer reads)."""
        if not self.bar:
            return
        shown = {} if loss is None else {"loss": f"{loss:.3f}", "tps": f"{tokens_per_s:,.0f}"}
        self._bar.update(self._task, completed=step, **shown)

    def eta_s(self, step: int) -> float | None:
        done = step - self.start
        if done <= 0:
            return None
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    def log_step(self, record: dict) -> None:
        """A logged step (the metrics file's record) as one plain line: on the console when it
        is not a terminal, and in this rank's own log when that is elsewhere."""
        if self.enabled:
            self.note(step_line(record, self.total, self.eta_s(record["step"])))

    def note(self, text: str) -> None:
        """One plain line, where a logged step's goes."""
        if not self.enabled:
            return
        line = text + "\n"
        if not self.bar:
            self.console.write(line)
            self.console.flush()
        if self.console is not sys.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
