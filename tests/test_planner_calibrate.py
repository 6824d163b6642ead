"""Calibration: the efficiency-curve fit, and a measured profile the planner can plan with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.calibrate import fit_efficiency_curve, main as calibrate_main
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import Hardware


def test_efficiency_curve_recovers_peak_and_half_size():
    peak, half = 50e9, 3e7
    pts = [(f, peak * f / (f + half)) for f in (1e5, 1e6, 1e7, 1e8, 1e9)]
    got_peak, got_half = fit_efficiency_curve(pts)
    assert got_peak == pytest.approx(peak, rel=1e-3)
    assert got_half == pytest.approx(half, rel=1e-3)


def test_efficiency_curve_without_saturation_takes_the_best_rate():
    pts = [(1e6, 1e8), (1e7, 1e9), (1e8, 1e10)]  # still rising tenfold per size
    peak, half = fit_efficiency_curve(pts)
    assert peak == 1e10 and half == 0.0


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_the_cost_model_reads(tmp_path, capsys):
    out = tmp_path / "local.yaml"
    assert calibrate_main(["--out", str(out), "--quick"]) == 0
    hw = Hardware.load(out)
    assert hw.peak("fp32") > 1e8 and hw.hbm_bw > 1e8 and 0 < hw.layer_overhead_s < 1
    # A CPU profile: per-core rates, the cores the ranks share, nothing overlapped.
    assert hw.host_cores >= 1 and hw.dp_overlap == 0.0
    assert 0.05 <= hw.hbm_eff <= 1.0 and 0 < hw.attention_eff <= 1.0
    assert hw.optimizer_bytes_per_param > 16  # at least AdamW's param, grad, m, v reads
    for kind in ("all_reduce", "all_gather", "all_to_all", "p2p"):
        assert hw.intra.bw(kind) > 1e6, kind
    p = predict(ModelConfig(preset="tiny"), Layout(dp=2, mbs=4, seq_len=128), hw, memory=False)
    assert p.step_time_s > 0 and p.breakdown["dp_comm"] > 0
    assert "wrote" in capsys.readouterr().out


def test_calibrate_refuses_one_rank(capsys):
    assert calibrate_main(["--ranks", "1", "--out", "unused.yaml"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_the_cli_does_not_import_torch_to_register_its_commands():
    # `ultrascale memory` must answer in well under a second: registering `calibrate` (and the
    # other feature commands) must not import torch or numpy.
    code = ("import sys; from ultrascale.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
