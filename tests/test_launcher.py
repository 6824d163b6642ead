"""The local launcher ends with its ranks and its ranks with it (issue 34): a kill of the launcher
leaves no rank training, a kill of a rank ends the run within a minute naming it, a rank stuck in
a collective ends the run within launch.collective_timeout_s. Tiny runs; each waits for the ranks
to be training before it strikes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import FAST
from test_cli_train import process_tree, read_metrics

# Long enough never to end on its own during a test; every step logged.
RUN = [*FAST, "--set", "training.steps=5000", "--set", "logging.every=1"]


def start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "ultrascale.cli", "train", *RUN, "--set", "logging.run_dir=run",
            *extra]
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's rank processes (their RANK variable)."""
    out = {}
    for pid in process_tree(launcher)[1:]:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


def wait_for(condition, proc: subprocess.Popen, timeout: float = 180, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def steps_logged(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_rank_at_once(tmp_path):
    proc = start(tmp_path, "--set", "checkpoint.every=1")
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: steps_logged(metrics) >= 3, proc, what="three logged steps")
    ranks = rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1]
    proc.kill()  # what the OOM killer or a scheduler's hard stop does
    proc.wait()
    killed_at = time.time()
    logged, checkpoints = steps_logged(metrics), sorted((tmp_path / "run" / "checkpoints").iterdir())
    while any(alive(p) for p in ranks.values()):
        assert time.time() - killed_at < 5, "a rank outlived its launcher by 5 s"
        time.sleep(0.02)
    time.sleep(2)  # anything still writing would show now
    assert steps_logged(metrics) == logged, "a step was logged after the launcher was killed"
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == checkpoints


@pytest.mark.slow
def test_sigkill_of_a_rank_ends_the_run_naming_it_and_the_checkpoint_resumes(tmp_path):
    proc = start(tmp_path, "--set", "checkpoint.every=3", "--set", "checkpoint.keep=2")
    ckdir = tmp_path / "run" / "checkpoints"
    wait_for(lambda: (ckdir / "step_00000003" / "meta.json").exists(), proc,
             what="the step-3 checkpoint")
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    killed_at = time.time()
    _, err = proc.communicate(timeout=90)
    assert time.time() - killed_at < 60
    assert proc.returncode != 0
    assert "rank 1 was killed by SIGKILL" in err and "out-of-memory killer" in err, err
    assert "Traceback" not in err
    # Every visible checkpoint is complete, and the newest resumes.
    steps = sorted(ckdir.glob("step_*"))
    assert steps and all((p / "meta.json").is_file() for p in steps)
    last = int(steps[-1].name.split("_")[1])
    resumed = subprocess.run(
        [sys.executable, "-m", "ultrascale.cli", "train", *FAST, "--set", f"checkpoint.dir={ckdir}",
         "--set", "checkpoint.resume=auto", "--set", f"training.steps={last + 2}",
         "--set", "logging.every=1", "--set", "logging.run_dir=resumed"],
        cwd=tmp_path, capture_output=True, text=True, timeout=200,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(read_metrics(tmp_path / "resumed" / "metrics.jsonl")) == [last + 1, last + 2]


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_ends_the_run_within_the_timeout(tmp_path):
    timeout = 5
    proc = start(tmp_path, "--set", f"launch.collective_timeout_s={timeout}")
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: steps_logged(metrics) >= 3, proc, what="three logged steps")
    stuck = rank_pids(proc.pid)[1]
    os.kill(stuck, signal.SIGSTOP)  # rank 1 stops answering; rank 0 waits for it in a collective
    stopped_at = time.time()
    try:
        _, err = proc.communicate(timeout=timeout + 55)
    finally:
        if alive(stuck):
            os.kill(stuck, signal.SIGKILL)
    assert time.time() - stopped_at < timeout + 30
    assert proc.returncode != 0
    assert f"rank 0 waited longer than launch.collective_timeout_s={timeout} s" in err, err
    assert "rank 1 (stopped by a signal)" in err, err
    assert not alive(stuck)  # the launcher stopped it


def test_a_finished_rank_leaves_before_the_interpreters_teardown():
    """`launch._leave`: a spawned rank that has finished exits with its code at once, so that
    nothing in the interpreter's teardown can turn a finished run into a failed one (a gloo rank
    aborted there now and then: "terminate called without an active exception"). Stand-in for
    that teardown: an exit handler that aborts, which the plain exit runs and `_leave` skips."""
    prelude = "import atexit, os; atexit.register(os.abort); print('out', flush=True)"
    plain = subprocess.run([sys.executable, "-c", prelude + "; raise SystemExit(0)"],
                           capture_output=True, text=True)
    assert plain.returncode != 0  # the stand-in does abort a plain exit
    left = subprocess.run([sys.executable, "-c", prelude + "; from ultrascale.launch import "
                           "_leave; _leave(3)"], capture_output=True, text=True)
    assert left.returncode == 3 and left.stdout == "out\n"
