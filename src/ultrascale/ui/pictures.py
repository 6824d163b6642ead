"""The web app's pictures as PNG files, for people who do not open a browser (matplotlib).

    ultrascale memory --preset llama3-8b --dp 8 --zero 1 --gpu h100 --plot memory.png
    ultrascale plot runs/<stamp>        # a run's curves -> runs/<stamp>/curves.png
    ultrascale plot sweeps/<name>       # a sweep's heatmap, drawn again -> sweeps/<name>/heatmap.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ultrascale.ui import runs as run_files

GIB = 2**30
# The memory categories of `ultrascale memory --json`, in stacking order, with the page's colours.
CATEGORIES = [("params", "parameters", "#4e79a7"), ("grads", "gradients", "#f28e2b"),
              ("optimizer", "optimizer state", "#59a14f"), ("activations", "activations", "#e15759"),
              ("comm_buffers", "communication buffers", "#b07aa1"),
              ("other", "workspaces", "#9c755f")]


class MissingMatplotlib(ValueError):
    """(A ValueError so that every command's handler prints it as one line.)"""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib("drawing a PNG needs matplotlib: pip install matplotlib "
                                "(requirements.txt pins it).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_memory(report: dict, by_seq_len: list[tuple[int, dict]], path: str | Path) -> Path:
    """Left: the layout's memory per device, stacked by category, against the device's memory.
    Right: the same for each sequence length (the playbook's memory-against-length chart)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8),
                                      gridspec_kw={"width_ratios": [1, 2.2]})
    _stack(left, ["this layout"], [report])
    _stack(right, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n, _ in by_seq_len],
           [r for _, r in by_seq_len])
    right.set_xlabel("sequence length")
    for ax in (left, right):
        if report.get("device_memory"):
            ax.axhline(report["device_memory"] / GIB, color="k", ls="--", lw=1)
        ax.set_ylabel("GiB per device")
    verdict = {True: "fits", False: "does NOT fit", None: ""}[report.get("fits")]
    model = report["model"].get("preset") or "model"
    left.set_title(f"{report['total_gib']:.1f} GiB {verdict}".strip(), fontsize=10)
    right.set_title(f"{model}, {_layout_text(report['layout'])}" + (
        "  (dashed: device memory)" if report.get("device_memory") else ""), fontsize=10)
    right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _stack(ax, labels: list[str], reports: list[dict]) -> None:
    bottom = [0.0] * len(reports)
    for key, name, color in CATEGORIES:
        values = [r[key] / GIB for r in reports]
        if any(values):
            ax.bar(labels, values, bottom=bottom, color=color, label=name, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values)]


def _layout_text(layout: dict) -> str:
    dims = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if layout.get(k, 1) > 1]
    return " ".join(dims + [f"zero{layout['zero']}", f"mbs{layout['mbs']}",
                            f"recompute {layout['recompute']}", layout["dtype"]])


def draw_run(records: list[dict], path: str | Path, title: str = "") -> Path:
    """A run's curves against the step: one panel per chart of `runs.CHARTS`."""
    plt = _pyplot()
    data = run_files.series(records)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
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
            ax.plot([p[0] for p in points], [p[1] / scale for p in points], label=line, lw=1.2)
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
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run folder (metrics.jsonl), its metrics file, or a sweep folder")
    p.add_argument("--out", help="the PNG (default: curves.png or heatmap.png in RUN_DIR)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    path = Path(args.run_dir)
    try:
        if path.is_file() or (path / "metrics.jsonl").is_file():
            records, _ = run_files.read_records(path)
            if not records:
                raise ValueError(f"{path} has no metric line yet; plot it after the first "
                                 "logged step.")
            folder = path.parent if path.is_file() else path
            out = draw_run(records, args.out or folder / "curves.png", title=str(folder))
        elif (path / "results.csv").is_file():
            from ultrascale.planner.sweep_report import draw_heatmap, read_heatmap

            out = draw_heatmap(read_heatmap(path), args.out or path / "heatmap.png")
        else:
            raise ValueError(f"{path} holds neither a run's metrics.jsonl nor a sweep's "
                             "results.csv; give a folder under runs/ or sweeps/.")
    except (ValueError, FileNotFoundError) as exc:
        print(f"ultrascale plot: {exc}", file=sys.stderr)
        return 2
    print(f"picture: {out}")
    return 0
