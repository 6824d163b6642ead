"""Resuming from the command line (issue 32): settings that change no saved state and a larger world
are accepted with one line saying what differs; raising training.steps says how the learning rate
continues; a bad checkpoint is refused before any process starts, naming the file or tensor; a
SIGKILL of the whole job during a save leaves the previous checkpoint intact and resumable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import FAST, ultrascale
from test_cli_train import process_tree, read_metrics
from test_preflight import assert_refused, train
from ultrascale.train.schedule import lr_at


def sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


# fp32 for the runs that resume in another world and micro-batch size and compare losses to
# 1e-5: exact only there (`auto` is bf16 on a CPU with bf16 instructions: docs/precision.md).
FP32 = "precision.dtype=fp32"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """dp2, 6 steps in fp32, checkpoints at steps 3 and 6, every step logged."""
    root = tmp_path_factory.mktemp("resume")
    run = ultrascale("train", *FAST, *sets(FP32, "checkpoint.every=3", "logging.every=1",
                                           "logging.run_dir=a"), cwd=root)
    assert run.returncode == 0, run.stderr
    return root


def step_of(folder) -> int:
    """The step of `step_00000006` or of a save in flight, `.step_00000006.tmp`."""
    return int(folder.name.split("_")[1].split(".")[0])


def resume_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("resume: ")]


@pytest.mark.slow
def test_a_larger_world_with_other_settings_says_what_differs_and_continues(saved):
    ck = saved / "a" / "checkpoints" / "step_00000003"
    run = ultrascale("train", *FAST, *sets(
        FP32, f"checkpoint.resume={ck}", "parallel.dp=4", "training.micro_batch_size=1",
        "training.recompute=full", "parallel.bucket_mb=0.01", "logging.every=1",
        "checkpoint.every=3", "logging.run_dir=b"), cwd=saved)
    assert run.returncode == 0, run.stderr
    (line,) = resume_lines(run.stdout)
    assert f"resume: {ck} (step 3, 12 samples; saved on 2 rank(s) as dp2-tp1-pp1" in line
    assert ("differs: parallel.dp 2 -> 4, parallel.bucket_mb 25.0 -> 0.01, "
            "training.micro_batch_size 2 -> 1, training.recompute none -> full; "
            "lr: the schedule continues as saved") in line, line
    before, after = read_metrics(saved / "a" / "metrics.jsonl"), read_metrics(saved / "b" /
                                                                              "metrics.jsonl")
    assert sorted(after) == [4, 5, 6]
    for step in after:
        assert after[step]["loss"] == pytest.approx(before[step]["loss"], rel=1e-5, abs=0)
        assert after[step]["lr"] == before[step]["lr"]


@pytest.mark.slow
def test_raising_steps_says_how_the_learning_rate_continues(saved):
    ck = saved / "a" / "checkpoints" / "step_00000003"
    run = ultrascale("train", *FAST, *sets(FP32, f"checkpoint.resume={ck}", "training.steps=10",
                                           "logging.every=1", "checkpoint.every=3",
                                           "logging.run_dir=c"), cwd=saved)
    assert run.returncode == 0, run.stderr
    (line,) = resume_lines(run.stdout)
    before, after = read_metrics(saved / "a" / "metrics.jsonl"), read_metrics(saved / "c" /
                                                                              "metrics.jsonl")
    last = before[3]["lr"]
    assert (f"differs: training.steps 6 -> 10; lr: training.steps 6 -> 10: the cosine decays from "
            f"the saved lr {last:.3g} at step 3 to 0.0003 at step 10") in line, line
    # The plain schedule over 10 steps would have jumped back up at step 4.
    assert after[4]["lr"] < last < lr_at(4, 3e-3, 1, 10, 0.1)
    lrs = [after[s]["lr"] for s in range(4, 11)]
    assert all(a > b for a, b in zip([last] + lrs, lrs))  # down from where it was, never back up
    assert lrs[-1] == pytest.approx(3e-4)


def test_a_bad_checkpoint_is_refused_before_any_process_starts(saved, tmp_path):
    good = saved / "a" / "checkpoints" / "step_00000006"
    run = ["logging.run_dir=" + str(tmp_path / "run"), "device=cpu", "training.steps=8"]

    missing = shutil.copytree(good, tmp_path / "missing")
    (missing / "rank_00001.safetensors").unlink()
    assert_refused(*train(f"checkpoint.resume={missing}", *run)[::2],
                   "checkpoint.resume=", "rank_00001.safetensors is missing")

    cut = shutil.copytree(good, tmp_path / "cut")
    with open(cut / "rank_00000.safetensors", "r+b") as f:
        f.truncate(1000)
    assert_refused(*train(f"checkpoint.resume={cut}", *run)[::2],
                   "rank_00000.safetensors has 1000 bytes", "truncated")

    lost = shutil.copytree(good, tmp_path / "lost")
    meta = json.loads((lost / "meta.json").read_text())
    meta["tensors"]["layers.1.mlp.up_proj.weight"]["states"]["exp_avg"] = []
    (lost / "meta.json").write_text(json.dumps(meta))
    assert_refused(*train(f"checkpoint.resume={lost}", *run)[::2],
                   "exp_avg of layers.1.mlp.up_proj.weight: the pieces hold 0 of its 49152 "
                   "elements (a shard is missing)")

    assert_refused(*train(f"checkpoint.resume={good}", "model.ffn_hidden_size=256", *run)[::2],
                   "model.ffn_hidden_size 384 -> 256",
                   "layers.0.mlp.gate_proj.weight is [384, 128] in the checkpoint but [256, 128] "
                   "in this model")
    assert not (tmp_path / "run" / "rank_logs").exists()


def test_a_used_run_folder_is_continued_or_refused_with_the_fix(saved, tmp_path):
    """Issue 50, item 3: a fresh run into a folder holding a run, an earlier checkpoint with later
    ones beside it, another folder's checkpoint: refused before launch, with the fix. Continuing
    (resume=auto) is accepted, and the metric lines it trains again are dropped first."""
    from ultrascale import run_folder
    from ultrascale.config import build_config

    used = shutil.copytree(saved / "a", tmp_path / "used")
    run = ["logging.run_dir=" + str(used), "device=cpu", "training.steps=8"]
    code, _, err = train(*run)
    assert_refused(code, err, f"logging.run_dir={used} already holds a run",
                   "metrics of steps 1..6", "step_00000003, step_00000006",
                   "--set checkpoint.resume=auto")
    code, out, err = train(*run, "checkpoint.resume=auto", dry_run=True)
    assert code == 0 and "would be refused" not in out, out
    assert "resume: " + str(used / "checkpoints" / "step_00000006") in out
    code, _, err = train(*run, f"checkpoint.resume={used / 'checkpoints' / 'step_00000003'}")
    assert_refused(code, err, "goes back to step 3", "later checkpoints of the run "
                   "(step_00000006)", "checkpoint.resume=auto")
    code, _, err = train(*run, f"checkpoint.resume={saved / 'a' / 'checkpoints' / 'step_00000006'}")
    assert_refused(code, err, "continues another run's checkpoint", "fresh folder")
    # Continuing from step 3 (step 6's checkpoint lost, as after a crash): lines 4..6 dropped.
    shutil.rmtree(used / "checkpoints" / "step_00000006")
    cfg = build_config({"logging": {"run_dir": str(used),
                                    "metrics_file": str(used / "metrics.jsonl")},
                        "checkpoint": {"dir": str(used / "checkpoints"), "resume": "auto"}})
    run_folder.check(cfg, used / "checkpoints" / "step_00000003", 3)
    assert run_folder.trim_metrics(cfg, 3) == 3
    assert run_folder.logged_steps(used / "metrics.jsonl") == [1, 2, 3]


def _flip_a_byte(path) -> None:
    """A byte of the tensor data changed, the size kept (as a disk's error or a bad copy)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 1000)
        byte = f.read(1)
        f.seek(size - 1000)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.slow
def test_auto_passes_over_a_damaged_newest_checkpoint_and_trains_on_exactly(saved, tmp_path):
    """A restart resumes by itself (checkpoint.resume=auto): a newest checkpoint with a changed
    byte, which only the ranks' hashing finds, no longer stops it. The ranks agree to pass it
    over, rank 0 sets it aside (`.step_00000006.corrupt`, kept) and says so on the console, and
    the run trains steps 4..6 again from step 3 to the very losses the first run logged. With
    every checkpoint damaged it stops naming the newest damage (no fresh start). A cut file is
    passed over before launch, and the launcher's resume line says which and why."""
    from ultrascale.config import build_config
    from ultrascale.checkpoint.resume import plan_resume

    run = shutil.copytree(saved / "a", tmp_path / "a")
    first = read_metrics(run / "metrics.jsonl")
    _flip_a_byte(run / "checkpoints" / "step_00000006" / "rank_00001.safetensors")
    again = ultrascale("train", *FAST, *sets(FP32, "checkpoint.every=3", "logging.every=1",
                                             "logging.run_dir=a", "checkpoint.resume=auto"),
                       cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    aside = run / "checkpoints" / ".step_00000006.corrupt"
    assert f"set aside as {aside.relative_to(tmp_path)}" in again.stdout, again.stdout
    assert "resume: a/checkpoints/step_00000003 instead" in again.stdout
    assert (aside / "rank_00001.safetensors").is_file()
    now = read_metrics(run / "metrics.jsonl")
    assert sorted(now) == list(range(1, 7))
    for step in (4, 5, 6):
        assert now[step]["loss"] == pytest.approx(first[step]["loss"], rel=1e-5)
    # Every checkpoint damaged: refused, nothing set aside, nothing trained.
    for ck in (run / "checkpoints").glob("step_*"):
        _flip_a_byte(ck / "rank_00000.safetensors")
    last = ultrascale("train", *FAST, *sets(FP32, "training.steps=8", "logging.run_dir=a",
                                            "checkpoint.resume=auto"), cwd=tmp_path)
    assert last.returncode == 2 and "is intact; the newest:" in last.stderr, last.stderr
    assert "is not the file its save wrote" in last.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003",
                                                                          "step_00000006"]
    # A cut file tells before launch: the plan passes over that checkpoint and says why.
    with open(run / "checkpoints" / "step_00000006" / "rank_00000.safetensors", "r+b") as f:
        f.truncate(1000)
    cfg = build_config({"logging": {"run_dir": str(run)},
                        "checkpoint": {"dir": str(run / "checkpoints"), "resume": "auto"}})
    plan = plan_resume(cfg)
    assert plan.path.name == "step_00000003" and "passed over, damaged: step_00000006" in plan.line
    assert "has 1000 bytes" in plan.line


@pytest.mark.slow
def test_a_flipped_byte_is_refused_at_resume_and_export_naming_the_file(saved, tmp_path):
    """Issue 50, item 8: a checkpoint changed without changing its size was trusted (the NaN
    that followed was blamed on the learning rate). meta.json holds each file's SHA-256; every
    file a rank (or an export) opens is checked against it."""
    ck = shutil.copytree(saved / "a" / "checkpoints" / "step_00000006", tmp_path / "ck")
    assert set(json.loads((ck / "meta.json").read_text())["sha256"]) == {
        "rank_00000.safetensors", "rank_00001.safetensors"}
    target = ck / "rank_00000.safetensors"
    size = target.stat().st_size
    _flip_a_byte(target)  # a byte in the tensor data, past the header
    assert target.stat().st_size == size
    # One rank reads the whole model from rank 0's file (dp=2 wrote each replica once there).
    run = ultrascale("train", *FAST, *sets(FP32, f"checkpoint.resume={ck}", "training.steps=8",
                                           "parallel.dp=1", "logging.run_dir=r"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"{target} is not the file that was saved" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()
    export = ultrascale("export", str(ck), "--to-hf", str(tmp_path / "hf"), cwd=tmp_path)
    assert export.returncode == 2 and f"{target} is not the file that was saved" in export.stderr


def test_non_finite_values_are_refused_and_a_nan_loss_names_its_likely_cause(saved, tmp_path):
    """A checkpoint saved with a NaN in it (or changed, its digest recomputed) is refused at read
    naming the tensor; a non-finite loss on the first step after a resume names the checkpoint,
    and never suggests a grad_clip that is already on."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ultrascale.checkpoint.index import CheckpointError, file_sha256, load_meta
    from ultrascale.checkpoint.store import CheckpointReader
    from ultrascale.config import build_config
    from ultrascale.train.trainer import _non_finite

    ck = shutil.copytree(saved / "a" / "checkpoints" / "step_00000006", tmp_path / "ck")
    f = ck / "rank_00000.safetensors"
    tensors = load_file(str(f))
    with safe_open(str(f), "pt") as opened:
        text = opened.metadata()  # the RNG states
    key = next(k for k in tensors if k.startswith("param/embed.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(f), metadata=text)
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"][f.name], meta["sha256"][f.name] = f.stat().st_size, file_sha256(f)
    (ck / "meta.json").write_text(json.dumps(meta))
    with CheckpointReader(ck, load_meta(ck)) as reader:
        with pytest.raises(CheckpointError, match="param of embed.weight .*non-finite"):
            reader.tensor("embed.weight")
        assert torch.isfinite(reader.tensor("norm.weight")).all()
    cfg = build_config({"training": {"grad_clip": 1.0}})
    after_resume = _non_finite(float("nan"), 7, cfg, ck, first=True)
    assert str(ck) in after_resume and "training.lr" not in after_resume
    later = _non_finite(float("nan"), 9, cfg, ck, first=False)
    assert "lower training.lr" in later and "enable training.grad_clip" not in later
    unclipped = build_config({}, ["training.grad_clip=null"])
    assert "enable training.grad_clip" in _non_finite(float("inf"), 3, unclipped, None, False)


def test_the_resume_line_is_printed_before_launch(saved, tmp_path):
    ck = saved / "a" / "checkpoints" / "step_00000006"
    code, out, err = train(f"checkpoint.resume={ck}", "logging.run_dir=" + str(tmp_path / "r"),
                           "device=cpu", "training.steps=6", "logging.every=5", dry_run=True)
    assert code == 0, err
    (line,) = resume_lines(out)
    for change in ("training.micro_batch_size 2 -> 8", "logging.every 1 -> 5"):
        assert change in line
    assert line.endswith("; nothing to train: step 6 >= training.steps=6"), line


@pytest.mark.slow
def test_sigkill_of_the_whole_job_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    """Saves in the background (checkpoint.async_save) every 3 steps: the job is killed, launcher
    and ranks at once, while a save is in flight (step 6's, unless the machine is slow to let
    this test look); the one before stays whole and resumes with the same losses."""
    common = [*FAST, *sets("training.steps=12", "logging.every=1", "training.seq_len=128",
                           "training.micro_batch_size=4", "checkpoint.every=3",
                           "checkpoint.async_save=true", f"checkpoint.dir={tmp_path / 'ck'}")]
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "ultrascale.cli", "train", *common,
                             *sets("logging.run_dir=killed")], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    def saving() -> list:  # any save after the first: a complete checkpoint exists before it
        return [p for p in ck.glob(".step_*.tmp") if step_of(p) > 3]

    deadline = time.time() + 240
    try:
        while not (in_flight := saving()):
            assert proc.poll() is None, "the run ended before its second save"
            assert time.time() < deadline
            time.sleep(0.002)
    finally:
        for pid in process_tree(proc.pid):  # like a node that dies: every process at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    (in_flight,) = in_flight
    step = step_of(in_flight)
    assert in_flight.is_dir() and not (ck / f"step_{step:08d}").exists(), \
        "the kill did not land during the save"
    previous = sorted(p.name for p in ck.glob("step_*"))
    assert previous[-1:] == [f"step_{step - 3:08d}"]
    killed = {}
    for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines():
        try:  # the last line may be cut by the kill
            record = json.loads(line)
        except ValueError:
            continue
        killed[record["step"]] = record["loss"]

    resumed = ultrascale("train", *common, *sets("checkpoint.resume=auto",
                                                 "logging.run_dir=resumed"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    (line,) = resume_lines(resumed.stdout)
    assert f"step_{step - 3:08d} (step {step - 3}" in line
    after = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert sorted(after) == list(range(step - 2, 13))
    overlap = [s for s in after if s in killed]
    assert overlap and all(after[s]["loss"] == killed[s] for s in overlap)
    assert not in_flight.exists()  # the next save cleared the leftover
    assert (ck / "step_00000012" / "meta.json").is_file()
