"""The planner on our own runtime (issue 48): `plan` says which runtime it predicts for, and its
error on our own measured runs (the GPU suite's H200 runs, the out-of-sample CPU sweeps) is what
docs/planner.md states (`python benchmarks/planner_vs_ours.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ultrascale.planner.command import main as plan_main
from ultrascale.planner.ours_check import report

ROOT = Path(__file__).resolve().parent.parent


def test_plan_names_the_runtime_it_predicts_for(capsys):
    args = ["--preset", "llama3-1b", "--gpu", "h200", "--layout", "dp=1,mbs=4,acc=1",
            "--seq-len", "2048", "--global-batch-tokens", "8K"]
    assert plan_main(args) == 0
    assert "Predicted for the ultrascale runtime" in capsys.readouterr().out
    assert plan_main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == "ultrascale"


def test_the_documented_errors_on_our_runs():
    """Each figure of docs/planner.md's "On our own runtime" table, from the recorded runs."""
    rep = report(ROOT)
    doc = (ROOT / "docs" / "planner.md").read_text()
    section = doc[doc.index("## On our own runtime"):doc.index("## How it predicts")]
    by_run = {r["source"]: r for r in rep["gpu"]["rows"]}
    assert rep["runtime"] == "ultrascale" and len(by_run) == 6
    figures = [f"{100 * by_run[run]['error']:+.1f}%" for run in (
        "2026-11-29-h200 ours", "2026-11-29-h200 baseline", "2026-11-27-h200-run1 eager",
        "2026-11-27-h200-run1 compiled")]
    figures += [f"{100 * rep['gpu']['median_error']:+.1f}%",
                f"{100 * rep['gpu']['worst_abs_error']:.1f}%",
                f"{100 * rep['cpu']['median_error']:+.1f}%",
                f"{100 * rep['cpu']['median_abs_error']:.1f}%",
                f"{100 * rep['cpu']['worst_abs_error']:.1f}%"]
    shown = re.findall(r"[-+]?\d+\.\d%", section)
    for figure in figures:  # (a worst absolute error is shown with its sign)
        assert figure in shown or figure.lstrip("+") in [s.lstrip("+-") for s in shown], figure
    assert rep["cpu"]["runs"] == 90
