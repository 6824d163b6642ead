"""Compile against eager for the main job on this machine: `ultrascale train` (the tiny preset,
dp=2 local ranks, the built-in corpus) with `training.compile=false` and `true`, runs alternated,
tokens/s read from each run's metrics file.

    python benchmarks/bench_compile_cpu.py --rounds 3 --steps 60 --json out.json
    python benchmarks/bench_compile_cpu.py --smoke      # one short round: it runs

Each run logs every step; the first `--skip` steps (the compiled run's compilation, warm-up) are
left out and the median of the rest is the run's tokens/s. Both arms share one inductor cache
folder, so a compiled run after the first finds its kernels there, as a user's second run would:
the first compiled run's first step is reported apart (the cold compile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _train import train_run


def run_once(compiled: bool, steps: int, cache: str, workdir: Path, extra: list[str]) -> dict:
    run = train_run(workdir / f"{'compiled' if compiled else 'eager'}-{time.time_ns()}",
                    [f"training.steps={steps}", "training.warmup_steps=5",
                     f"training.compile={str(compiled).lower()}",
                     f"training.compile_cache={cache}", *extra])
    return {"compiled": compiled, "wall_s": run["seconds"], "records": run["records"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    help="more config overrides for both arms")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one round of 3 short steps on one process: check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.skip = 1, 3, 1
        args.extra += ["parallel.dp=1", "training.seq_len=32", "training.micro_batch_size=2",
                       "training.warmup_steps=0", "model.num_layers=1"]  # less to compile
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = str(work / "inductor-cache")
        runs = []
        for r in range(args.rounds):
            for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append(run_once(compiled, args.steps, cache, work, args.extra))
                last = runs[-1]
                tps = statistics.median(x["tokens_per_s"] for x in last["records"][args.skip:])
                print(f"round {r} {'compiled' if compiled else 'eager   '}: {tps:8.0f} tokens/s "
                      f"(wall {last['wall_s']:.1f} s, first step "
                      f"{last['records'][0]['step_time_s']:.2f} s)", flush=True)
    result = {}
    for arm in (False, True):
        mine = [x for x in runs if x["compiled"] == arm]
        per_run = [statistics.median(s["tokens_per_s"] for s in x["records"][args.skip:])
                   for x in mine]
        result["compiled" if arm else "eager"] = {
            "tokens_per_s_per_run": per_run, "median_tokens_per_s": statistics.median(per_run),
            "first_step_s": [x["records"][0]["step_time_s"] for x in mine],
            "wall_s": [x["wall_s"] for x in mine],
            "final_loss": [x["records"][-1]["loss"] for x in mine]}
    result["speedup"] = (result["compiled"]["median_tokens_per_s"]
                         / result["eager"]["median_tokens_per_s"])
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
