"""`ultrascale sweep GRID.yaml`: run (or submit) many layouts and collect one results table.

GRID.yaml:

    base: configs/tiny.yaml           # optional: a config file, or a mapping of config sections
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
                                      # (layouts alone: the key across that leaves fewest rows)
    slurm: {gpus_per_node: 8, partition: gpu, time: "00:30:00", account: null, port: 29500}

Local runs are `python -m ultrascale.cli train [base] --set ...` subprocesses; each run's metrics
file, status (ok, oom, failed, timeout) and configuration go into `results.csv`, throughput per
device into `heatmap.png` (its data in `heatmap.json`): columns are the `heatmap: x` key, rows the
`y` key and then every other key the sweep varies, so that each run has a cell of its own (a run
that leaves a key to the base config is placed by the base's value). With `repeats: N` (or `--repeats N`) every layout runs N times, in N rounds that
alternate the order (forward, reversed, forward, ...) so that no layout always meets the same
moment of a shared machine's load; a layout's figures are those of its fastest repeat (a run is as
fast as it was left alone: what others do on the machine only ever slows it), and `step_time_s_each`
lists every repeat's. With mode: slurm, one `<run>.sbatch` per layout (`srun torchrun ...`) and
`submit_all.sh` are written; `ultrascale sweep GRID.yaml --collect` builds the table afterwards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ultrascale.config import ConfigError
from ultrascale.planner.sweep_grid import Attempt, Grid, Run, load_grid
from ultrascale.planner.sweep_report import (add_predictions, draw_heatmap, rank_agreement,
                                             read_heatmap, write_csv, write_heatmap)
from ultrascale.planner.sweep_run import collect, read_metrics, rounds, run_local, write_slurm

# The command and its three parts: the grid (sweep_grid), running it (sweep_run) and the report
# (sweep_report). Callers import any of them from here.
__all__ = ["Attempt", "Grid", "Run", "add_predictions", "collect", "draw_heatmap", "load_grid",
           "main", "rank_agreement", "read_heatmap", "read_metrics", "rounds", "run_local", "sweep",
           "write_csv", "write_heatmap", "write_slurm"]


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
    data, picture = write_heatmap(grid)
    log(f"heatmap: {picture or data} (tokens/s per device; every run has a cell)")
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
