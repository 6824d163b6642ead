"""Rank 0's console (issue 36): a bar with the time left on a terminal, plain step lines elsewhere,
and the step lines in the rank's own log when the console is the launcher's."""

import io
import os
import pty
import select
import sys

import pytest

from ultrascale.rank_guard import CONSOLE_FD_ENV
from ultrascale.train import progress

RECORD = {"step": 10, "loss": 4.25, "lr": 3e-4, "tokens_per_s": 12345.6, "mfu": 0.412,
          "memory": {"peak_allocated_bytes": 3 * 2**30}}


def test_step_line_has_step_loss_lr_throughput_mfu_memory_and_eta():
    line = progress.step_line(RECORD, total=200, eta_s=83.4)
    assert line == ("step 10/200  loss 4.2500  lr 3.00e-04  12,346 tok/s  mfu 41.2%  "
                    "mem 3.00 GiB  eta 0:01:23")
    cpu = progress.step_line({**RECORD, "mfu": None, "memory": {}}, total=200, eta_s=None)
    assert "mfu -" in cpu and "rss " in cpu and cpu.endswith("eta -")


def test_a_terminal_gets_a_bar_with_the_time_left(monkeypatch):
    master, slave = pty.openpty()
    monkeypatch.setenv(CONSOLE_FD_ENV, str(slave))
    monkeypatch.setattr(progress, "_console", None)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)  # the rank's own log
    bar = progress.Progress(total=4, start=0, enabled=True)
    assert bar.bar
    with bar:
        for step in range(1, 5):
            bar.update(step, 4.0, 1000.0)
            bar.log_step({**RECORD, "step": step})
    chunks = []
    while select.select([master], [], [], 0.5)[0]:  # everything the bar wrote, in pieces
        chunks.append(os.read(master, 65536))
    os.close(master)  # (the slave end belongs to the console stream, which closes it)
    shown = b"".join(chunks).decode(errors="replace")
    assert "eta" in shown and "4/4" in shown
    assert "step " not in shown  # no plain lines under the bar
    assert log.getvalue().count("step ") == 4  # but in the log, each logged step


def test_a_pipe_gets_plain_step_lines(monkeypatch):
    out = io.StringIO()
    monkeypatch.delenv(CONSOLE_FD_ENV, raising=False)
    monkeypatch.setattr(progress, "_console", None)
    monkeypatch.setattr(sys, "stdout", out)
    bar = progress.Progress(total=4, start=0, enabled=True)
    assert not bar.bar
    bar.log_step(RECORD)
    assert out.getvalue().startswith("step 10/4  loss 4.2500")
    assert out.getvalue().count("\n") == 1  # once, though console and log are the same stream


def test_a_signal_waits_for_the_steps_end_only_when_it_comes_within_the_setting():
    """train/interrupt.py: the first SIGTERM or SIGINT marks a stop at the step's end when the
    step should end within checkpoint.save_on_signal_s; otherwise, or at a second signal, the
    rank stops at once. The handlers are the previous ones again afterwards."""
    import signal
    import time

    from ultrascale.train.interrupt import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(60.0) as stop:
        stop.step(started=time.perf_counter())  # the first step: its length is not known yet
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a second signal
    assert signal.getsignal(signal.SIGTERM) is before
    with StopRequest(1.0) as stop:
        stop.step(took=100.0)
        stop.step(started=time.perf_counter())  # 100 s to go: more than 1 s
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    with StopRequest(0.0):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
