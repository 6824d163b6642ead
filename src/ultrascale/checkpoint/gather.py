"""The whole model's weights from a checkpoint of any layout (for export and generate).

Checkpoints are layout-free (docs/checkpoints.md): every tensor of the plain model is stored as
pieces with their offsets, whatever layout wrote them. So nothing has to be started: each weight
is read back whole, one at a time, from the pieces that tile it. The values are the fp32 masters
the run held.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ultrascale.checkpoint.index import CheckpointError, load_meta
from ultrascale.checkpoint.store import CheckpointReader
from ultrascale.config import Config


def checkpoint_config(path: str | Path) -> Config:
    """The configuration a checkpoint was written with, set to run on this machine's CPUs."""
    path = Path(path)
    try:
        meta = load_meta(path)
    except CheckpointError as exc:
        raise FileNotFoundError(str(exc)) from None
    data = dict(meta["config"])
    data["device"] = "cpu"
    data["precision"] = {**data.get("precision", {}), "dtype": "fp32"}
    data["training"] = {**data["training"], "compile": False, "kernels": "torch"}
    data["checkpoint"] = {**data["checkpoint"], "resume": "none"}
    return Config.model_validate(data)


def plain_state(checkpoint: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(the checkpoint's config, its plain-model weights by name), whatever its layout."""
    path = Path(checkpoint)
    cfg = checkpoint_config(path)
    meta = load_meta(path)
    with CheckpointReader(path, meta) as reader:
        state = {name: reader.tensor(name) for name in meta["tensors"]}
    return cfg, state
