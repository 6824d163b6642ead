"""Run folders for the dashboard: where they are, and their metric lines as chart series.

A run is a folder with `metrics.jsonl` (one JSON line per logged step, written by the trainer); a
sweep is a folder with `results.csv`. Both the browser (through /api/run) and `ultrascale plot` draw
the series that `series` makes, so the two pictures say the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Folders that never hold a run's metrics and can be large.
_SKIP = {".git", ".venv", "venv", "node_modules", "__pycache__", "checkpoints", "rank_logs", "slurm"}


def default_roots() -> list[Path]:
    return [Path("runs"), Path("sweeps")]


def discover(roots: list[Path], max_depth: int = 4) -> list[dict]:
    """Runs and sweeps under the roots, newest first: {"path", "label" (from the root's name on),
    "kind", "mtime"}."""
    found = []
    for root in roots:
        root = root.resolve()
        if not root.is_dir():
            continue
        for folder, dirs, files in os.walk(root):
            depth = len(Path(folder).relative_to(root).parts)
            dirs[:] = [d for d in dirs if d not in _SKIP and depth < max_depth]
            for name, kind in (("metrics.jsonl", "run"), ("results.csv", "sweep")):
                if name in files:
                    path = Path(folder)
                    found.append({"path": str(path), "label": str(path.relative_to(root.parent)),
                                  "kind": kind,
                                  "mtime": (path / name).stat().st_mtime})
    return sorted(found, key=lambda r: -r["mtime"])


def inside(path: str | Path, roots: list[Path]) -> Path:
    """The folder, resolved, if it lies under one of the roots; the server reads nothing else."""
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(r.resolve()) for r in roots):
        raise ValueError(f"{path!s} is not under the folders this server shows "
                         f"({', '.join(str(r) for r in roots)}); start `ultrascale ui --runs-dir "
                         "DIR` to add one.")
    return resolved


def read_records(path: Path, after: int = 0) -> tuple[list[dict], int]:
    """The metric lines from line `after` on, and the line to read from next time. A last line
    that does not parse yet is being written: it is read on the next poll."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a run writes its metrics.jsonl from its "
                                "first logged step.")
    lines = path.read_text().splitlines()
    records, line = [], after
    for line in range(after, len(lines)):
        text = lines[line].strip()
        if not text:
            continue
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            if line == len(lines) - 1:
                return records, line
            continue  # (a line damaged by a crash: skipped, not fatal)
    return records, len(lines)


# chart name -> title, unit of its values
CHARTS = {"loss": ("loss (training, validation)", ""), "lr": ("learning rate", ""),
          "grad_norm": ("gradient norm", ""),
          "throughput": ("tokens/s (all devices)", ""), "mfu": ("MFU", "fraction"),
          "memory": ("memory per rank (counted)", "bytes"),
          "comm": ("communication per step", "bytes")}


def series(records: list[dict]) -> dict[str, dict[str, list[list[float]]]]:
    """chart -> line -> [[step, value], ...] from metric records; nulls (MFU where the device's
    peak is unknown, a memory figure the device has not) are left out."""
    out: dict[str, dict[str, list]] = {name: {} for name in CHARTS}

    def add(chart, line, step, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[chart].setdefault(line, []).append([step, value])

    for r in records:
        step = r.get("step")
        if step is None:
            continue
        add("loss", "loss", step, r.get("loss"))
        add("loss", "eval loss", step, r.get("eval_loss"))
        add("lr", "lr", step, r.get("lr"))
        add("grad_norm", "grad norm", step, r.get("grad_norm"))
        add("throughput", "tokens/s", step, r.get("tokens_per_s"))
        add("mfu", "MFU", step, r.get("mfu"))
        for key, value in (r.get("memory") or {}).items():
            add("memory", key.removesuffix("_bytes").replace("_", " "), step, value)
        for kind, c in (r.get("comm") or {}).items():
            add("comm", kind, step, c.get("bytes") if isinstance(c, dict) else c)
    return out


def overlay(runs: dict[str, dict]) -> dict[str, dict[str, list[list[float]]]]:
    """Several runs' series (label -> `series(...)`) in one set of charts: each line named
    `label: line` (a parity check, Muon against AdamW: the same chart, two runs)."""
    out: dict[str, dict[str, list]] = {name: {} for name in CHARTS}
    for label, data in runs.items():
        for chart, lines in data.items():
            for line, points in lines.items():
                out[chart][f"{label}: {line}"] = points
    return out


def labels(paths: list[Path]) -> list[str]:
    """Short names that tell runs apart: their folder names, or more of their paths where those
    are the same."""
    for depth in range(1, 6):
        names = ["/".join(Path(p).resolve().parts[-depth:]) for p in paths]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
