"""A sweep's grid: the GRID.yaml file read and checked, and the runs it expands to (one `Run` per
layout, each with its `Attempt`s). The format is in `ultrascale sweep --help` (planner/sweep.py)."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ultrascale.config import ConfigError, build_config, layout_keys
from ultrascale.layout import LAYOUT_ALIASES, parse_layout


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
    # Every key the sweep varies, as this run's resolved config has it (a `layouts:` entry that
    # does not name tp still runs some tp): what the table and the heatmap place the run by.
    settings: dict = field(default_factory=dict)
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
    # Only the keys the layout string names (and what they imply); the rest stays as in base.
    # Each layout name (or its short alias, e.g. acc) -> its config key, from the declarations.
    wanted = {k.layout: k.name for k in layout_keys()}
    wanted.update({alias: wanted[name] for alias, name in LAYOUT_ALIASES.items()})
    flat = {k.name: getattr(lay, k.layout) for k in layout_keys()}
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
    runs, configs = [], []
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
        configs.append(cfg)
    if not runs:
        raise ValueError(f"no run of {path.name} reaches global_batch_size="
                         f"{spec.get('global_batch_size')}; widen the grid or change it.")
    # In the order the grid and the layouts name them (stable across processes, unlike a set).
    keys = list(dict.fromkeys(k for r in runs for k in r.values))
    for run, cfg in zip(runs, configs):
        run.settings = {k: _config_value(cfg, k, run.values) for k in keys}
    mode = spec.get("mode", "local")
    if mode not in ("local", "slurm"):
        raise ValueError(f"mode={mode!r} in {path.name}: choose local or slurm.")
    repeats = spec.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} in {path.name}: give a whole number of runs per "
                         "layout, at least 1.")
    axes = _heatmap_axes(spec, grid, keys, path.name)
    return Grid(base=base, base_path=base_path, fixed=fixed, runs=runs,
                out=Path(spec.get("out") or Path("sweeps") / path.stem), mode=mode,
                timeout_s=float(spec.get("timeout_s", 900)), predict=spec.get("predict"),
                axes=axes, slurm=dict(spec.get("slurm") or {}), repeats=repeats)


def _heatmap_axes(spec: dict, grid: dict, keys: list[str], name: str) -> tuple | None:
    """The heatmap's (x, y) keys: the grid file's `heatmap`, else its first two grid keys."""
    heat = spec.get("heatmap") or {}
    if heat.get("x") and heat.get("y"):
        axes = (heat["x"], heat["y"])
        missing = [k for k in axes if k not in keys]
        if missing:
            raise ValueError(f"heatmap axes {missing} in {name} are not keys the sweep varies; "
                             f"choose among {keys}.")
        return axes
    if len(grid) >= 2:  # (a `layouts:` list alone: the report picks the densest picture)
        return (list(grid)[0], list(grid)[1])
    return None


def _config_value(cfg, key: str, values: dict):
    """The value of `section.key` in a resolved config (the run's own value when it set one)."""
    if key in values:
        return values[key]
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section, None), name, None)


def _yaml_value(v) -> str:
    return json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)
