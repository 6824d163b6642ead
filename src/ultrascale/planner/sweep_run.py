"""Running a sweep's layouts: one local `ultrascale train` subprocess after another, or one Slurm
batch script per layout; then each run's status and metrics read back from its folder."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ultrascale.planner.sweep_grid import Attempt, Grid, Run

OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory|std::bad_alloc",
                 re.IGNORECASE)


def _train_args(grid: Grid, run: Run, attempt: int = 0) -> list[str]:
    run_dir = grid.run_dir(run, attempt).resolve()
    args = ["-m", "ultrascale.cli", "train"]
    base = grid.base_path
    if base is None and grid.base:
        base = str((grid.out / "base.yaml").resolve())
    if base:
        args.append(base)
    for item in grid.fixed + run.overrides + [
            f"logging.run_dir={run_dir}", f"logging.metrics_file={run_dir / 'metrics.jsonl'}",
            "logging.progress=false"]:
        args += ["--set", item]
    return args


def read_metrics(path: Path) -> dict:
    """Median step time, throughput and MFU over the logged steps (the first one, which pays for
    warm-up, is left out when there are others; the median, not the mean, so that one step slowed
    by another job on a shared machine does not move the figure), and the last loss."""
    if not path.is_file():
        return {}
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().startswith("{")]
    steps = [x for x in lines if "step_time_s" in x]
    if not steps:
        return {}
    timed = steps[1:] if len(steps) > 1 else steps
    median = lambda k: (statistics.median(x[k] for x in timed)  # noqa: E731
                        if all(x.get(k) is not None for x in timed) else None)
    return {"steps_logged": len(steps), "last_step": steps[-1].get("step"),
            "step_time_s": median("step_time_s"), "tokens_per_s": median("tokens_per_s"),
            "mfu": median("mfu"), "final_loss": steps[-1].get("loss")}


def _status(returncode: int | None, text: str, metrics: dict) -> str:
    if OOM.search(text or ""):
        return "oom"
    if returncode == 0 and metrics:
        return "ok"
    return "failed"


def rounds(grid: Grid) -> list[tuple[Run, int]]:
    """(run, attempt) in the order a local sweep runs them: `repeats` rounds over the layouts, every
    other round reversed."""
    order = []
    for k in range(grid.repeats):
        order += [(run, k) for run in (grid.runs if k % 2 == 0 else grid.runs[::-1])]
    return order


def run_local(grid: Grid, log=print) -> None:
    grid.out.mkdir(parents=True, exist_ok=True)
    if grid.base and grid.base_path is None:
        (grid.out / "base.yaml").write_text(yaml.safe_dump(grid.base, sort_keys=False))
    start = time.time()
    todo = rounds(grid)
    for run in grid.runs:
        run.attempts = [Attempt() for _ in range(grid.repeats)]
    for i, (run, k) in enumerate(todo, 1):
        run_dir = grid.run_dir(run, k)
        run_dir.mkdir(parents=True, exist_ok=True)
        _clear(run_dir)
        cmd = [sys.executable] + _train_args(grid, run, k)
        again = f" (repeat {k + 1}/{grid.repeats})" if grid.repeats > 1 else ""
        log(f"[{i}/{len(todo)}] {run.name}{again}: {' '.join(run.overrides)}")
        att = run.attempts[k]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=grid.timeout_s)
            att.returncode, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            att.returncode, text = None, f"timeout after {grid.timeout_s:.0f}s\n{exc.stderr or ''}"
        (run_dir / "output.log").write_text(text if isinstance(text, str) else text.decode())
        if hasattr(os, "getloadavg"):  # on a shared machine, what else was running
            att.load_1min = round(os.getloadavg()[0], 2)
        att.metrics = read_metrics(run_dir / "metrics.jsonl")
        att.status = "timeout" if att.returncode is None else _status(att.returncode, text,
                                                                       att.metrics)
        if att.status != "ok":
            tail = [x for x in str(text).strip().splitlines() if x.strip()]
            att.error = tail[-1][:300] if tail else ""
        tps = att.metrics.get("tokens_per_s")
        # Per device, as the table's tokens_per_s_per_device and the heatmap say it.
        log(f"    {att.status}" + (f", {tps / run.world_size:,.0f} tokens/s per device "
                                   f"({tps:,.0f} in all on {run.world_size})"
                                   if att.status == "ok" and tps else f": {att.error}")
            + f" ({time.time() - start:.0f}s so far, load {att.load_1min})")
    for run in grid.runs:
        run.summarize()


def write_slurm(grid: Grid) -> list[Path]:
    s = grid.slurm
    gpn = int(s.get("gpus_per_node", 8))
    port = int(s.get("port", 29500))
    folder = grid.out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    if grid.base and grid.base_path is None:
        (grid.out / "base.yaml").write_text(yaml.safe_dump(grid.base, sort_keys=False))
    scripts = []
    for run, k in rounds(grid):
        nodes = math.ceil(run.world_size / gpn)
        per_node = min(gpn, run.world_size)
        log_dir = grid.run_dir(run, k).resolve()
        job = run.name if grid.repeats == 1 else f"{run.name}-r{k + 1}"
        lines = ["#!/bin/bash", f"#SBATCH --job-name=us-{job}", f"#SBATCH --nodes={nodes}",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={per_node}",
                 f"#SBATCH --output={log_dir}/slurm-%j.out"]
        for key in ("partition", "time", "account", "qos"):
            if s.get(key):
                lines.append(f"#SBATCH --{key}={s[key]}")
        train = " ".join(_quote(a) for a in _train_args(grid, run, k))
        lines += ["set -euo pipefail", f"mkdir -p {log_dir}",
                  "# a sweep run again measures again: the earlier attempt's metrics and "
                  "checkpoints go",
                  f"rm -rf {log_dir}/metrics.jsonl {log_dir}/checkpoints",
                  'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
                  f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} '
                  f'--rdzv-backend c10d --rdzv-endpoint "$head:{port}" --rdzv-id "$SLURM_JOB_ID" '
                  f"{train.replace('-m ultrascale.cli', '-m ultrascale.cli', 1)}", ""]
        path = folder / f"{job}.sbatch"
        path.write_text("\n".join(lines))
        scripts.append(path)
    submit = folder / "submit_all.sh"
    submit.write_text("#!/bin/bash\nset -e\n" + "".join(f"sbatch {p.resolve()}\n" for p in scripts))
    submit.chmod(0o755)
    return scripts


def _clear(run_dir: Path) -> None:
    """A sweep's run folder measured again: the earlier attempt's metrics and checkpoints go (a
    training run refuses a fresh start into a folder that holds a run, run_folder.py)."""
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[A-Za-z0-9_./=:,+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def collect(grid: Grid) -> None:
    """Fill status and metrics from the run folders (after Slurm jobs have run)."""
    for run in grid.runs:
        run.attempts = [_collect_attempt(grid.run_dir(run, k)) for k in range(grid.repeats)]
        run.summarize()


def _collect_attempt(run_dir: Path) -> Attempt:
    att = Attempt(metrics=read_metrics(run_dir / "metrics.jsonl"))
    text = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("*.out")))
    text += "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("output.log")))
    if text or att.metrics:
        att.status = _status(0 if att.metrics else 1, text, att.metrics)
    return att
