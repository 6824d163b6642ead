"""A sweep's results: predictions beside the measurements, `results.csv`, the rank agreement of
predicted and measured step times, and the throughput heatmap."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from ultrascale.config import build_config
from ultrascale.planner.sweep_grid import Grid


def add_predictions(grid: Grid) -> None:
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    hw = get_hardware(grid.predict)
    for run in grid.runs:
        # The dtype the run computes in: `auto` resolved as the launcher will (here for a local
        # sweep; on the cluster's GPUs for a Slurm one).
        cfg = build_config(grid.base, grid.fixed + run.overrides,
                           cuda=None if grid.mode == "local" else True)
        lay = cfg.layout()
        p = predict(cfg.model, lay, hw, memory=False)
        run.predicted = {"predicted_step_time_s": p.step_time_s,
                         "predicted_tokens_per_s": p.tokens_per_s, "predicted_dominant": p.dominant}


# results.csv: name, status, the swept keys, then these.
RESULT_COLUMNS = ["world_size", "global_batch_size", "steps_logged", "step_time_s", "tokens_per_s",
                  "tokens_per_s_per_device", "mfu", "final_loss", "step_time_s_each",
                  "predicted_step_time_s", "predicted_tokens_per_s", "predicted_dominant",
                  "load_1min", "returncode", "error"]


def write_csv(grid: Grid) -> Path:
    """One row per run: its status, the value of every swept key it ran with (also the keys its
    `layouts:` entry left to the base config), its measured and predicted figures."""
    keys = list(dict.fromkeys(k for r in grid.runs for k in r.values))
    cols = ["name", "status"] + keys + RESULT_COLUMNS
    path = grid.out / "results.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in grid.runs:
            tps = r.metrics.get("tokens_per_s")
            row = {"name": r.name, "status": r.status, **r.values, **r.settings,
                   "world_size": r.world_size,
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
    from ultrascale.planner.curves import spearman

    return spearman([p for p, _ in pairs], [m for _, m in pairs])


def heatmap_data(runs: list[dict], keys: list[str], axes: tuple[str, str] | None = None,
                 title: str = "") -> dict:
    """The table behind the heatmap, where every run has a cell of its own.

    `runs`: {"name", "status", "settings" (swept key -> value), "tokens_per_s_per_device"}.
    Columns are the values of one key (`axes[0]`; without axes, the key that leaves the fewest
    rows); rows are the values of `axes[1]` followed by every other key that varies, so that no
    run hides behind another. A position no run of the sweep has is left out of `cells` (drawn as
    "not in sweep", not as a failure); runs with the same settings (a layout listed twice) share a
    cell, which shows the best. Throughput is per device, as the console prints it."""
    varying = [k for k in keys if len({_text(r["settings"].get(k)) for r in runs}) > 1]

    def rows_across(key):  # how many rows the other varying keys make with `key` across
        return len({_text([r["settings"].get(k) for k in varying if k != key]) for r in runs})

    if axes:
        x = axes[0]
    else:  # the key across that leaves the fewest rows: the densest picture
        x = min(varying, key=rows_across) if varying else (keys[0] if keys else None)
    first = [axes[1]] if axes else []
    y = first + [k for k in varying if k != x and k not in first]
    xs = _sorted_values(r["settings"].get(x) for r in runs) if x else [None]
    ys = _sorted_values(tuple(r["settings"].get(k) for k in y) for r in runs)
    cells: dict[tuple[int, int], dict] = {}
    for r in runs:
        col = xs.index(r["settings"].get(x)) if x else 0
        row = ys.index(tuple(r["settings"].get(k) for k in y))
        cell = cells.setdefault((row, col), {"row": row, "col": col, "runs": [], "status": None,
                                             "tokens_per_s_per_device": None})
        value = r.get("tokens_per_s_per_device") if r["status"] == "ok" else None
        cell["runs"].append({"name": r["name"], "status": r["status"],
                             "tokens_per_s_per_device": value})
        if value is not None and (cell["tokens_per_s_per_device"] is None
                                  or value > cell["tokens_per_s_per_device"]):
            cell["tokens_per_s_per_device"], cell["status"] = value, "ok"
        elif cell["status"] != "ok":
            cell["status"] = cell["status"] or r["status"]
    return {"title": title, "unit": "tokens/s per device", "x": x, "y": y, "xs": xs,
            "ys": [list(v) for v in ys], "cells": sorted(cells.values(),
                                                         key=lambda c: (c["row"], c["col"]))}


def grid_heatmap(grid: Grid) -> dict:
    keys = list(dict.fromkeys(k for r in grid.runs for k in r.values))
    runs = [{"name": r.name, "status": r.status, "settings": r.settings,
             "tokens_per_s_per_device": (r.metrics["tokens_per_s"] / r.world_size
                                         if r.metrics.get("tokens_per_s") else None)}
            for r in grid.runs]
    return heatmap_data(runs, keys, grid.axes, f"{grid.out.name}: throughput by layout")


def csv_heatmap(path: str | Path) -> dict:
    """The heatmap of a results.csv (a sweep folder without heatmap.json, e.g. an older one)."""
    path = Path(path)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        keys = cols[cols.index("status") + 1:cols.index("world_size")]
        rows = list(reader)
    runs = [{"name": r["name"], "status": r["status"],
             "settings": {k: _number(r[k]) for k in keys},
             "tokens_per_s_per_device": _number(r.get("tokens_per_s_per_device") or None)}
            for r in rows]
    return heatmap_data(runs, keys, title=f"{path.parent.name}: throughput by layout")


def read_heatmap(folder: str | Path) -> dict:
    """A sweep folder's heatmap: its heatmap.json, else built from its results.csv."""
    folder = Path(folder)
    if (folder / "heatmap.json").is_file():
        return json.loads((folder / "heatmap.json").read_text())
    return csv_heatmap(folder / "results.csv")


