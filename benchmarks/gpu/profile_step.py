"""Where a 1B Llama's bf16 training step spends its GPU time: the CUDA kernels of a short run
(eager, then compiled) under torch.profiler, grouped by kernel, with the GPU's busy time per step
against the step's wall time (the gap is host overhead or waiting). A lab tool for the MFU work,
not a check: `python benchmarks/gpu/profile_step.py [--out DIR]` on a CUDA machine; `--smoke` runs it
at tiny sizes on a CPU."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import training_checks  # this folder's (the script's own, first on sys.path)

VARIANTS = {"eager": ["training.kernels=torch"],
            "compiled": ["training.compile=true", "training.kernels=torch"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "profile"),
                    help="folder for profile_<variant>.txt")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    activity = ProfilerActivity.CPU if args.smoke else ProfilerActivity.CUDA
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="ultrascale-inductor-")
    for name, overrides in VARIANTS.items():
        cfg = training_checks.config(args.smoke, overrides + [f"training.steps={args.steps}"],
                                     cache, device)
        with profile(activities=[activity]) as prof:
            records = training_checks.train_and_read(cfg)
        steady = records[len(records) // 2:]
        wall = sum(r["step_time_s"] for r in steady) / len(steady)
        events = prof.key_averages()
        attr = "self_device_time_total" if not args.smoke else "self_cpu_time_total"
        busy_us = sum(getattr(e, attr) for e in events)
        table = events.table(sort_by=attr, row_limit=25, max_name_column_width=70)
        summary = {"variant": name, "steps": len(records),
                   "steady_step_wall_s": wall, "mfu": [r["mfu"] for r in steady],
                   "busy_s_per_step_over_whole_run": busy_us / 1e6 / len(records)}
        (out / f"profile_{name}.txt").write_text(json.dumps(summary, indent=2) + "\n\n" + table)
        print(json.dumps(summary), flush=True)
        print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
