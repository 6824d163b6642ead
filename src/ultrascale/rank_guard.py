"""What a rank does so that it never outlives its launcher, and how it reports its own failure.

A rank that keeps training after its launcher is gone holds a GPU nobody owns and changes a
checkpoint folder under its user's feet. So a rank started by our launcher asks the kernel to kill
it the moment the launcher dies (`PR_SET_PDEATHSIG`), checks that the launcher did not die before
it asked, and watches its parent besides (where there is no prctl, and under torchrun or srun,
whose agents start their workers in ways we do not control).

A failing rank writes its full traceback to its own log and one JSON record for the launcher:
the rank, the exception, its message and the line that raised it, which the launcher shows once.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

LAUNCHER_PID_ENV = "ULTRASCALE_LAUNCHER_PID"  # set by our launcher for the ranks it starts
ERROR_FILE_ENV = "ULTRASCALE_ERROR_FILE"  # where a failing rank writes its record
CONSOLE_FD_ENV = "ULTRASCALE_CONSOLE_FD"  # rank 0's copy of the launcher's stdout
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What CUDA says when a GPU is gone for good (Xid 79 "fallen off the bus", a retired page, a
# device the driver no longer offers): a restart on it would fail again.
DEVICE_GONE = ("fallen off the bus", "uncorrectable ecc error", "cudaerrordevicesunavailable",
               "busy or unavailable")
WATCH_INTERVAL_S = 0.2


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel would: no cleanup, no further writes


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    def watch():
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if os.getppid() != parent:
                _die()

    threading.Thread(target=watch, name="ultrascale-parent-watch", daemon=True).start()


def guard_rank() -> None:
    """Call first thing in a rank. Under our launcher: die with it (prctl, plus a check that it is
    still our parent, plus a watch). Under torchrun/srun: watch the parent (the agent)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:
        parent = int(launcher)
        _set_parent_death_signal()
        if os.getppid() != parent:  # it died before the prctl: the kernel will not tell us
            _die()
        _watch_parent(parent)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _watch_parent(os.getppid())


def _frame_text(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    parts = path.parts
    short = "/".join(parts[parts.index("ultrascale"):]) if "ultrascale" in parts else \
        "/".join(parts[-2:])
    return f"{short}:{frame.lineno} in {frame.name}" + (f": {frame.line}" if frame.line else "")


def describe_exception(exc: BaseException) -> dict:
    """The short form: exception type, message, the frame that raised it and, when that frame is
    outside this package, our innermost frame that led there."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = [_frame_text(frames[-1])] if frames else []
    ours = [f for f in frames if f"{os.sep}ultrascale{os.sep}" in f.filename]
    if frames and ours and ours[-1] is not frames[-1]:
        where.append("called from " + _frame_text(ours[-1]))
    message = str(exc).strip()
    kind = "error"
    low = message.lower()
    if type(exc).__name__ == "DeviceLost" or any(s in low for s in DEVICE_GONE):
        kind = "device_lost"  # the launcher goes on without this rank's replica (elastic.py)
    elif "timed out" in low or ("timeout" in low and "collective" in low):
        kind = "collective_timeout"
    elif "connection closed by peer" in low or "connection reset by peer" in low \
            or "broken pipe" in low:
        kind = "peer_lost"  # another rank went away: a consequence, not the cause
    record = {"type": type(exc).__name__,
              "message": message.splitlines()[0][:500] if message else "", "where": where,
              "kind": kind}
    if type(exc).__name__ == "DeviceOutOfMemory":  # its table of where the memory went
        record.update(kind="out_of_memory", detail=message.splitlines()[1:40])
    return record


def record_failure(exc: BaseException, rank: int, kind: str | None = None) -> None:
    """The full traceback to stderr (this rank's log), the short record for the launcher."""
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    record = describe_exception(exc)
    if kind:
        record["kind"] = kind
        record["where"] = []  # a configuration error: the message says all
        record["message"] = str(exc)
    record.update(rank=rank, time=time.time())
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def read_failure(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
