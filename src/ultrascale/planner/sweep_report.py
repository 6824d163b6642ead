"""A sweep's results: predictions beside the measurements, `results.csv`, the rank agreement of
predicted and measured step times, and the throughput heatmap."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from ultrascale.config import build_config
from ultrascale.layout import Layout
from ultrascale.planner.sweep_grid import Grid


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
