"""`ultrascale plan --gpu local` against the training run it predicts, on this CPU machine (issue 50:
the tiny preset's default run was predicted 1.7x too fast).

    ultrascale calibrate --ranks 2 --out local.yaml            # the profile, as the ranks run
    python benchmarks/plan_vs_train_cpu.py --profile local.yaml               # configs/tiny.yaml
    python benchmarks/plan_vs_train_cpu.py --profile local.yaml --config C.yaml --steps 40
    python benchmarks/plan_vs_train_cpu.py --profile local.yaml --smoke       # 4 steps: it works

Trains the config with `ultrascale train` (every step logged), then prints the predicted step and
its parts beside the measured one: the median and the fastest step time (the first step, which
pays for warm-up, left out) and, from the metrics' communication records, each collective's median
time per step. The step's two all-reduces over every rank (`all_reduce/world`: gradient norm and
loss) are the cost model's `step_sync`; what it has no term for shows as the gap (the wait of those
all-reduces for the slower rank, the step's host work outside the layers: data, embedding, head and
loss modules, the trainer's own Python). Every constant is calibrate's, measured on its probes,
none fitted to this step: GEMMs by size and smallest dimension, attention by head dim with grouped
kv heads, the elementwise work and a block's host work, each in fp32 and bf16; a bf16 run's casts
(the loss's logits to fp32 and back, the master weights into the module's copies) at the bf16
elementwise rate. On a quiet 2-core box, configs/tiny.yaml (bf16, dp2): 0.45x the median step before
attention was calibrated per dtype, 0.63x after; with the elementwise work, the GEMMs' shapes,
attention's head dim, the bf16 host work and the casts calibrated or priced, 0.79-0.85x the median
(0.91-0.95x the fastest) in two runs after one `ultrascale calibrate --ranks 2` (2026-11-28, 11:32
UTC, quiet). The same profile: tiny in fp32 0.90x (0.96x); pp2 with 4 micro-batches 0.76x (0.86x);
tp2 0.49x (0.63x): tensor parallel's per-layer collectives on a CPU cost more than the model
says (the next gap; `--config` takes each of these as a YAML).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measured(config: str, steps: int, folder: Path) -> dict:
    """Median and fastest step time and each collective's median time per step of a real run."""
    run = folder / "run"
    cmd = [sys.executable, "-m", "ultrascale.cli", "train", config, "--set",
           f"training.steps={steps}", "--set", "logging.every=1", "--set",
           f"logging.run_dir={run}", "--set", "logging.progress=false", "--set",
           "logging.sample_tokens=0", "--set", "checkpoint.every=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the training run failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    times = [r["step_time_s"] for r in records]
    kinds = sorted({k for r in records for k in r.get("comm", {})})
    comm = {k: statistics.median(r["comm"][k]["time_s"] if k in r["comm"] else 0.0
                                 for r in records) for k in kinds}
    return {"median": statistics.median(times), "fastest": min(times), "comm": comm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", required=True, help="a CPU profile YAML (ultrascale calibrate)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="4 steps: check that it runs")
    args = ap.parse_args(argv)

    from ultrascale.config import load_config
    from ultrascale.layout import Layout
    from ultrascale.memory.command import config_layout
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    cfg = load_config(args.config)
    hw = get_hardware(args.profile)
    if not hw.host_cores:
        raise SystemExit(f"{args.profile} is not a CPU profile (no host_cores): calibrate first.")
    layout: Layout = config_layout(cfg)  # the dtype this machine's run computes in
    pred = predict(cfg.model, layout, hw, memory=False)
    with tempfile.TemporaryDirectory() as tmp:
        got = measured(args.config, 4 if args.smoke else args.steps, Path(tmp))
    print(f"{args.config}: {layout.short()}, {layout.dtype}, profile {args.profile}")
    print(f"{'predicted step':<28} {pred.step_time_s * 1e3:9.1f} ms")
    for part, s in sorted(pred.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<26} {s * 1e3:9.1f} ms")
    print(f"{'measured step, median':<28} {got['median'] * 1e3:9.1f} ms  "
          f"(predicted / measured {pred.step_time_s / got['median']:.2f})")
    print(f"{'measured step, fastest':<28} {got['fastest'] * 1e3:9.1f} ms  "
          f"(predicted / measured {pred.step_time_s / got['fastest']:.2f})")
    for kind, s in got["comm"].items():
        print(f"  {kind:<26} {s * 1e3:9.1f} ms a step (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
