"""What resuming a checkpoint will do, decided from meta.json before any tensor file is read.

`plan_resume(cfg)` finds the checkpoint (`checkpoint.resume`: none, auto or a folder), checks it
(every file there at its size, every tensor tiled by its pieces, the model's shapes, the
optimizer), and says in one line what differs from the run that saved it and how the learning-rate
schedule continues. The launcher prints that line before any process starts; the ranks make the
same plan and then read only the pieces they need.

Any layout resumes any other (the state is stored layout-free, index.py); settings that change no
saved state (recompute, bucket size, overlap, logging, ...) are listed and accepted. Refused: a
model whose tensors do not match the checkpoint's (named), another optimizer. Torch-free unless the
model's settings changed (then the model's shapes are built on the meta device to compare).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ultrascale.checkpoint.index import (CheckpointDamage, CheckpointError, coverage_problems,
                                         find_latest, load_meta)
from ultrascale.config import Config, ConfigError
from ultrascale.layout import Layout
from ultrascale.train.schedule import LRSchedule

# Keys that name this run's own files: they always differ and mean nothing for the state.
RUN_PATHS = ("checkpoint.resume", "checkpoint.dir", "logging.run_dir", "logging.metrics_file")


@dataclass
class ResumePlan:
    path: Path
    meta: dict
    step: int
    consumed_samples: int
    schedule: LRSchedule  # the schedule the resumed run follows
    line: str  # what differs and how the schedule continues, one line
    verified: bool = False  # every file's SHA-256 already checked (checkpoint/agree.py)
    # Newer checkpoints `auto` passed over as damaged: (folder, why).
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def resume_path(cfg: Config, skip: tuple[Path, ...] = ()) -> Path | None:
    """The checkpoint to resume; under auto the newest in checkpoint.dir but those in `skip`."""
    spec = cfg.checkpoint.resume
    if spec == "none":
        return None
    if spec == "auto":
        return find_latest(Path(cfg.checkpoint.dir), skip) if cfg.checkpoint.dir else None
    return Path(spec)


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, value now) of every setting that differs, run paths left out."""
    a, b = flatten(saved), flatten(now)
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b])
            if k not in RUN_PATHS and a.get(k) != b.get(k)]


def _show(value) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_shapes(model_cfg) -> dict[str, list[int]]:
    """Every parameter of the plain model and its shape (built on the meta device: no memory)."""
    import torch

    from ultrascale.models.llama import Llama

    with torch.device("meta"):
        return {n: list(t.shape) for n, t in Llama(model_cfg).state_dict().items()}


def shape_problems(saved: dict[str, list[int]], now: dict[str, list[int]]) -> list[str]:
    problems = [f"{n} is {saved[n]} in the checkpoint but {now[n]} in this model"
                for n in now if n in saved and saved[n] != now[n]]
    problems += [f"{n} is not in the checkpoint" for n in now if n not in saved]
    problems += [f"{n} is in the checkpoint but not in this model" for n in saved if n not in now]
    return problems


def intact_meta(path: Path) -> dict:
    """meta.json of `path`, its files there at their sizes and every tensor's pieces complete;
    CheckpointDamage otherwise."""
    meta = load_meta(path)
    problems = coverage_problems(meta)
    if problems:
        raise CheckpointDamage(f"{len(problems)} tensor(s) incomplete: {'; '.join(problems[:3])}. "
                               "Resume an earlier checkpoint.")
    return meta


def check_meta(meta: dict, cfg: Config) -> None:
    """Raise CheckpointError when the checkpoint cannot continue this run."""
    saved = meta["config"]
    if saved["model"] != cfg.model.model_dump(mode="json"):
        shapes = {n: e["shape"] for n, e in meta["tensors"].items()}
        problems = shape_problems(shapes, model_shapes(cfg.model))
        if problems:
            changed = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in
                                differences({"model": saved["model"]},
                                            {"model": cfg.model.model_dump(mode="json")}))
            raise CheckpointError(f"it does not fit this model ({changed}): "
                                  f"{'; '.join(problems[:3])}. Resume with the model settings "
                                  "that saved it.")
    was, now = saved["training"]["optimizer"], cfg.training.optimizer
    if was != now:
        raise CheckpointError(f"it holds {was} optimizer state but training.optimizer={now}. "
                              f"Resume with training.optimizer={was}.")


def _intact_checkpoint(cfg: Config, skipped: list) -> tuple[Path, dict] | None:
    """The checkpoint to resume and its meta.json; under auto a damaged one is added to `skipped`
    (path, why) and the next older one taken (none left: an error naming the newest's damage)."""
    while (path := resume_path(cfg, tuple(p for p, _ in skipped))) is not None:
        try:
            return path, intact_meta(path)
        except CheckpointDamage as exc:
            if cfg.checkpoint.resume != "auto":
                raise
            skipped.append((path, str(exc)))
    if skipped:
        raise CheckpointDamage(f"no checkpoint in {cfg.checkpoint.dir} is intact; the newest: "
                               f"{skipped[0][1]}")
    return None


def plan_resume(cfg: Config, skip: tuple[tuple[Path, str], ...] = ()) -> ResumePlan | None:
    """The plan, or None for a fresh start (resume=none, or auto with no checkpoint yet). Under
    auto a damaged checkpoint is passed over for an older one, as are those of `skip` ((folder,
    why): agree.py's), all listed in ResumePlan.skipped. Raises ConfigError naming
    checkpoint.resume and the offending file or tensor."""
    skipped = list(skip)
    try:
        found = _intact_checkpoint(cfg, skipped)
        if found is None:
            return None
        path, meta = found
        check_meta(meta, cfg)
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {exc}") from None
    step, consumed = meta["step"], meta["consumed_samples"]
    saved_schedule = LRSchedule(**meta["lr_schedule"])
    schedule, how = saved_schedule.continue_from(step, cfg.training)
    try:
        was = f" as {Layout(**meta['layout']).short()}"
    except TypeError:  # a layout of another version
        was = ""
    changed = differences(meta["config"], cfg.model_dump(mode="json"))
    line = (f"resume: {path} (step {step}, {consumed} samples; saved on {meta['world_size']} "
            f"rank(s){was}); "
            + ("differs: " + ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changed)
               if changed else "same settings")
            + (f"; lr: {how}" if step < cfg.training.steps else
               f"; nothing to train: step {step} >= training.steps={cfg.training.steps}"))
    if skipped:
        line += "; passed over, damaged: " + "; ".join(f"{p.name} ({why})" for p, why in skipped)
    return ResumePlan(path, meta, step, consumed, schedule, line, skipped=skipped)
