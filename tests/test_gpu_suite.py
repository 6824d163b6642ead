"""benchmarks/gpu/run.py, the one command for every GPU check, run as its CPU smoke test (tiny
sizes, Triton kernels under the interpreter): every section runs and writes its JSON and markdown,
the kernels agree with eager, the estimator is within a factor of the measured peak, and FP8 is
either measured or reported with the engine's reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_suite_smoke_run_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "run.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    markdown = (tmp_path / "summary.md").read_text()
    assert summary["smoke"] and set(summary["sections"]) == {"kernels", "speed", "memory"}

    kernels = {r["kernel"]: r for r in summary["sections"]["kernels"]["result"]}
    assert set(kernels) == {"rms_norm", "swiglu", "rotary", "linear_cross_entropy", "attention",
                            "document_attention"}
    for row in kernels.values():
        assert "error" not in row, row
        assert row["fused_max_rel_err_vs_fp32"] < 1e-5, row
        assert row["eager_ms"] > 0 and row["fused_ms"] > 0
    lce = kernels["linear_cross_entropy"]
    assert 0 < lce["fused_peak_bytes"] < lce["eager_peak_bytes"]
    assert kernels["attention"]["backend"] == kernels["document_attention"]["backend"] == "cpu"

    speed = summary["sections"]["speed"]["result"]
    runs = speed["runs"]
    assert set(runs) == {"eager", "eager_fused", "compiled", "compiled_chunked"}
    losses = [r["final_loss"] for r in runs.values()]
    assert all(r["available"] and r["tokens_per_s"] > 0 for r in runs.values())
    assert max(losses) - min(losses) < 1e-4 * max(losses)  # the same training, four ways
    assert speed["best_mfu"] is None  # no peak rate for a CPU
    assert speed["fp8"]["available"] or "precision.dtype" in speed["fp8"]["reason"]

    memory = summary["sections"]["memory"]["result"]
    assert len(memory) == 6
    for row in memory:
        assert "error" not in row and row["allocated_before_bytes"] == 0, row
        assert 0.5 < row["ratio_measured_to_estimated"] < 2.0, row
    for heading in ("## kernels", "## speed", "## memory", "Best MFU"):
        assert heading in markdown
