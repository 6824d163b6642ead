"""The planner's step time for our own runtime (`ultrascale`) against our own measured runs, none of
which any constant was fitted on:

    python benchmarks/planner_vs_ours.py            # docs/planner.md's "On our own runtime"
    python benchmarks/planner_vs_ours.py --json

Reads recorded runs only (no timing):

- the one-GPU runs of the GPU suite on an H200 (benchmarks/gpu/results/*/summary.json, section
  "speed": Llama 3.2 1B, 4 sequences of 2048 tokens a step, bf16), predicted on the `h200` profile,
  whose efficiency constants were fitted on the playbook's nanotron runs on H100s;
- the CPU sweeps of benchmarks/data/planner_sweep_cpu_4ranks* (30 layouts of a 17M-parameter Llama
  on 4 gloo ranks), each predicted on the profile `ultrascale calibrate` measured on its machine
  (probes, not the runs).

Each row's error is predicted / measured - 1 (negative: predicted too fast).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import get_hardware

# benchmarks/gpu/training_checks.py's ONE_B: the one-GPU speed runs' model and layout.
GPU_MODEL = "llama3-1b"
GPU_LAYOUT = Layout(seq_len=2048, mbs=4, grad_accum=1, dtype="bf16")
GPU_PROFILE = "h200"


@dataclass(frozen=True)
class CpuSweep:
    label: str
    folder: str  # under benchmarks/data
    profile: str  # the calibrated profile, in the folder
    csvs: tuple[str, ...]  # the sweep's results, in the folder


GRID = "benchmarks/sweep_cpu_4ranks.yaml"
# The sweeps docs/planner.md's "CPU sweeps" table calls out of sample: nothing in the cost model
# changed after they started. (The ten sweeps of benchmarks/data/planner_sweep_cpu_4ranks are
# left out: the CPU terms were worked out against them.)
CPU_SWEEPS = (
    CpuSweep("2-core Intel Xeon, 6 repeats", "planner_sweep_cpu_4ranks_xeon", "local.yaml",
             ("results.csv",)),
    CpuSweep("2-core Intel Xeon, 3 repeats", "planner_sweep_cpu_4ranks_xeon", "local_2.yaml",
             ("results_2.csv",)),
    CpuSweep("second 2-core AMD EPYC, 6 repeats", "planner_sweep_cpu_4ranks_epyc2", "local.yaml",
             ("results.csv", "results_repeats_4-6.csv")),
)


def gpu_rows(results: Path) -> list[dict]:
    """Each one-GPU speed run of the 1B step in every GPU suite summary under `results` against
    the prediction (one per layout: the cost model has no term for compilation or fused
    kernels)."""
    pred = predict(ModelConfig(preset=GPU_MODEL), GPU_LAYOUT, get_hardware(GPU_PROFILE),
                   memory=False)
    rows = []
    for path in sorted(results.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("smoke"):
            continue  # a CPU smoke run's: no GPU speed
        for name, run in _one_b_speed_runs(summary):
            if run.get("available") and run.get("step_time_s"):
                rows.append({"source": f"{path.parent.name} {name}", "runtime": pred.runtime,
                             "layout": GPU_LAYOUT.short(), "predicted_s": pred.step_time_s,
                             "measured_s": run["step_time_s"],
                             "error": pred.step_time_s / run["step_time_s"] - 1})
    return rows


# run.py's stages that time the 1B step (fp8_*: two 70B layers; sync_check: the step while
# counting syncs); the 2026-11-27 summaries kept their runs under sections.speed instead.
ONE_B_STAGES = ("ours", "baseline")


def _one_b_speed_runs(summary: dict) -> list[tuple[str, dict]]:
    if "sections" in summary:
        speed = summary["sections"].get("speed") or {}
        return list(speed.get("result", {}).get("runs", {}).items())
    stages = summary.get("stages", {})
    return [(n, stages[n]["result"]) for n in ONE_B_STAGES if "result" in stages.get(n, {})]


def cpu_rows(root: Path, sweeps=CPU_SWEEPS) -> list[dict]:
    """Every layout of each recorded CPU sweep (the fastest of its repeats) against the
    prediction on that machine's calibrated profile."""
    from ultrascale.planner.sweep_compare import compare

    rows = []
    for sweep in sweeps:
        folder = root / "benchmarks" / "data" / sweep.folder
        res = compare(root / GRID, [folder / c for c in sweep.csvs], str(folder / sweep.profile))
        for r in res["rows"]:
            rows.append({"source": sweep.label, "runtime": "ultrascale", "layout": r["layout"],
                         "predicted_s": r["predicted_s"], "measured_s": r["measured_s"],
                         "error": r["predicted_s"] / r["measured_s"] - 1})
    return rows


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"runs": len(rows), "median_abs_error": statistics.median(errors),
            "worst_abs_error": max(errors), "median_error": statistics.median(
                r["error"] for r in rows)}


def report(root: Path, gpu_only: bool = False) -> dict:
    gpu = gpu_rows(root / "benchmarks" / "gpu" / "results")
    out = {"runtime": "ultrascale", "gpu": {"rows": gpu, **summary(gpu)}}
    if not gpu_only:
        cpu = cpu_rows(root)
        out["cpu"] = {"rows": cpu, **summary(cpu)}
        for sweep in CPU_SWEEPS:
            mine = [r for r in cpu if r["source"] == sweep.label]
            out["cpu"][sweep.label] = summary(mine)
    return out


def print_report(rep: dict) -> None:
    print(f"runtime {rep['runtime']}: predicted step time against our measured runs "
          "(error = predicted / measured - 1)")
    for r in rep["gpu"]["rows"]:
        print(f"  {r['source']:<38} {r['layout']:<28} predicted {r['predicted_s']:.3f} s, "
              f"measured {r['measured_s']:.3f} s ({100 * r['error']:+.1f}%)")
    for part in ("gpu", "cpu"):
        if part in rep:
            s = rep[part]
            print(f"{part}: {s['runs']} runs, median |error| {100 * s['median_abs_error']:.1f}%, "
                  f"worst {100 * s['worst_abs_error']:.1f}%, median error "
                  f"{100 * s['median_error']:+.1f}%")
    for sweep in CPU_SWEEPS if "cpu" in rep else ():
        s = rep["cpu"][sweep.label]
        print(f"  {sweep.label:<38} {s['runs']} layouts, median |error| "
              f"{100 * s['median_abs_error']:.1f}%, median error {100 * s['median_error']:+.1f}%")


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=(description or __doc__).split("\n\n")[0])
    p.add_argument("--root", default=".", help="the repository (benchmarks/ under it)")
    p.add_argument("--gpu-only", action="store_true", help="only the GPU suite's runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rep = report(Path(args.root), args.gpu_only)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
