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


# The convergence benchmarks' shared frame: their options, results.json, and the loss plots.

def convergence_arguments(description: str, runs: list[str], out: Path, png: Path):
    """--only (some of `runs`), --out (where results.json and table.md go), --png, --table-only
    (redraw from results.json)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--only", default=",".join(runs))
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--png", default=str(png))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def load_results(out: str | Path) -> dict:
    saved = Path(out) / "results.json"
    return json.loads(saved.read_text())["runs"] if saved.is_file() else {}


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
