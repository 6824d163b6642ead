"""Every script in benchmarks/ runs: each in its smoke mode (tiny sizes, one round), as a user
runs it (a subprocess from the repository root), so a benchmark that stops working fails here.
The timed runs are the lead's, on a quiet machine (benchmarks/README.md, "Re-measuring the peer
tables"); the smoke runs only show that each still starts, computes and prints.

A script added to benchmarks/ without an entry here fails `test_every_benchmark_has_a_smoke_run`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
XEON = "benchmarks/data/planner_sweep_cpu_4ranks_xeon"

# script (relative to benchmarks/) -> its smoke arguments ({tmp}: a fresh folder), and what its
# output must contain.
SMOKE = {
    "bench_checkpoint_cpu.py": (["--smoke", "--dir", "{tmp}/ck"], "| background |"),
    "bench_chunked_loss_cpu.py": (["--smoke"], "| 256 |"),
    "bench_compile_cpu.py": (["--smoke", "--json", "{tmp}/compile.json"], "speedup"),
    "bench_context_parallel.py": (["--smoke", "--json", "{tmp}/cp.json"], "median ratio"),
    "bench_data_parallel.py": (["--smoke", "--json", "{tmp}/dp.json"], "ZeRO-3 vs FSDP2"),
    "bench_document_mask.py": (["--smoke"], "masked"),
    "bench_grouped_gemm_cpu.py": (["--smoke"], "| smoke"),
    "bench_pipeline.py": (["--smoke", "--json", "{tmp}/pp.json"], "| interleaved"),
    "bench_pipeline_zero3.py": (["--smoke", "--json", "{tmp}/pp_zero3.json"], "micro_batch"),
    "bench_optimizer_cpu.py": (["--smoke"], '"clip + step"'),
    "bench_precision_cpu.py": (["--smoke", "--json", "{tmp}/precision.json"], "bf16_over_fp32"),
    "bench_ring_breakdown.py": (["--smoke", "--json", "{tmp}/ring.json"], "cp 2, rank 1"),
    "bench_tensor_parallel.py": (["--smoke", "--json", "{tmp}/tp.json"], "sequence_parallel=True"),
    "bench_zero3_step.py": (["--smoke"], "forward_backward"),
    "deepseek_recompute_memory.py": (["--hidden", "64", "--heads", "4", "--seq", "32",
                                      "--batch", "1"], "norms_and_mla_up"),
    "deepseek_v3_planner.py": ([], "of published"),
    "dualpipev_overlap_cpu.py": (["--smoke", "--json", "{tmp}/overlap.json"],
                                 "losses equal with and without the turns: True"),
    "elastic_grow_back.py": (["--smoke"], "largest relative loss difference"),
    "fill_gain_vs_replay.py": (["--loads", "4"], "| zero_bubble | 0.5 |"),
    "fold_cost.py": (["--tiny", "--reps", "1"], "per call"),
    "memory_vs_measure.py": (["--smoke"], "median_abs_error"),
    "memory_vs_playbook.py": ([], "Mem Alloc"),
    "muon_vs_adamw.py": (["--smoke", "--out", "{tmp}/muon"], "| muon-lr3e-3 | 1 |"),
    "plan_vs_train_cpu.py": (["--smoke", "--profile", f"{XEON}/local.yaml"], "predicted"),
    "planner_vs_playbook.py": ([], "%"),
    "planner_vs_ours.py": ([], "median |error|"),
    "planner_vs_sweep.py": (["--profile", f"{XEON}/local.yaml", "--csv", f"{XEON}/results.csv"],
                            "Spearman"),
    "precision_convergence.py": (["--smoke", "--out", "{tmp}/precision"], "| bf16 | 1 |"),
    "random_hf_configs.py": (["--smoke"], "configs OK"),
    "random_layouts.py": (["train", "--smoke"], "1 of 1 layouts OK"),
    "step_profile_cpu.py": (["--smoke"], "optimizer"),
    "update_probe_cpu.py": (["--smoke"], "update probe inside the ranks"),
}
# Scripts whose smoke run is another test's, and modules the scripts import (not run alone).
# gpu/run.py's smoke runs every stage's script (micro.py, peer_hf.py, peer_torchtitan.py,
# profile_step.py).
ELSEWHERE = {f"gpu/{s}.py": "tests/test_gpu_suite.py"
             for s in ("run", "micro", "peer_hf", "peer_torchtitan", "profile_step")}
MODULES = {"_spawn.py", "_train.py", "gpu/kernel_checks.py", "gpu/training_checks.py",
           "gpu/report.py", "gpu/tt_peer/__init__.py", "gpu/tt_peer/config_registry.py"}


def test_every_benchmark_has_a_smoke_run():
    scripts = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")}
    assert scripts == set(SMOKE) | set(ELSEWHERE) | MODULES
    assert set(LONGEST) <= set(SMOKE)
    for script in ELSEWHERE.values():
        assert (ROOT / script).is_file()


def _run(script: str, tmp: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    args, _ = SMOKE[script]
    cmd = [sys.executable, str(BENCH / script)] + [a.format(tmp=tmp) for a in args]
    return cmd, subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)


# The longest smoke runs (seconds of CPU: compiling, several `ultrascale train` runs, torchrun's
# rendezvous), started first so that the others fill the second core meanwhile.
LONGEST = ["bench_compile_cpu.py", "elastic_grow_back.py", "precision_convergence.py",
           "muon_vs_adamw.py", "update_probe_cpu.py"]


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """The selected smoke runs, started at once two at a time (most are one process on one
    thread: two cores run two of them in the time of one); each test waits for its own."""
    chosen = [item.callspec.params["script"] for item in request.session.items
              if item.originalname == "test_benchmark_smoke_run"]
    order = [s for s in LONGEST if s in chosen] + [s for s in chosen if s not in LONGEST]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {s: pool.submit(_run, s, tmp_path_factory.mktemp(s.replace("/", "_")))
               for s in order}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SMOKE))
def test_benchmark_smoke_run(script, smoke_runs):
    cmd, proc = smoke_runs[script].result(timeout=560)
    _, expected = SMOKE[script]
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert expected in proc.stdout, proc.stdout[-3000:]
    for arg in cmd:  # the raw results a timed run commits
        if arg.endswith(".json"):
            assert json.loads(Path(arg).read_text())
