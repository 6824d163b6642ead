"""Faults at scale on the local launcher and torchrun (issue 49): tiny runs of 6 steps with a
checkpoint every 2 and a fault drill (elastic.FaultDrill) striking as step 4 (or 3) begins:

- a rank SIGKILLed with launch.max_restarts=2: the run restarts from step 2 and ends well;
- two of four ranks losing their device for good with launch.min_dp=2: it goes on at dp2 with
  the same global batch (gradient accumulation 2 instead of 1);
- a rank stalled before a collective: the run ends within launch.collective_timeout_s (and the
  launcher's stop) naming that rank and the collective the other waits in;
- under torchrun (--max-restarts 1, parallel.dp=auto, training.global_batch_size): the restarted
  workers resume the newest checkpoint and rank 0 logs the restart.

The restarted runs must train what an uninterrupted run trains: the same losses at every step and
the same final weights (1e-5; see TOLERANCE), the gradient norms within parity.py's bounds, each
step logged once, and no rank left running. Global batch 8 sequences throughout; the reference is one process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_helpers import FAST, ultrascale
from parity import assert_grad_norms
from test_launcher import alive
from ultrascale import elastic
from ultrascale.checkpoint.gather import plain_state
from ultrascale.config import build_config
from ultrascale.supervisor import FAILED_GRACE_S
from ultrascale.train.trainer import train

# (memory_check off: a shared machine's free RAM comes and goes; these runs take ~0.5 GiB each)
COMMON = [*FAST, "--set", "precision.dtype=fp32", "--set", "logging.every=1",
          "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5",
          "--set", "launch.memory_check=false"]
# fp32 throughout: a restart in another dp sums the same 8 sequences' gradients in another order,
# a relative change of a few float32 ulps (~1e-7) that 6 AdamW steps carry into the losses and
# weights at ~1e-6. The fault this must see, injected once: a restart from step 2 at a global
# batch of 4 instead of 8 moves the loss of step 3 by 5e-3 and of step 4 by 2e-2 (relative).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def uninterrupted():
    """One process, 6 steps at a global batch of 8 (micro-batch 2 x 4 accumulated)."""
    overrides = [x for x in COMMON if x != "--set"] + ["training.grad_accum_steps=4",
                                                       "parallel.dp=1"]
    result = train(build_config({}, overrides), return_state=True, generate_sample=False)
    return result


def run(tmp_path: Path, name: str, drill: str, *extra: str) -> tuple[subprocess.CompletedProcess,
                                                                     float]:
    t0 = time.time()
    proc = ultrascale("train", *COMMON, "--set", f"logging.run_dir={name}", *extra, cwd=tmp_path,
                      env={elastic.DRILL_ENV: drill}, timeout=400)
    return proc, time.time() - t0


def rank_pids(run_dir: Path) -> list[int]:
    """Every rank process the run started, across its attempts (each rank logs its pid)."""
    pids = []
    for log in (run_dir / "rank_logs").glob("rank_*.log"):
        pids += [int(p) for p in re.findall(r"^rank \d+ of \d+ \(.*\): pid (\d+)", log.read_text(),
                                            re.M)]
    return pids


def assert_trains_as_uninterrupted(run_dir: Path, reference) -> None:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]  # each step once, in order
    torch.testing.assert_close(torch.tensor([m["loss"] for m in lines], dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64),
                               rtol=TOLERANCE, atol=0.0)
    # The norms of step 2 on are those of weights AdamW has already moved apart by round-off
    # (parity.py's LATER_NORM_RTOL says by how much; under ATEN_CPU_CAPABILITY=avx2 step 3's norm
    # here parts by 1.1e-5): the losses above hold the runs at 1e-5.
    assert_grad_norms({"grad_norms": reference.grad_norms},
                      {"grad_norms": [m["grad_norm"] for m in lines]})
    _, state = plain_state(run_dir / "checkpoints" / "step_00000006")
    assert state.keys() == reference.final_state.keys()
    for name, weight in reference.final_state.items():
        torch.testing.assert_close(state[name], weight, rtol=TOLERANCE, atol=TOLERANCE,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # Nothing written before the last checkpoint is lost: the step-2 checkpoint resumed from
    # stays, complete.
    assert (run_dir / "checkpoints" / "step_00000002" / "meta.json").is_file()


def processes_naming(text: str) -> list[int]:
    """Processes whose command line holds `text` (a run folder's unique name)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def assert_no_rank_left(run_dir: Path, attempts: int, world: int) -> None:
    pids = rank_pids(run_dir)
    assert len(pids) == attempts * world, pids
    assert not [p for p in pids if alive(p)], "a rank outlived its job"


@pytest.mark.slow
def test_a_killed_rank_restarts_from_its_checkpoint_and_trains_on_exactly(tmp_path,
                                                                             uninterrupted):
    proc, took = run(tmp_path, "killed", "kill:rank=1:step=4", "--set", "launch.max_restarts=2",
                     "--set", "training.grad_accum_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1 of 2: rank 1 killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    (restart,) = elastic.read_restarts(tmp_path / "killed")
    assert restart["cause"] == "rank 1 killed by SIGKILL" and restart["dp"] == 2
    assert restart["resume"].endswith("step_00000002")
    assert_trains_as_uninterrupted(tmp_path / "killed", uninterrupted)
    assert_no_rank_left(tmp_path / "killed", attempts=2, world=2)
    print(f"killed rank, restarted: {took:.1f} s")


@pytest.mark.slow
def test_ranks_lost_for_good_leave_and_the_run_goes_on_at_the_same_global_batch(tmp_path,
                                                                                uninterrupted):
    proc, took = run(tmp_path, "shrunk", "lose:rank=2,3:step=4", "--set", "parallel.dp=4",
                     "--set", "launch.max_restarts=1", "--set", "launch.min_dp=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (restart,) = elastic.read_restarts(tmp_path / "shrunk")
    assert sorted(restart["lost_ranks"]) == [2, 3]
    assert (restart["dp"], restart["grad_accum_steps"], restart["global_batch"]) == (2, 2, 8)
    assert "lost its device for good" in proc.stderr
    assert_trains_as_uninterrupted(tmp_path / "shrunk", uninterrupted)
    pids = rank_pids(tmp_path / "shrunk")
    assert len(pids) == 4 + 2 and not [p for p in pids if alive(p)], pids
    print(f"two of four ranks lost, went on at dp2: {took:.1f} s")


@pytest.mark.slow
def test_a_stalled_rank_is_named_with_the_collective_the_others_wait_in(tmp_path):
    timeout = 5
    args = [sys.executable, "-m", "ultrascale.cli", "train", *COMMON, "--set",
            "logging.run_dir=stalled", "--set", f"launch.collective_timeout_s={timeout}",
            "--set", "launch.max_restarts=0"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                **{elastic.DRILL_ENV: "stall:rank=1:step=3"}))
    log = tmp_path / "stalled" / "rank_logs" / "rank_1.log"
    deadline = time.time() + 300
    while not (log.is_file() and "fault drill: rank 1 stall" in log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    stalled_at = time.time()
    _, err = proc.communicate(timeout=120)
    took = time.time() - stalled_at
    assert proc.returncode == 1
    # Rank 0 gives up after the timeout; the launcher then stops rank 1 (SIGTERM, SIGKILL after
    # its grace of 1 s): a few seconds of slack on a loaded machine.
    assert took < timeout + FAILED_GRACE_S + 4, took
    assert re.search(r"^  rank 1 never entered all_reduce on dp #\d+ \([\d.]+ MiB\), which rank 0 "
                     r"waits in since", err, re.M), err
    assert "error: training failed (rank 1 never entered all_reduce on dp" in err
    assert_no_rank_left(tmp_path / "stalled", attempts=1, world=2)
    print(f"stalled rank named: {took:.1f} s after the stall")


@pytest.mark.slow
def test_under_torchrun_a_restarted_attempt_resumes_at_the_dp_its_world_gives(tmp_path,
                                                                             uninterrupted):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--max-restarts=1", "-m", "ultrascale.cli"]
    t0 = time.time()
    proc = ultrascale("train", *COMMON, "--set", "logging.run_dir=elastic", "--set",
                      "parallel.dp=auto", "--set", "training.global_batch_size=8", cwd=tmp_path,
                      launcher=torchrun, timeout=300,
                      env={elastic.DRILL_ENV: "kill:rank=1:step=4",
                           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    took = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    (restart,) = elastic.read_restarts(tmp_path / "elastic")  # written by the new rank 0
    assert restart["resume"].endswith("step_00000002")
    assert (restart["dp"], restart["grad_accum_steps"]) == (2, 2)
    # Rank 0 records losing its peer (the killed rank leaves no record), unless torchrun stops
    # it first, a race on a loaded machine: then the cause says no rank left one (docs/faults.md).
    assert "Connection" in restart["cause"] or \
        restart["cause"].startswith("no rank left a record: a rank was killed"), restart["cause"]
    assert_trains_as_uninterrupted(tmp_path / "elastic", uninterrupted)
    assert processes_naming("logging.run_dir=elastic") == []  # no worker outlived torchrun
    print(f"torchrun restart: {took:.1f} s")
