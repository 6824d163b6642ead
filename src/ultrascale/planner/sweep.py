"""`ultrascale sweep GRID.yaml`: run (or submit) many layouts and collect one results table.

GRID.yaml:

    base: configs/small.yaml          # optional: a config file, or a mapping of config sections
    set: [training.steps=20]          # optional: overrides for every run
    grid:                             # every combination of these config keys
      parallel.dp: [1, 2, 4]
      training.micro_batch_size: [1, 2, 4]
    layouts: [dp=2,mbs=4, ...]        # optional: explicit layouts instead of (or besides) the grid
    global_batch_size: 8              # optional: keep only runs with dp x mbs x accumulation = 8
    out: sweeps/dp-mbs                # results folder (default sweeps/<grid file name>)
    mode: local                       # local: one run after another; slurm: write batch scripts
    timeout_s: 900                    # per local run
    predict: local                    # optional hardware profile: predicted step time per run
    repeats: 1                        # run every layout this many times (rounds in alternating order)
    heatmap: {x: parallel.dp, y: training.micro_batch_size}   # default: the first two grid keys
    slurm: {gpus_per_node: 8, partition: gpu, time: "00:30:00", account: null, port: 29500}

Local runs are `python -m ultrascale.cli train [base] --set ...` subprocesses; each run's metrics
file, status (ok, oom, failed, timeout) and configuration go into `results.csv`, throughput into
`heatmap.png`. With `repeats: N` (or `--repeats N`) every layout runs N times, in N rounds that
alternate the order (forward, reversed, forward, ...) so that no layout always meets the same
moment of a shared machine's load; a layout's figures are those of its fastest repeat (a run is as
fast as it was left alone: what others do on the machine only ever slows it), and `step_time_s_each`
lists every repeat's. With mode: slurm, one `<run>.sbatch` per layout (`srun torchrun ...`) and
`submit_all.sh` are written; `ultrascale sweep GRID.yaml --collect` builds the table afterwards.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ultrascale.config import ConfigError, build_config
from ultrascale.layout import Layout, parse_layout

OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory|std::bad_alloc",
                 re.IGNORECASE)


@dataclass
class Attempt:
    """One run of a layout (a sweep with `repeats` runs each layout several times)."""

    status: str = "pending"
    returncode: int | None = None
    metrics: dict = field(default_factory=dict)
    error: str = ""
    load_1min: float | None = None


@dataclass
class Run:
    name: str
    overrides: list[str]  # section.key=value
    values: dict  # the grid keys of this run and their values
    status: str = "pending"
    returncode: int | None = None
    metrics: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    error: str = ""
    load_1min: float | None = None  # the machine's 1-minute load average as the run ended
    world_size: int = 1
    global_batch_size: int = 1
    attempts: list[Attempt] = field(default_factory=list)

    def summarize(self) -> None:
        """The layout's figures from its attempts: the fastest successful one (on a shared machine
        the least disturbed), or the last one when none succeeded."""
        done = [a for a in self.attempts if a.status != "pending"]
        ok = [a for a in done if a.status == "ok" and a.metrics.get("step_time_s")]
        pick = min(ok, key=lambda a: a.metrics["step_time_s"]) if ok else (
            done[-1] if done else Attempt())
        self.status, self.returncode, self.metrics = pick.status, pick.returncode, dict(pick.metrics)
        self.error, self.load_1min = pick.error, pick.load_1min
        if len(self.attempts) > 1:  # in repeat order, empty where an attempt did not succeed
            self.metrics["step_time_s_each"] = ";".join(
                f"{a.metrics['step_time_s']:.4f}" if any(a is o for o in ok) else ""
                for a in self.attempts)


@dataclass
class Grid:
    base: dict
    base_path: str | None
    fixed: list[str]
    runs: list[Run]
    out: Path
    mode: str
    timeout_s: float
    predict: str | None
    axes: tuple[str, str] | None
    slurm: dict
    repeats: int = 1

    def run_dir(self, run: Run, attempt: int) -> Path:
        """Where attempt `attempt` (0-based) of `run` writes: the run's folder, or with repeats one
        sub-folder per attempt."""
        return self.out / run.name if self.repeats == 1 else self.out / run.name / f"r{attempt + 1}"


def _name(values: dict) -> str:
    parts = [f"{k.split('.')[-1]}{v}" for k, v in values.items()]
    return re.sub(r"[^A-Za-z0-9_.-]", "", "-".join(parts)) or "run"


def _layout_overrides(text: str) -> dict:
    lay = parse_layout(text)
    # In the order the text names them (a set would order the run names differently in each
    # Python process, and `--collect` would then not find the runs' folders).
    given = list(dict.fromkeys(k.strip().split("=")[0] for k in text.split(",") if k.strip()))
    flat = {}
    for section, keys in lay.config_overrides().items():
        for key, value in keys.items():
            flat[f"{section}.{key}"] = value
    # Only the keys the layout string names (and what they imply); the rest stays as in base.
    wanted = {"dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
              "ep": "parallel.ep", "zero": "parallel.zero", "mbs": "training.micro_batch_size",
              "micro_batch_size": "training.micro_batch_size", "acc": "training.grad_accum_steps",
              "grad_accum": "training.grad_accum_steps",
              "grad_accum_steps": "training.grad_accum_steps", "recompute": "training.recompute",
              "seq_len": "training.seq_len", "seq": "training.seq_len",
              "sp": "parallel.sequence_parallel",
              "sequence_parallel": "parallel.sequence_parallel",
              "schedule": "parallel.pp_schedule", "pp_schedule": "parallel.pp_schedule",
              "v": "parallel.pp_virtual_stages", "vpp": "parallel.pp_virtual_stages",
              "pp_virtual_stages": "parallel.pp_virtual_stages", "dtype": "precision.dtype",
              "dp_shard": "parallel.dp_shard", "bucket_mb": "parallel.bucket_mb"}
    return {wanted[k]: flat[wanted[k]] for k in given if k in wanted}


def load_grid(path: str | Path) -> Grid:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"grid file {str(path)!r} does not exist; give the path of a GRID.yaml "
                         "(see `ultrascale sweep --help` for its format).")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"grid file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"grid file {str(path)!r} must hold a mapping (see `ultrascale sweep "
                         "--help`).")
    known = {"base", "set", "grid", "layouts", "global_batch_size", "out", "mode", "timeout_s",
             "predict", "heatmap", "slurm", "repeats"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"grid file {str(path)!r} has unknown keys {sorted(unknown)}; known: "
                         f"{sorted(known)}.")
    if not (spec.get("grid") or spec.get("layouts")):
        raise ValueError(f"grid file {str(path)!r} needs a `grid` (config keys to lists of "
                         "values) or a `layouts` list.")
    base, base_path = {}, None
    if isinstance(spec.get("base"), str):
        base_path = str((path.parent / spec["base"]).resolve())
        if not Path(base_path).is_file():
            raise ValueError(f"base config {spec['base']!r} (relative to the grid file) does not exist.")
        base = yaml.safe_load(Path(base_path).read_text()) or {}
    elif isinstance(spec.get("base"), dict):
        base = spec["base"]
    fixed = [str(s) for s in spec.get("set") or []]
    combos: list[dict] = []
    grid = spec.get("grid") or {}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"grid key {key!r} must list its values, e.g. {key}: [1, 2, 4].")
    if grid:
        keys = list(grid)
        combos += [dict(zip(keys, vals)) for vals in itertools.product(*grid.values())]
    for text in spec.get("layouts") or []:
        combos.append(_layout_overrides(str(text)))
    runs = []
    for values in combos:
        overrides = [f"{k}={_yaml_value(v)}" for k, v in values.items()]
        try:
            cfg = build_config(base, fixed + overrides)
        except ConfigError as exc:
            raise ValueError(f"run {_name(values)} of {path.name} is not a valid config: {exc}") from None
        gbs = spec.get("global_batch_size")
        if gbs is not None and cfg.global_batch_size != int(gbs):
            continue
        runs.append(Run(name=_name(values), overrides=overrides, values=values,
                        world_size=cfg.parallel.world_size,
                        global_batch_size=cfg.global_batch_size))
    if not runs:
        raise ValueError(f"no run of {path.name} reaches global_batch_size="
                         f"{spec.get('global_batch_size')}; widen the grid or change it.")
    mode = spec.get("mode", "local")
    if mode not in ("local", "slurm"):
        raise ValueError(f"mode={mode!r} in {path.name}: choose local or slurm.")
    repeats = spec.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} in {path.name}: give a whole number of runs per "
                         "layout, at least 1.")
    axes = None
    heat = spec.get("heatmap") or {}
    keys = list(grid) or sorted({k for r in runs for k in r.values})
    if heat.get("x") and heat.get("y"):
        axes = (heat["x"], heat["y"])
    elif len(keys) >= 2:
        axes = (keys[0], keys[1])
    return Grid(base=base, base_path=base_path, fixed=fixed, runs=runs,
                out=Path(spec.get("out") or Path("sweeps") / path.stem), mode=mode,
                timeout_s=float(spec.get("timeout_s", 900)), predict=spec.get("predict"),
                axes=axes, slurm=dict(spec.get("slurm") or {}), repeats=repeats)


def _yaml_value(v) -> str:
    return json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)


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
        log(f"    {att.status}" + (f", {att.metrics['tokens_per_s']:,.0f} tokens/s"
                                   if att.status == "ok" and att.metrics.get("tokens_per_s")
                                   else f": {att.error}")
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


def add_predictions(grid: Grid) -> None:
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    hw = get_hardware(grid.predict)
    for run in grid.runs:
        cfg = build_config(grid.base, grid.fixed + run.overrides)
        p = predict(cfg.model, Layout.from_config(cfg), hw, memory=False)
        run.predicted = {"predicted_step_time_s": p.step_time_s,
                         "predicted_tokens_per_s": p.tokens_per_s, "predicted_dominant": p.dominant}


def write_csv(grid: Grid) -> Path:
    keys = list(dict.fromkeys(k for r in grid.runs for k in r.values))
    cols = (["name", "status"] + keys + ["world_size", "global_batch_size", "steps_logged",
                                         "step_time_s", "tokens_per_s", "tokens_per_s_per_device",
                                         "mfu", "final_loss", "step_time_s_each",
                                         "predicted_step_time_s",
                                         "predicted_tokens_per_s", "predicted_dominant",
                                         "load_1min", "returncode", "error"])
    path = grid.out / "results.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in grid.runs:
            tps = r.metrics.get("tokens_per_s")
            row = {"name": r.name, "status": r.status, **r.values, "world_size": r.world_size,
                   "global_batch_size": r.global_batch_size, **r.metrics, **r.predicted,
                   "tokens_per_s_per_device": tps / r.world_size if tps else None,
                   "load_1min": r.load_1min, "returncode": r.returncode, "error": r.error}
            w.writerow({k: row.get(k) for k in cols})
    return path


def rank_agreement(grid: Grid) -> float | None:
    """Spearman correlation of predicted and measured step times over the successful runs."""
    pairs = [(r.predicted["predicted_step_time_s"], r.metrics["step_time_s"]) for r in grid.runs
             if r.status == "ok" and r.predicted and r.metrics.get("step_time_s")]
    if len(pairs) < 3:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr([p for p, _ in pairs], [m for _, m in pairs]).statistic)


def draw_heatmap(grid: Grid) -> Path | None:
    """Throughput per device over two grid keys, like the playbook's heatmaps (OOM cells marked)."""
    if grid.axes is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: the heatmap needs matplotlib (pip install 'ultrascale[plots]'); the CSV is "
              "written.", file=sys.stderr)
        return None
    kx, ky = grid.axes
    xs = sorted({r.values.get(kx) for r in grid.runs if kx in r.values}, key=str)
    ys = sorted({r.values.get(ky) for r in grid.runs if ky in r.values}, key=str)
    if not xs or not ys:
        return None
    import numpy as np

    value = np.full((len(ys), len(xs)), np.nan)
    label = [["" for _ in xs] for _ in ys]
    for r in grid.runs:
        if kx not in r.values or ky not in r.values:
            continue
        i, j = ys.index(r.values[ky]), xs.index(r.values[kx])
        tps = r.metrics.get("tokens_per_s")
        if r.status == "ok" and tps:
            per_dev = tps / r.world_size
            if np.isnan(value[i, j]) or per_dev > value[i, j]:  # best over the other keys
                value[i, j] = per_dev
                label[i][j] = f"{per_dev:,.0f}"
        elif not label[i][j]:
            label[i][j] = r.status.upper()
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2, 0.8 * len(ys) + 1.5))
    im = ax.imshow(value, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel(kx)
    ax.set_ylabel(ky)
    for i in range(len(ys)):
        for j in range(len(xs)):
            ax.text(j, i, label[i][j], ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=ax, label="tokens/s per device")
    ax.set_title(f"{grid.out.name}: throughput by layout")
    fig.tight_layout()
    path = grid.out / "heatmap.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep(grid_path: str | Path, collect_only: bool = False, log=print, out: str | None = None,
          reverse: bool = False, repeats: int | None = None) -> Grid:
    grid = load_grid(grid_path)
    if out:
        grid.out = Path(out)
    if repeats is not None:
        if repeats < 1:
            raise ValueError(f"--repeats {repeats}: give at least 1 run per layout.")
        grid.repeats = repeats
    if reverse:
        grid.runs.reverse()
    if grid.mode == "slurm" and not collect_only:
        scripts = write_slurm(grid)
        log(f"wrote {len(scripts)} batch scripts in {grid.out / 'slurm'}; submit with "
            f"{grid.out / 'slurm' / 'submit_all.sh'}, then run `ultrascale sweep {grid_path} "
            "--collect`.")
        return grid
    if collect_only:
        collect(grid)
    else:
        run_local(grid, log)
    if grid.predict:
        add_predictions(grid)
    log(f"results: {write_csv(grid)}")
    heat = draw_heatmap(grid)
    if heat:
        log(f"heatmap: {heat}")
    rho = rank_agreement(grid)
    if rho is not None:
        log(f"predicted vs measured step time, Spearman rank correlation: {rho:.2f}")
    return grid


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="run or submit a grid of layouts, collect one table",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", help="GRID.yaml")
    p.add_argument("--collect", action="store_true",
                   help="only collect the results of runs already done (e.g. Slurm jobs)")
    p.add_argument("--out", help="results folder (default: the grid's `out`): repeat a sweep "
                                 "without overwriting the last one")
    p.add_argument("--reverse", action="store_true",
                   help="run the layouts in reverse order (a repeat on a shared machine then does "
                        "not give the same layouts the same moments of load)")
    p.add_argument("--repeats", type=int,
                   help="run every layout this many times, in rounds of alternating order, and keep "
                        "each layout's fastest run (default: the grid's `repeats`, else 1)")


def run(args) -> int:
    try:
        grid = sweep(args.grid, collect_only=args.collect, out=args.out, reverse=args.reverse,
                     repeats=args.repeats)
    except (ValueError, ConfigError) as exc:
        print(f"ultrascale sweep: {exc}", file=sys.stderr)
        return 2
    return 0 if grid.mode == "slurm" or any(r.status == "ok" for r in grid.runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ultrascale sweep", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
