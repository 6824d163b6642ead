"""A run folder holds one run: its metrics are monotonic in step and its checkpoints one line of
training. A folder used again either continues that run or is refused before anything is written.

- A fresh start (checkpoint.resume=none) into a folder that holds metrics or checkpoints is
  refused, with the fixes: continue it (checkpoint.resume=auto), another logging.run_dir, or
  delete the folder.
- A resume continues the run whose newest checkpoint it takes: checkpoints newer than it (another
  branch of the run; `resume=auto` would pick them up later, and retention would keep them over the
  new ones) are refused, as is resuming another folder's checkpoint into a folder that holds a run.
- Continuing, the metric lines past the resumed step (steps that will be trained again: after a
  crash, the steps between the last checkpoint and the crash) are dropped, so the redone steps
  replace them instead of being appended. `resume=auto` before any checkpoint restarts the run at
  step 0 the same way.

Torch-free: the launcher checks before any process starts, each rank again (under torchrun or
srun there is no launcher of ours), and rank 0 trims the metrics before its first step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ultrascale.checkpoint.index import META, PREFIX
from ultrascale.config import Config, ConfigError


def logged_steps(path: Path) -> list[int]:
    """The steps of a metrics file's lines (a line cut short by a crash is skipped)."""
    steps = []
    try:
        with path.open() as f:
            for line in f:
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int):
                    steps.append(step)
    except FileNotFoundError:
        pass
    return steps


def checkpoints(folder: str | None) -> list[Path]:
    """The complete checkpoints of a checkpoint folder, oldest first."""
    root = Path(folder) if folder else None
    if root is None or not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{PREFIX}*") if (p / META).is_file())


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name[len(PREFIX):])


def _fixes(cfg: Config) -> str:
    run_dir = cfg.logging.run_dir
    return (f"Continue that run with --set checkpoint.resume=auto (same logging.run_dir), give "
            f"this one another folder (--set logging.run_dir=..., or leave it unset for a fresh "
            f"runs/<time>), or delete {run_dir}.")


def check(cfg: Config, resumed: Path | None, resumed_step: int = 0,
          damaged: tuple[Path, ...] = ()) -> None:
    """Refuse (ConfigError) a run that would mix itself with another in its folder. `resumed`:
    the checkpoint this run starts from (None: a fresh start); `damaged`: newer ones resume=auto
    passed over (the ranks set them aside: checkpoint/agree.py)."""
    metrics = Path(cfg.logging.metrics_file) if cfg.logging.metrics_file else None
    steps = logged_steps(metrics) if metrics is not None else []
    saved = [p for p in checkpoints(cfg.checkpoint.dir) if p not in damaged]
    if not steps and not saved:
        return
    held = []
    if steps:
        held.append(f"metrics of steps {min(steps)}..{max(steps)} in {metrics}")
    if saved:
        held.append(f"checkpoint(s) {', '.join(p.name for p in saved[-3:])} in "
                    f"{cfg.checkpoint.dir}")
    what = "; ".join(held)
    if resumed is None:
        if cfg.checkpoint.resume == "auto" and not saved:
            return  # the same run, started again before its first checkpoint
        raise ConfigError(f"logging.run_dir={cfg.logging.run_dir} already holds a run ({what}): "
                          f"a fresh start there would mix the two. {_fixes(cfg)}")
    own = any(Path(resumed).resolve() == p.resolve() for p in saved)
    if not own:
        raise ConfigError(
            f"checkpoint.resume={cfg.checkpoint.resume} continues another run's checkpoint, but "
            f"logging.run_dir={cfg.logging.run_dir} already holds a run ({what}). Resume it into "
            "a fresh folder (--set logging.run_dir=... unused, or unset), or delete "
            f"{cfg.logging.run_dir}.")
    newer = [p.name for p in saved if _step(p) > resumed_step]
    if newer:
        raise ConfigError(
            f"checkpoint.resume={cfg.checkpoint.resume} goes back to step {resumed_step}, but "
            f"{cfg.checkpoint.dir} holds later checkpoints of the run ({', '.join(newer)}): "
            "training on from the earlier one there would mix two branches (and "
            "checkpoint.resume=auto would later pick the old branch). Resume the newest "
            "(checkpoint.resume=auto), or resume the earlier one into another folder (--set "
            "logging.run_dir=... and checkpoint.dir unset).")


def trim_metrics(cfg: Config, resumed_step: int) -> int:
    """Drop the metric lines past `resumed_step` (they are trained again); returns how many went.
    The file is replaced whole (a reader never sees half of it)."""
    if not cfg.logging.metrics_file:
        return 0
    path = Path(cfg.logging.metrics_file)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        if isinstance(step, int) and step > resumed_step:
            dropped += 1
        elif step is not None:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            dropped += 1  # a line cut short by the crash
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped
