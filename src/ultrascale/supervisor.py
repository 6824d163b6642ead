"""The local launcher: one process per rank, each with its own log, watched until all end.

Each rank's stdout and stderr go to `rank_logs/rank_N.log`; rank 0 also gets a copy of the
launcher's stdout for its progress (a bar on a terminal, step lines otherwise). When a rank ends
badly the others are stopped and the launcher says once which rank failed and why: the exception
and the line that raised it (the full traceback stays in the rank's log), or the signal that
killed it with its likely cause. If the launcher itself is killed, the ranks die with it
(rank_guard.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ultrascale.distributed.recorder import diagnose_dir, record_path, views_path
from ultrascale.elastic import RESTART_COUNT_ENV, Failure
from ultrascale.rank_guard import (CONSOLE_FD_ENV, ERROR_FILE_ENV, LAUNCHER_PID_ENV,
                                   read_failure)

POLL_S = 0.1
GATHER_S = 0.5  # after a first failure, how long other ranks get to end on their own (the cause
# and its consequences then come in one report)
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this
# After a failure the others cannot save (a peer is gone) and would only finish their step into a
# collective that never returns (train/interrupt.py keeps a SIGTERMed rank going): a short grace.
FAILED_GRACE_S = 1.0
# On Ctrl-C or SIGTERM the ranks finish their step and save (train/interrupt.py): the launcher
# waits checkpoint.save_on_signal_s for the step and this long besides for the save.
SAVE_MARGIN_S = 300.0

SIGNAL_CAUSES = {
    signal.SIGKILL: "most likely the kernel's out-of-memory killer (`dmesg | grep -i oom` or "
                    "`journalctl -k` says so), or a `kill -9` / a scheduler's hard stop",
    signal.SIGSEGV: "a crash in native code (torch, a driver); the end of its log may say more",
    signal.SIGABRT: "an abort in native code (often a failed check in gloo, NCCL or CUDA); the "
                    "end of its log may say more",
    signal.SIGBUS: "a bus error: often a full /dev/shm or a memory-mapped file that shrank",
    signal.SIGTERM: "terminated from outside (a `kill`, a scheduler's time limit)",
    signal.SIGINT: "interrupted",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rank:
    index: int
    proc: subprocess.Popen
    log: Path
    error_file: Path
    returncode: int | None = None
    ended_at: float | None = None
    stopped_by_us: bool = False

    def state(self) -> str:
        """What a rank still running is doing, from /proc (Linux): stopped, in I/O, running."""
        try:
            code = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "running"
        return {"T": "stopped by a signal", "t": "stopped by a debugger",
                "D": "in uninterruptible I/O", "Z": "ending"}.get(code, "running")


class LocalRanks:
    """Start `world` ranks of `cmd` on this machine and watch them until they end."""

    def __init__(self, cmd: list[str], world: int, log_dir: Path, env: dict[str, str], *,
                 collective_timeout_s: float | None = None, memory_line: str = "",
                 save_on_signal_s: float = 0.0, attempt: int = 0):
        self.cmd, self.world, self.log_dir, self.env = cmd, world, Path(log_dir), env
        self.collective_timeout_s = collective_timeout_s
        self.save_on_signal_s = save_on_signal_s
        self.memory_line = memory_line
        self.attempt = attempt  # 0, or the restart this is (elastic.py): logs are appended to
        self.ranks: list[Rank] = []
        self.interrupted: int | None = None
        self.failure: Failure | None = None  # what ended a failed run (report)

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        console = None
        try:
            console = os.dup(sys.stdout.fileno())
            sys.stdout.flush()
        except (AttributeError, OSError, ValueError):  # no real stdout (embedded, captured)
            console = None
        for r in range(self.world):
            log = self.log_dir / f"rank_{r}.log"
            error_file = self.log_dir / f"rank_{r}.error.json"
            for stale in (error_file, record_path(self.log_dir, r), views_path(self.log_dir, r)):
                stale.unlink(missing_ok=True)  # (a previous attempt's)
            env = dict(self.env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(self.world),
                       LOCAL_WORLD_SIZE=str(self.world), GROUP_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1")
            env[RESTART_COUNT_ENV] = str(self.attempt)
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            env[ERROR_FILE_ENV] = str(error_file)
            fds: tuple[int, ...] = ()
            if r == 0 and console is not None:
                env[CONSOLE_FD_ENV] = str(console)
                fds = (console,)
            with log.open("a" if self.attempt else "w") as out:
                if self.attempt:
                    out.write(f"\n===== restart {self.attempt} =====\n")
                    out.flush()
                # A session of its own: a Ctrl-C at the terminal reaches the launcher, which stops
                # the ranks in order, rather than every process at once.
                proc = subprocess.Popen(self.cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, pass_fds=fds,
                                        start_new_session=True)
            self.ranks.append(Rank(r, proc, log, error_file))
        if console is not None:
            os.close(console)

    # -- watch -----------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self.interrupted = signum

    def _poll(self) -> None:
        now = time.time()
        for rank in self.ranks:
            if rank.returncode is None:
                rc = rank.proc.poll()
                if rc is not None:
                    rank.returncode, rank.ended_at = rc, now

    def _failed(self) -> list[Rank]:
        return [r for r in self.ranks if r.returncode not in (None, 0) and not r.stopped_by_us]

    def run(self) -> int:
        """Start the ranks, wait for them; on a failure stop the others and report. Returns the
        launcher's exit code."""
        handlers = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.start()
            while True:
                self._poll()
                if self.interrupted or self._failed():
                    break
                if all(r.returncode == 0 for r in self.ranks):
                    return 0
                time.sleep(POLL_S)
            if self.interrupted:
                return self._stop_on_signal()
            deadline = time.time() + GATHER_S
            while time.time() < deadline and any(r.returncode is None for r in self.ranks):
                time.sleep(POLL_S / 2)
                self._poll()
            still_running = {r.index: r.state() for r in self.ranks if r.returncode is None}
            self.stop(FAILED_GRACE_S)
            return self.report(still_running)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.ranks:
                self.stop()

    def _stop_on_signal(self) -> int:
        """Pass the signal on: the ranks finish their step, save and end (rank 0 says how to
        resume). A second signal, or ranks still running past the wait, are stopped at once."""
        signum, self.interrupted = self.interrupted, None
        name = signal.Signals(signum).name
        alive = [r for r in self.ranks if r.proc.poll() is None]
        for r in alive:
            try:
                os.killpg(r.proc.pid, signum)
            except ProcessLookupError:
                pass
        wait = self.save_on_signal_s + SAVE_MARGIN_S if self.save_on_signal_s else STOP_GRACE_S
        deadline = time.time() + wait
        while time.time() < deadline and not self.interrupted and \
                any(r.proc.poll() is None for r in self.ranks):
            time.sleep(POLL_S)
        hard = [r.index for r in self.ranks if r.proc.poll() is None]
        self.stop()
        how = (f"stopped rank(s) {', '.join(map(str, hard))} at once" if hard else
               "the ranks ended at a step boundary")
        print(f"interrupted ({name}): {how}; their logs are in {self.log_dir}", file=sys.stderr)
        return 128 + signum

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM (and SIGCONT, for a stopped rank) to every rank still running, SIGKILL to
        those left after `grace` seconds."""
        alive = [r for r in self.ranks if r.proc.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for r in alive:
                r.stopped_by_us = True
                try:
                    os.killpg(r.proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        for r in alive:
            try:
                r.proc.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.proc.wait()
        self._poll()

    # -- report ----------------------------------------------------------------------------------

    def _cause_order(self, rank: Rank) -> tuple:
        record = read_failure(rank.error_file) or {}
        consequence = record.get("kind") == "peer_lost"
        return (consequence, record.get("time", rank.ended_at or 0), rank.index)

    def describe(self, rank: Rank) -> tuple[str, list[str]]:
        """A one-line verdict on a failed rank and the lines under it."""
        rc = rank.returncode or 0
        if rc < 0:
            sig = signal.Signals(-rc)
            cause = SIGNAL_CAUSES.get(sig, "a signal from outside or from native code")
            extra = [f"memory estimate at start: {self.memory_line}"] \
                if sig == signal.SIGKILL and self.memory_line else []
            return f"rank {rank.index} was killed by {sig.name} (signal {-rc}): {cause}.", extra
        record = read_failure(rank.error_file)
        if record is None:
            tail = [x for x in _tail(rank.log, 5) if x.strip()]
            return (f"rank {rank.index} exited with code {rc} without a Python error; the end of "
                    f"its log ({rank.log}):", ["| " + x for x in tail])
        if record.get("kind") == "config":
            return f"rank {rank.index}: {record['message']}", []
        if record.get("kind") == "device_lost":
            return (f"rank {rank.index} lost its device for good: {record['type']}: "
                    f"{record['message']}"), []
        head = f"rank {rank.index} failed: {record['type']}: {record['message']}"
        if record.get("kind") == "collective_timeout":
            limit = (f"launch.collective_timeout_s={self.collective_timeout_s:g} s"
                     if self.collective_timeout_s else "launch.collective_timeout_s")
            head = (f"rank {rank.index} waited longer than {limit} in a collective: a rank it "
                    f"waited for stopped answering ({record['type']}: {record['message']})")
        return head, record.get("detail", []) + [w if w.startswith("called from") else "at " + w
                                                 for w in record.get("where", [])]

    def report(self, still_running: dict[int, str]) -> int:
        failed = sorted(self._failed(), key=self._cause_order)
        if not failed:
            return 0
        first = failed[0]
        records = {r.index: read_failure(r.error_file) or {} for r in failed}
        hang = []
        # NCCL's watchdog ends a rank that timed out with an abort, without a Python record.
        aborted = any(r.returncode == -signal.SIGABRT for r in failed)
        if still_running or aborted or any(rec.get("kind") == "collective_timeout"
                                           for rec in records.values()):
            # Who waits in which collective, and who never came (each rank's recorder file).
            hang = diagnose_dir(self.log_dir, self.world)
        self.failure = Failure(
            hang[0] if hang else self._short_cause(first), [r.index for r in failed],
            [i for i, rec in records.items() if rec.get("kind") == "device_lost"],
            restartable=records[first.index].get("kind") != "config")
        shown: set[tuple] = set()
        code = 2 if (read_failure(first.error_file) or {}).get("kind") == "config" else 1
        for i, rank in enumerate(failed):
            record = read_failure(rank.error_file) or {}
            key = (record.get("type"), record.get("message"), tuple(record.get("where", [])))
            if record and key in shown:  # the same error on several ranks: shown once
                continue
            shown.add(key)
            head, lines = self.describe(rank)
            if i == 0 or record.get("kind") != "peer_lost":
                print(f"error: {head}", file=sys.stderr)
                for line in lines:
                    print(f"    {line}", file=sys.stderr)
                if record and record.get("kind") != "config":
                    print(f"    full traceback: {rank.log}", file=sys.stderr)
            else:
                print(f"  then rank {rank.index} ended too: it lost the connection to a failed "
                      f"rank ({record.get('type')})", file=sys.stderr)
        if still_running:
            named = ", ".join(f"rank {r} ({state})" for r, state in sorted(still_running.items()))
            print(f"  still running when it failed, stopped by the launcher: {named}",
                  file=sys.stderr)
        for line in hang:
            print(f"  {line}", file=sys.stderr)
        # The last line says the cause too: tools that keep one line of a failed run (a sweep's
        # results table) keep the reason.
        print(f"error: training failed ({self.failure.cause}); every rank's log is in "
              f"{self.log_dir}", file=sys.stderr)
        return code

    def _short_cause(self, rank: Rank) -> str:
        rc = rank.returncode or 0
        if rc < 0:
            return f"rank {rank.index} killed by {signal.Signals(-rc).name}"
        record = read_failure(rank.error_file)
        if record is None:
            return f"rank {rank.index} exited with code {rc}"
        text = f"rank {rank.index}: {record['type']}: {record['message']}"
        return text if len(text) <= 160 else text[:157] + "..."


def _tail(path: Path, n: int) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:
        return []