def write_heatmap(grid: Grid) -> tuple[Path, Path | None]:
    """heatmap.json (the data) and heatmap.png (the picture, where matplotlib is installed)."""
    data = grid_heatmap(grid)
    grid.out.mkdir(parents=True, exist_ok=True)
    json_path = grid.out / "heatmap.json"
    json_path.write_text(json.dumps(data, indent=1))
    try:
        png = draw_heatmap(data, grid.out / "heatmap.png")
    except ImportError:
        print("note: the heatmap picture needs matplotlib (pip install matplotlib); its data is in "
              f"{json_path}.", file=sys.stderr)
        png = None
    return json_path, png


def row_label(data: dict, values: list) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(data["y"], values)) or "all"


def draw_heatmap(data: dict, path: str | Path) -> Path:
    """Throughput per device by layout, like the playbook's heatmaps: a failed run's cell says how
    it failed (OOM, FAILED, TIMEOUT, PENDING); a position no run had is grey and says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    xs, ys = data["xs"], data["ys"]
    value = np.full((len(ys), len(xs)), np.nan)
    fig, ax = plt.subplots(figsize=(1.3 * len(xs) + 4.5, 0.45 * len(ys) + 1.8))
    ax.set_facecolor("#e6e6e6")  # where no run of the sweep is
    for c in data["cells"]:
        if c["tokens_per_s_per_device"] is not None:
            value[c["row"], c["col"]] = c["tokens_per_s_per_device"]
    im = ax.imshow(value, cmap="viridis", aspect="auto")
    filled = {(c["row"], c["col"]): c for c in data["cells"]}
    for i in range(len(ys)):
        for j in range(len(xs)):
            c = filled.get((i, j))
            if c is None:
                text, color = "not in sweep", "#888888"
            elif c["status"] == "ok":  # dark text on the light end of the scale
                light = im.norm(c["tokens_per_s_per_device"]) > 0.6
                text, color = f"{c['tokens_per_s_per_device']:,.0f}", "k" if light else "w"
            else:
                text, color = c["status"].upper(), "#c0392b"
            ax.text(j, i, text, ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [row_label(data, v) for v in ys], fontsize=8)
    ax.set_xlabel(data["x"] or "")
    ax.set_ylabel(", ".join(k.split(".")[-1] for k in data["y"]))
    fig.colorbar(im, ax=ax, label=data["unit"])
    ax.set_title(data["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _text(v) -> str:
    return json.dumps(v)


def _number(text):
    """A CSV cell back to the number it was written from (or the text)."""
    if text is None or text == "":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def _sorted_values(values) -> list:
    """Distinct values, numbers in numeric order (1, 2, 16, not 1, 16, 2)."""
    def key(v):
        items = v if isinstance(v, tuple) else (v,)
        return tuple((0, x, "") if isinstance(x, (int, float)) and not isinstance(x, bool)
                     else (1, 0, str(x)) for x in items)
    return sorted(set(values), key=key)
