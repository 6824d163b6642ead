"""`ultrascale plot`: the web app's run pictures as PNG files, for people who do not open a browser
(matplotlib; `ultrascale memory --plot` is memory/plot.py).

    ultrascale plot runs/<stamp>        # a run's curves -> runs/<stamp>/curves.png
    ultrascale plot runs/a runs/b       # two runs in the same charts -> compare.png
    ultrascale plot sweeps/<name>       # a sweep's heatmap, drawn again -> sweeps/<name>/heatmap.png

The curves: the training loss with the validation loss (when the run evaluates), the learning
rate, the gradient norm, throughput, MFU, memory and communication, against the step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ultrascale.memory.plot import GIB, pyplot
from ultrascale.ui import runs as run_files


def draw_run(records: list[dict] | dict[str, list[dict]], path: str | Path,
             title: str = "") -> Path:
    """A run's curves against the step, one panel per chart of `runs.CHARTS`; given several runs
    (label -> records), each line of each run in the same panels."""
    plt = pyplot()
    if isinstance(records, dict):
        data = run_files.overlay({k: run_files.series(v) for k, v in records.items()})
    else:
        data = run_files.series(records)
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5))
    for ax in axes.flat[len(run_files.CHARTS):]:
        ax.axis("off")
    for ax, (chart, (name, unit)) in zip(axes.flat, run_files.CHARTS.items()):
        ax.set_title(name, fontsize=10)
        if not data[chart]:
            ax.text(0.5, 0.5, "not logged" if chart != "mfu" else
                    "unknown: the device's peak rate\nis not known (e.g. a CPU)",
                    ha="center", va="center", transform=ax.transAxes, color="#777")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        scale, suffix = (GIB / 1024, " MiB") if unit == "bytes" else (1, "")
        for line, points in data[chart].items():
            ax.plot([p[0] for p in points], [p[1] / scale for p in points], label=line, lw=1.2,
                    marker="o" if len(points) <= 0.25 * max(len(v) for v in data[chart].values())
                    else None, ms=3)  # (sparse lines, the validation loss, as dots)
        if chart == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if suffix:
            ax.set_ylabel(suffix.strip())
        if len(data[chart]) > 1:
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="a run's curves (or a sweep's heatmap) as a PNG",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="a run folder (metrics.jsonl), its metrics file, or a sweep folder; "
                        "several runs: drawn in the same charts")
    p.add_argument("--out", help="the PNG (default: curves.png or heatmap.png in RUN_DIR; "
                                 "compare.png here for several runs)")
    p.set_defaults(func=run)
    return p


def _records(path: Path) -> list[dict]:
    records, _ = run_files.read_records(path)
    if not records:
        raise ValueError(f"{path} has no metric line yet; plot it after the first logged step.")
    return records


def run(args) -> int:
    paths = [Path(p) for p in args.run_dir]
    path = paths[0]
    try:
        if len(paths) > 1:
            runs = dict(zip(run_files.labels(paths), (_records(p) for p in paths)))
            out = draw_run(runs, args.out or "compare.png", title=" vs ".join(runs))
        elif path.is_file() or (path / "metrics.jsonl").is_file():
            folder = path.parent if path.is_file() else path
            out = draw_run(_records(path), args.out or folder / "curves.png", title=str(folder))
        elif (path / "results.csv").is_file():
            from ultrascale.planner.sweep_report import draw_heatmap, read_heatmap

            out = draw_heatmap(read_heatmap(path), args.out or path / "heatmap.png")
        else:
            raise ValueError(f"{path} holds neither a run's metrics.jsonl nor a sweep's "
                             "results.csv; give a folder under runs/ or sweeps/.")
    except (ValueError, FileNotFoundError) as exc:
        print(f"ultrascale plot: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # (the sweep heatmap's own import of matplotlib)
        print(f"ultrascale plot: drawing a PNG needs {exc.name}: pip install {exc.name}.",
              file=sys.stderr)
        return 2
    print(f"picture: {out}")
    return 0
