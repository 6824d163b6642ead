"""benchmarks/gpu/run.py, the one command of a GPU lease, run as its CPU smoke test (tiny sizes,
eager, Triton under its interpreter): every stage runs as its subprocess and reports, the summary
carries the headline and the FP8 check in the shape issue 42 asks for, `--resume` keeps what is
done, and the stages' own checks hold (the same training whichever optimizer path, the estimator
within a factor of the measured peak, the kernels within fp32 rounding of eager)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmarks" / "gpu" / "run.py"
STAGES = ["env", "ours", "peer_hf", "fp8_bf16", "fp8_rowwise", "optimizer", "loss_attention",
          "baseline", "sync_check", "fp8_tensorwise", "profile", "plan", "memory", "torchtitan",
          "kernels"]


@pytest.mark.slow
def test_gpu_suite_smoke_run_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(RUN), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["smoke"] and list(s["stages"]) == STAGES
    for name, stage in s["stages"].items():
        assert "result" in stage, (name, stage)
    assert s["device"] == "cpu"
    head = s["headline"]
    assert {"ours_tokens_per_s", "peer_tokens_per_s", "peer", "ratio", "mfu"} <= set(head)
    assert head["peer"] == "hf" and head["ratio"] > 0 and head["mfu"] is None  # no CPU peak
    assert {"shape", "speedup"} <= set(s["fp8"]) and s["fp8"]["speedup"] > 0
    result = {n: st["result"] for n, st in s["stages"].items()}
    # The same training, whichever optimizer path (tests/test_optimizer_path.py holds it close).
    assert result["ours"]["final_loss"] == pytest.approx(result["baseline"]["final_loss"],
                                                         rel=1e-5)
    assert result["ours"]["attention"].startswith("PyTorch's fused CPU kernel")
    optimizer = result["optimizer"]
    assert all(optimizer[k]["ms"] > 0 for k in ("per_tensor", "fused", "torch_reference"))
    assert {"loss_eager", "loss_chunked"} <= set(result["loss_attention"])
    assert len(result["memory"]) == 6
    for row in result["memory"]:
        assert "error" not in row and row["allocated_before_bytes"] == 0, row
        assert 0.5 < row["ratio_measured_to_estimated"] < 2.0, row
    assert result["plan"]["predicted_step_s"] > 0
    assert not result["torchtitan"]["available"] and result["torchtitan"]["reason"]
    kernels = {r["kernel"]: r for r in result["kernels"]}
    assert set(kernels) == {"rms_norm", "swiglu", "rotary", "linear_cross_entropy", "attention",
                            "document_attention", "cp_block_attention"}
    for row in kernels.values():
        assert "error" not in row and row["fused_max_rel_err_vs_fp32"] < 1e-5, row
    assert (tmp_path / "profile_ours.txt").read_text().count("\n") > 5
    assert "## ours" in (tmp_path / "summary.md").read_text()

    # A second call with --resume keeps every stage and runs none again.
    again = subprocess.run([sys.executable, str(RUN), "--smoke", "--out", str(tmp_path),
                            "--resume", "--only", "env,plan"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["stages"] == s["stages"]


def test_run_refuses_unknown_stages_and_skips_past_the_deadline(tmp_path):
    bad = subprocess.run([sys.executable, str(RUN), "--smoke", "--only", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown stages ['nope']" in bad.stderr
    late = subprocess.run([sys.executable, str(RUN), "--smoke", "--budget-s", "30", "--only",
                           "ours,plan", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert late.returncode == 0, late.stderr[-2000:]
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert "would not finish before the deadline (needs ~50 s" in stages["ours"]["skipped"]
    assert stages["plan"]["skipped"] == "no `ours` figure to compare with"


def test_the_gpu_machine_gets_the_pydantic_we_test_with():
    """`benchmarks/gpu/wheels.sh` carries pydantic (the GPU image has none) at the versions this
    suite runs on: requirements.txt's pin, and the pydantic-core that pin installs."""
    import re
    from importlib.metadata import version

    script = (ROOT / "benchmarks" / "gpu" / "wheels.sh").read_text()
    pins = dict(re.findall(r"\b(pydantic(?:-core)?)==([\w.]+)", script))
    required = dict(re.findall(r"^(pydantic)==([\w.]+)", (ROOT / "requirements.txt").read_text(),
                               re.M))
    assert pins["pydantic"] == required["pydantic"] == version("pydantic")
    assert pins["pydantic-core"] == version("pydantic_core")


def test_torchtitans_wheels_are_found_from_the_stage_s_folder(tmp_path, monkeypatch):
    """device.sh passes `--wheels .whl/torchtitan`, relative to the repository; the stage runs in
    benchmarks/gpu, so run.py hands it the folder's absolute path (on the 2026-11-29 H200 lease
    the relative one reached pip as a folder of no wheels)."""
    import argparse
    import importlib.util

    monkeypatch.syspath_prepend(str(RUN.parent))  # run.py imports report.py beside it
    spec = importlib.util.spec_from_file_location("gpu_suite_run", RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    seen = []

    def fake_run(cmd, **kw):
        seen.append((cmd, kw["cwd"]))
        return subprocess.CompletedProcess(cmd, 1, "", "stopped here")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run.subprocess, "run", fake_run)
    args = argparse.Namespace(smoke=True, wheels=".whl/torchtitan", compile_cache=str(tmp_path))
    run.run_stage("torchtitan", {}, tmp_path, args, 60.0)
    cmd, cwd = seen[0]
    wheels = Path(cmd[cmd.index("--wheels") + 1])
    assert wheels == tmp_path / ".whl" / "torchtitan" and Path(cwd) != tmp_path


def test_the_sync_check_counts_synchronising_calls_not_the_debug_mode_s_notice(monkeypatch):
    """`torch.cuda.set_sync_debug_mode("warn")` warns once that it is a prototype; a sync warns
    "called a synchronizing CUDA operation". Only the second is a step's sync."""
    import warnings

    import torch

    monkeypatch.syspath_prepend(str(RUN.parent))
    import training_checks

    def switch(mode):
        if mode == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", switch)
    with training_checks.SyncCounter(steps=5) as counter:
        counter.on_step(1)  # logged: the check starts after it, with the notice
        counter.on_step(2)
        warnings.warn(f"{training_checks.SYNC_WARNING} (cudaStreamSynchronize)")
        counter.on_step(3)
        counter.on_step(4)
    report = counter.report()
    assert report["per_unlogged_step"] == {2: 0, 3: 1, 4: 0} and report["max"] == 1


def test_the_committed_h200_profile_reads_as_benchmarks_readme_says(monkeypatch):
    """`profile_step.py --read`: the 2026-11-29 H200 step's kernels by kind, per step, as
    benchmarks/README.md gives them (matmuls 80.7 ms, the optimizer's multi-tensor kernels 15.4,
    cuDNN attention 13.6, Inductor's fused kernels 7.8, the compiled loss 2.8, the rest 5.4)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_profile_step",
                                                  RUN.parent / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(RUN.parent))  # it imports training_checks beside it
    spec.loader.exec_module(module)
    table = (RUN.parent / "results" / "2026-11-29-h200" / "profile_ours.txt").read_text()
    got = {k: round(v, 1) for k, v in module.kinds(table).items()}
    assert got == {"matmul": 80.7, "attention": 13.6, "optimizer (multi-tensor)": 15.4,
                   "loss": 2.8, "Inductor fused": 7.8, "rest": 5.4}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert "profile_step.py --read" in readme
