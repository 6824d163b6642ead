"""Ctrl-C and SIGTERM during training: stop at a step boundary with a checkpoint.

Slurm sends SIGTERM some time before it kills a job (its `--signal`, or the grace before
`KillWait`), torchrun forwards SIGTERM to its workers, and our launcher forwards Ctrl-C to its
ranks. A rank that gets one keeps computing the step in progress; the ranks agree at its end, in
the loss all-reduce they make anyway (`Runtime.global_loss_and_flag`: no extra collective), that
someone was signalled, save a checkpoint there and end, saying how to resume. Agreeing matters: a
signal reaches the ranks at slightly different moments, and a rank that stopped a step early
would leave the others waiting in a collective.

When the step in progress is not expected to end within `checkpoint.save_on_signal_s` (from the
last step's time), or that is 0, the signal stops the rank at once (KeyboardInterrupt), as does a
second signal.
"""

from __future__ import annotations

import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Installed for the training loop (main thread only); `requested` once a signal came."""

    def __init__(self, save_within_s: float):
        self.save_within_s = save_within_s
        self.signum: int | None = None
        self.step_started: float | None = None
        self.last_step_s: float | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def step(self, started: float | None = None, took: float | None = None) -> None:
        """Mark a step's start (`started`) or its duration once done (`took`)."""
        if started is not None:
            self.step_started = started
        if took is not None:
            self.last_step_s = took

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signum = signum
        if self.save_within_s <= 0 or self.remaining_s() > self.save_within_s:
            raise KeyboardInterrupt

    def remaining_s(self) -> float:
        """How long the step in progress should still take (0 before the first step's end)."""
        if self.last_step_s is None or self.step_started is None:
            return 0.0
        return max(0.0, self.last_step_s - (time.perf_counter() - self.step_started))
