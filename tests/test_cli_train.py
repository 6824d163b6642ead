"""The training command end to end: outputs, resume after a kill, a failing rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cli_helpers import FAST, ultrascale


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def read_metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_train_two_ranks_writes_metrics_checkpoint_and_sample(tmp_path):
    # stdout is a pipe here, as in a Slurm log: rank 0 prints a plain line per logged step.
    proc = ultrascale("train", *FAST, "--set", "logging.sample_tokens=20",
                      "--set", "logging.every=2", "--set", "logging.progress=true",
                      "--set", "logging.run_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = re.compile(r"^step (\d+)/6  loss \d+\.\d+  lr \S+  [\d,]+ tok/s  mfu -  "
                      r"rss \d+(?:\.\d+)? [MG]iB  eta \d+:\d\d:\d\d$", re.M)
    assert [int(m) for m in line.findall(proc.stdout)] == [1, 2, 4, 6], proc.stdout
    # Each rank's output in its own log, rank 0's step lines too; the run's files.
    logs = tmp_path / "run" / "rank_logs"
    rank0, rank1 = (logs / "rank_0.log").read_text(), (logs / "rank_1.log").read_text()
    assert "rank 0 of 2 (pp 0, dp 0, cp 0, tp 0)" in rank0 and len(line.findall(rank0)) == 4
    assert "rank 1 of 2 (pp 0, dp 1, cp 0, tp 0)" in rank1 and "rank 1: finished" in rank1
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert "1: {pp: 0, dp: 1, cp: 0, tp: 0}" in (tmp_path / "run" / "layout.yaml").read_text()
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sorted(metrics) == [1, 2, 4, 6]
    first = metrics[1]
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "loss_tokens", "step_time_s",
                "tokens_per_s", "mfu", "memory", "comm"):
        assert key in first
    assert first["mfu"] is None  # no known peak rate on a CPU
    assert first["tokens"] == 2 * 2 * 32  # dp=2 x micro-batch 2 x seq 32
    assert first["loss_tokens"] == first["tokens"]  # text without document masks: every target
    # Plain DP all-reduces every gradient once per step, in fp32 whatever the compute dtype
    # (`auto`: bf16 here if this CPU has bf16 instructions; config.yaml and the checkpoint say
    # which): bytes = parameters x 4.
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    dtype = config["precision"]["dtype"]
    assert dtype in ("fp32", "bf16")
    params = first["memory"]["params_bytes"] // (4 if dtype == "fp32" else 2)
    assert first["comm"]["all_reduce/dp"]["bytes"] == 4 * params
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000006" / "meta.json")
                      .read_text())
    assert meta["layout"]["dtype"] == dtype and f"precision: {dtype}" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000006" / "meta.json").is_file()
    assert "sample:" in proc.stdout and "metrics:" in proc.stdout


def test_resume_after_sigkill_and_sigterm_gives_identical_losses(tmp_path):
    # Long enough steps (~0.1 s) that the kill lands well before step 20.
    common = [*FAST, "--set", "training.steps=20", "--set", "logging.every=1",
              "--set", "training.seq_len=128", "--set", "training.micro_batch_size=4"]
    full = ultrascale("train", *common, "--set", "logging.run_dir=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    _sigterm_saves_and_says_how_to_resume(tmp_path, common,
                                          read_metrics(tmp_path / "full" / "metrics.jsonl"))

    ckdir = tmp_path / "ck"
    args = [sys.executable, "-m", "ultrascale.cli", "train", *common,
            "--set", "logging.run_dir=killed", "--set", f"checkpoint.dir={ckdir}",
            "--set", "checkpoint.every=10", "--set", "checkpoint.keep=5"]
    proc = subprocess.Popen(args, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 240
    while not (ckdir / "step_00000010" / "meta.json").exists():
        assert proc.poll() is None, "run ended before writing its step-10 checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    for pid in process_tree(proc.pid):  # like a crashed node: every process dies at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    # Only complete checkpoints are visible; a kill mid-save leaves at most a dot-prefixed folder.
    assert all((p / "meta.json").is_file() for p in ckdir.glob("step_*"))

    # Continued in the same run folder: the steps logged after the checkpoint are trained again,
    # and their new lines replace the old ones (issue 50: they were appended, steps 11, 12, 11).
    resumed = ultrascale("train", *common, "--set", "logging.run_dir=killed",
                         "--set", f"checkpoint.dir={ckdir}", "--set", "checkpoint.resume=auto",
                         "--set", "checkpoint.every=10", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    full_m = read_metrics(tmp_path / "full" / "metrics.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))  # monotonic, each step once
    for r in lines:
        assert r["loss"] == full_m[r["step"]]["loss"], r["step"]


def _sigterm_saves_and_says_how_to_resume(tmp_path, common: list[str], full: dict) -> None:
    """Issue 50: SIGTERM (what Slurm sends before a kill; Ctrl-C alike) to the launcher of a dp=2
    run: the ranks agree on a step boundary, save there and end; rank 0 prints the command that
    resumes, which continues with the uninterrupted run's losses (bit for bit: the same layout)."""
    proc = subprocess.Popen([sys.executable, "-m", "ultrascale.cli", "train", *common,
                             "--set", "logging.run_dir=term"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+): checkpoint ", out).group(1))
    assert 3 <= stopped < 20 and "Traceback" not in err
    assert (tmp_path / "term" / "checkpoints" / f"step_{stopped:08d}" / "meta.json").is_file()
    command = re.search(r"resume with: ultrascale (.*)", out).group(1)
    assert command == "train term/config.yaml --set checkpoint.resume=auto"
    resumed = ultrascale(*command.split(), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    term = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in term] == list(range(1, 21))
    for r in term:
        assert abs(r["loss"] - full[r["step"]]["loss"]) <= 1e-6, r["step"]


def test_failing_rank_fails_the_run_with_its_error(tmp_path):
    ckdir = tmp_path / "ck"
    ok = ultrascale("train", *FAST, "--set", f"checkpoint.dir={ckdir}", "--set",
                    "logging.run_dir=a", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    # Corrupt rank 1's file only, keeping its size (a wrong size is refused before launch): rank 1
    # fails reading its RNG state there while rank 0, which reads only rank 0's file (it wrote
    # every weight; rank 1 held replicas), goes on into a collective.
    with open(ckdir / "step_00000006" / "rank_00001.safetensors", "r+b") as f:
        f.write(b"not a safetensors file")
    # ... as written so (its digest in meta.json matches: a bad write, not a change on disk, which
    # the digest would refuse by name).
    from ultrascale.checkpoint.index import file_sha256

    meta_file = ckdir / "step_00000006" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["sha256"]["rank_00001.safetensors"] = file_sha256(ckdir / "step_00000006" /
                                                           "rank_00001.safetensors")
    meta_file.write_text(json.dumps(meta))
    t0 = time.time()
    bad = ultrascale("train", *FAST, "--set", "training.steps=12", "--set",
                     f"checkpoint.dir={ckdir}", "--set", "checkpoint.resume=auto",
                     "--set", "logging.run_dir=b", cwd=tmp_path, timeout=200)
    assert bad.returncode != 0
    assert time.time() - t0 < 180  # no hang
    # Shown once and short: the rank, the exception, the line; the traceback in the rank's log.
    assert bad.stderr.count("rank 1 failed: SafetensorError") == 1, bad.stderr
    assert "checkpoint/store.py" in bad.stderr and "Traceback" not in bad.stderr
    assert "training failed" in bad.stderr
    log = (tmp_path / "b" / "rank_logs" / "rank_1.log").read_text()
    assert "Traceback (most recent call last)" in log and "SafetensorError" in log
