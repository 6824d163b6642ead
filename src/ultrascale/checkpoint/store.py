"""Checkpoint layout and atomic writes.

    <dir>/step_00000010/
        meta.json                 step, samples consumed, world size, the config that wrote it
        rank_00000.safetensors    this rank's model and optimizer tensors (if it owns any) and RNG

Every rank writes into `<dir>/.step_00000010.tmp/`; after a barrier rank 0 writes meta.json last
and renames the folder, so a checkpoint folder without the dot prefix is always complete. Tensors
go through safetensors and metadata through JSON: nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ultrascale.distributed import comm

PREFIX = "step_"


@dataclass
class CheckpointMeta:
    step: int
    consumed_samples: int
    world_size: int
    layout: dict
    config: dict


def _step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_tensors() -> dict[str, torch.Tensor]:
    state = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng/cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])


def save_checkpoint(root: Path, meta: CheckpointMeta, tensors: dict[str, torch.Tensor],
                    rank: int, keep: int) -> Path:
    """Collective: every rank calls it with its own tensors. Returns the final folder."""
    root = Path(root)
    final = _step_dir(root, meta.step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier()
    payload = dict(tensors)
    payload.update(_rng_tensors())
    extra = {"python_rng": json.dumps(random.getstate()),
             "numpy_rng": json.dumps(np.random.get_state()[1].tolist())}
    save_file(payload, str(tmp / f"rank_{rank:05d}.safetensors"), metadata=extra)
    comm.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(asdict(meta), indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # same step saved again (e.g. a re-run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return final


def find_latest(root: Path) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "meta.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, rank: int, source_rank: int) -> tuple[CheckpointMeta,
                                                                      dict[str, torch.Tensor]]:
    """This rank's model/optimizer tensors (from `source_rank`'s file) and its own RNG state."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json); give a "
                                "step_XXXXXXXX folder written by ultrascale, or resume=auto.")
    meta = CheckpointMeta(**json.loads(meta_file.read_text()))
    tensors = load_file(str(path / f"rank_{source_rank:05d}.safetensors"))
    own = load_file(str(path / f"rank_{rank:05d}.safetensors"))
    _restore_rng(own)
    return meta, {k: v for k, v in tensors.items() if not k.startswith("rng/")}
