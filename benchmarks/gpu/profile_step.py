"""Where our 1B bf16 training step spends its GPU time, in steady steps only: torch.profiler with a
schedule (wait 4 steps: compilation, autotuning, the first windows; warm up 2; record 3), stepped
by the trainer's `on_step` callback, so the model's upload, Inductor's compilation and its
autotuning never enter the table. Writes the top kernels by self device time and, per recorded
step, the GPU's busy milliseconds against the step's wall milliseconds (the gap is the host).

    python benchmarks/gpu/profile_step.py --out DIR [--variant ours|baseline] [--smoke]
    python benchmarks/gpu/profile_step.py --read DIR/profile_ours.txt   # its rows by kind

The kinds (`kinds`): matmuls, attention, the optimizer's multi-tensor kernels, the loss's
log-softmax, Inductor's other fused kernels, the rest; milliseconds per recorded step, of the
table's rows (the top 30 kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

import training_checks

WAIT, WARMUP, ACTIVE = 4, 2, 3
# kind -> what a kernel's name holds (the first that matches; else "rest")
KINDS = {"matmul": ("nvjet", "gemm", "cutlass"), "attention": ("sdpa", "cudnn", "flash", "fmha"),
         "optimizer (multi-tensor)": ("multi_tensor_apply",), "loss": ("log_softmax",),
         "Inductor fused": ("triton_",)}


def kinds(table: str, steps: int = ACTIVE) -> dict[str, float]:
    """Milliseconds per step of each kind, from a profile table's "Self CUDA" column."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if "Self CUDA" in line)
    column = [c.strip() for c in lines[header].split("  ") if c.strip()].index("Self CUDA")
    out = dict.fromkeys([*KINDS, "rest"], 0.0)
    for line in lines[header + 2:]:
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) < column + 1 or not cells[column][-2:] in ("ms", "us"):
            continue
        value = float(cells[column][:-2]) / (1 if cells[column].endswith("ms") else 1e3)
        kind = next((k for k, marks in KINDS.items() if any(m in cells[0] for m in marks)),
                    "rest")
        out[kind] += value / steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for profile_<variant>.txt")
    ap.add_argument("--variant", default="ours", choices=("ours", "baseline"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None, help="the summary as JSON here too")
    ap.add_argument("--read", default=None, help="a written profile: print its kinds and stop")
    args = ap.parse_args(argv)
    if args.read:
        print(json.dumps({k: round(v, 1) for k, v in kinds(Path(args.read).read_text()).items()}))
        return 0
    if not args.out:
        ap.error("--out DIR (or --read PROFILE)")
    cuda = not args.smoke
    steps = WAIT + WARMUP + ACTIVE + 1
    base, overrides, _ = training_checks.VARIANTS[args.variant]
    cfg = training_checks.config(base, overrides, args.smoke, steps, steps)
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    walls: list[float] = []
    last = [time.perf_counter()]

    def on_step(step: int) -> None:
        if cuda:
            torch.cuda.synchronize()  # a step's wall time; the profile's steps only
        now = time.perf_counter()
        if step > WAIT + WARMUP and len(walls) < ACTIVE:
            walls.append(now - last[0])
        last[0] = now
        prof.step()

    with profile(activities=[activity],
                 schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1)) as prof:
        training_checks.train_and_read(cfg, on_step=on_step)
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy_ms = sum(getattr(e, attr) for e in events) / 1e3 / ACTIVE
    summary = {"variant": args.variant, "recorded_steps": ACTIVE,
               "busy_ms_per_step": busy_ms,
               "wall_ms_per_step": 1e3 * sum(walls) / max(len(walls), 1),
               "config": overrides}
    table = events.table(sort_by=attr, row_limit=30, max_name_column_width=70)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{args.variant}.txt").write_text(json.dumps(summary, indent=2) + "\n\n"
                                                     + table)
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
