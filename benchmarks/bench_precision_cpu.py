"""bf16 against fp32 for the main job on this machine: `ultrascale train` (the tiny preset, dp=2
local ranks, the built-in corpus) with `precision.dtype=fp32` and `bf16`, runs alternated (the
order flips every round), tokens/s read from each run's metrics file.

    python benchmarks/bench_precision_cpu.py --rounds 3 --steps 60 --json out.json
    python benchmarks/bench_precision_cpu.py --smoke      # one short round: it runs
    python benchmarks/bench_precision_cpu.py --arms fp32,bf16,fp16   # more arms

Each run logs every step; the first `--skip` steps (warm-up) are left out and the median of the
rest is the run's tokens/s; an arm's figure is the median of its runs. On a machine shared with
other jobs only the ratio of alternated runs means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _train import train_run


def run_once(dtype: str, steps: int, workdir: Path, extra: list[str]) -> dict:
    run = train_run(workdir / f"{dtype}-{time.time_ns()}",
                    [f"training.steps={steps}", "training.warmup_steps=5",
                     f"precision.dtype={dtype}", *extra])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"dtype": dtype, "wall_s": run["seconds"], "records": run["records"],
            "load_1min": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="more config overrides for every arm")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one round of 3 short steps on one process: check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.skip = 1, 3, 1
        args.extra += ["parallel.dp=1", "training.seq_len=32", "training.micro_batch_size=2",
                       "training.warmup_steps=0"]
    arms = args.arms.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for dtype in (arms if r % 2 == 0 else arms[::-1]):
                runs.append(run_once(dtype, args.steps, Path(tmp), args.extra))
                last = runs[-1]
                tps = statistics.median(x["tokens_per_s"] for x in last["records"][args.skip:])
                print(f"round {r} {dtype:5s}: {tps:8.0f} tokens/s (wall {last['wall_s']:.1f} s, "
                      f"load {last['load_1min']})", flush=True)
    result = {}
    for dtype in arms:
        mine = [x for x in runs if x["dtype"] == dtype]
        per_run = [statistics.median(s["tokens_per_s"] for s in x["records"][args.skip:])
                   for x in mine]
        result[dtype] = {"tokens_per_s_per_run": per_run,
                         "median_tokens_per_s": statistics.median(per_run),
                         "wall_s": [round(x["wall_s"], 1) for x in mine],
                         "load_1min": [x["load_1min"] for x in mine],
                         "final_loss": [x["records"][-1]["loss"] for x in mine]}
    base = result[arms[0]]["median_tokens_per_s"]
    for dtype in arms[1:]:
        result[f"{dtype}_over_{arms[0]}"] = result[dtype]["median_tokens_per_s"] / base
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
