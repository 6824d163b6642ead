"""CPU time of one `estimate` and one `predict` over the planner's layouts, and a dump of their
answers (to show that a change to the folds leaves every figure as it was).

    python benchmarks/fold_cost.py [--reps 5] [--every 7] [--dump PATH] [--tiny]

The grid: the models below x the layouts `planner.search.enumerate_layouts` gives on 8, 64 and 512
H100s (every `--every`-th, 4M-token batches of 4096-token sequences) x our runtime and nanotron's.
Times are CPU seconds of this process (`time.process_time`, so a loaded machine inflates them
less than wall time), per call, the best of `--reps` passes over the grid: `estimate` fresh (its
cache cleared before each pass) and `predict(memory=False)` (what the playbook fit calls). The
script only uses the package's public calls, so it runs against an older tree too
(`PYTHONPATH=<that tree>/src`), which is how old and new are compared. `--dump` writes every
answer (`MemoryEstimate.to_dict()`, `Prediction.as_dict()`) as JSON lines and prints its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from ultrascale.config import ModelConfig
from ultrascale.memory import estimator
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import H100
from ultrascale.planner.search import enumerate_layouts

MODELS = ("llama3-1b", "llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
RUNTIMES = ("ultrascale", "nanotron")


def grid(every: int, devices: tuple[int, ...]) -> list[tuple]:
    out = []
    for name in MODELS:
        model = ModelConfig(preset=name)
        for n in devices:
            layouts = enumerate_layouts(model, n, 4 * 1024 * 1024, 4096, H100)[::every]
            out += [(model, lay, rt) for lay in layouts for rt in RUNTIMES]
    return out


def answers(cells: list[tuple]):
    for model, lay, rt in cells:
        try:
            est = estimator.estimate(model, lay, runtime=rt, device_memory=80 * 2**30).to_dict()
        except estimator.LayoutError as e:
            est = {"refused": str(e)}
        pred = predict(model, lay, H100, runtime=rt).as_dict()
        yield {"model": model.preset, "layout": lay.short(), "runtime": rt, "estimate": est,
               "predict": pred}


def cpu_per_call(call, cells: list[tuple], reps: int, before=None) -> float:
    best = float("inf")
    for _ in range(reps):
        if before:
            before()
        t0 = time.process_time()
        for cell in cells:
            call(*cell)
        best = min(best, time.process_time() - t0)
    return best / len(cells)


def _estimate(model, lay, rt):
    try:
        estimator.estimate(model, lay, runtime=rt)
    except estimator.LayoutError:
        pass


def _predict(model, lay, rt):
    predict(model, lay, H100, memory=False, runtime=rt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--every", type=int, default=7, help="take every n-th layout")
    ap.add_argument("--dump", help="write every answer here (JSON lines)")
    ap.add_argument("--tiny", action="store_true", help="a small grid (proves the script runs)")
    args = ap.parse_args(argv)
    cells = grid(args.every * 20 if args.tiny else args.every, (8,) if args.tiny else (8, 64, 512))
    if args.dump:
        digest = hashlib.sha256()
        with open(args.dump, "w") as f:
            for row in answers(cells):
                line = json.dumps(row, sort_keys=True) + "\n"
                f.write(line)
                digest.update(line.encode())
        print(f"dump: {len(cells)} cells, sha256 {digest.hexdigest()}")
    est = cpu_per_call(_estimate, cells, args.reps, before=estimator._estimate.cache_clear)
    pred = cpu_per_call(_predict, cells, args.reps)
    print(f"{len(cells)} cells, best of {args.reps}: estimate (fresh) {est * 1e6:.1f} us, "
          f"predict(memory=False) {pred * 1e6:.1f} us of CPU per call")


if __name__ == "__main__":
    main()
