"""`ultrascale train` runs for the benchmarks: each a subprocess, as a user runs it, with one
metrics line per step read back from its run folder.

    run = train_run(run_dir, ["training.steps=40", "precision.dtype=bf16"])
    run["records"], run["seconds"], run["stdout"]

`mean_of_last(losses)`: a run's final loss (a step's loss is one noisy batch);
`running_mean(losses)`: a curve without the batches' noise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOGGED_EVERY_STEP = ["logging.every=1", "logging.progress=false", "logging.sample_tokens=0"]


def train_run(run_dir: Path, overrides: list[str], config: str | None = None,
              cwd: Path | None = None) -> dict:
    """Train once into a fresh `run_dir` (its metrics file would be appended to) and return the
    step records, the wall seconds from start to exit and the output."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "ultrascale.cli", "train", *([config] if config else [])]
    for o in [f"logging.run_dir={run_dir}", *LOGGED_EVERY_STEP, *overrides]:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in records if "loss" in r], "seconds": seconds,
            "stdout": proc.stdout}


def mean_of_last(values: list[float], n: int = 20) -> float:
    return sum(values[-n:]) / len(values[-n:])


def running_mean(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1])
            for i in range(len(values))]


# The convergence benchmarks' shared frame: their options, results.json, the comparison of runs
# over seeds, and the loss plots.

# Every run is repeated with these seeds (initial weights and the data order both follow the
# seed); a difference between two runs is set against how much one run moves from seed to seed.
SEEDS = (1234, 1235, 1236)


def convergence_arguments(description: str, runs: list[str], out: Path, png: Path,
                          smoke_runs: list[str], argv: list[str] | None = None):
    """--only (some of `runs`), --seeds, --out (where results.json and table.md go), --png,
    --table-only (redraw from results.json), --smoke (`smoke_runs` only, the first with two
    seeds, a few steps on one process, into --out: check that it runs)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--only", default=",".join(runs))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--png", default=None, help=f"default: {png} ({{out}}/curves.png with --smoke)")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="two runs (the first with two seeds), 2 short steps on one process: check "
                         "that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.only, args.seeds = ",".join(smoke_runs), ",".join(map(str, SEEDS[:2]))
    args.png = args.png or str(Path(args.out) / "curves.png" if args.smoke else png)
    args.seed_list = [int(x) for x in args.seeds.split(",")]
    # --smoke: the first run (the one the others are held against) with both seeds, for its
    # spread, the others with the first.
    args.seeds_of = lambda name: (args.seed_list[:1] if args.smoke and name != smoke_runs[0]
                                  else args.seed_list)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


# What --smoke adds to every run's overrides: two short steps of the same job on one process.
SMOKE_OVERRIDES = ["training.steps=2", "training.warmup_steps=0", "parallel.dp=1",
                   "training.seq_len=32", "training.micro_batch_size=2", "checkpoint.every=0"]


def load_results(out: str | Path) -> dict:
    """name -> seed (a string, as JSON keys are) -> that run's record. A file of one seed per run
    (before the seeds) reads as seed 1234's."""
    saved = Path(out) / "results.json"
    runs = json.loads(saved.read_text())["runs"] if saved.is_file() else {}
    return {name: ({"1234": r} if "losses" in r else r) for name, r in runs.items()}


def seed_finals(results: dict, name: str, final) -> dict[str, float]:
    """seed -> the run's final loss, for the seeds it was run with."""
    return {seed: final(r["losses"]) for seed, r in results.get(name, {}).items()
            if "losses" in r}


def against(results: dict, name: str, base: str, final) -> dict | None:
    """Run `name` against run `base` over the seeds both have: the mean of the per-seed relative
    differences of their final losses (the same seed: the same initial weights and batches), and
    the seed-to-seed spread of `base` (the standard deviation of its final losses over their mean)
    that the difference is set against. None without a common seed."""
    import statistics

    mine, theirs = seed_finals(results, name, final), seed_finals(results, base, final)
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None
    diffs = [mine[s] / theirs[s] - 1 for s in common]
    values = list(theirs.values())
    spread = statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else None
    return {"seeds": len(common), "mean_diff": statistics.mean(diffs), "diffs": diffs,
            "spread": spread}


def describe(cmp: dict | None) -> tuple[str, str]:
    """(difference, spread) cells of a table: "+1.20%", "0.80% (1.5x)" (the difference in units
    of the spread)."""
    if cmp is None:
        return "", ""
    d, spread = cmp["mean_diff"], cmp["spread"]
    if spread is None:
        return f"{d:+.2%}", "one seed"
    return f"{d:+.2%}", f"{spread:.2%} ({abs(d) / spread:.1f}x)" if spread else "0"


def save_results(out: str | Path, results: dict) -> None:
    """After every run, so that an interrupted benchmark keeps what it measured."""
    from datetime import datetime, timezone

    (Path(out) / "results.json").write_text(json.dumps({
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "runs": results}, indent=1))


def loss_axes(ax, xlabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (10-step running mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()


def save_figure(fig, path: str | Path) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
