"""Per-step metrics: one JSON line per logged step, plus MFU.

MFU = achieved model FLOP/s / peak dense FLOP/s of the devices used, with the model's training
FLOPs per token taken as 6N + 12 L h s (N parameters doing matmuls on each token: of a mixture
of experts only the active ones, router, shared and top-k experts; L layers, h hidden size,
s sequence length; the second term is attention scores and their weighted sum, forward and
backward). The peak is null (and so is MFU) on devices whose rate we do not know, such as CPUs.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from ultrascale.devices import device_peak_flops

def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak for `dtype` (devices.py holds the table), None on CPUs."""
    if device.type != "cuda":
        return None
    return device_peak_flops(torch.cuda.get_device_name(device), dtype)


# In the run folder: the Weights & Biases run's id, so that a resumed run (the same folder) goes on
# logging to the same W&B run.
WANDB_ID = "wandb_id"


@dataclass
class WandbRun:
    """What `wandb.init` needs: the run folder (its name is the W&B run's, its wandb/ holds the
    local files), the project, and the resolved config."""

    run_dir: Path
    project: str
    config: dict


def open_wandb(spec: WandbRun):
    """`wandb.init` for this run folder: a fresh id the first time, the folder's recorded one on a
    resume (`resume="allow"`). WANDB_MODE and the other WANDB_* variables act as wandb says."""
    import wandb  # needs the wandb package (preflight checks it)

    spec.run_dir.mkdir(parents=True, exist_ok=True)
    id_file = spec.run_dir / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
    id_file.write_text(run_id + "\n")
    try:
        return wandb.init(project=spec.project, name=spec.run_dir.name, dir=str(spec.run_dir),
                          id=run_id, resume="allow", config=spec.config)
    except Exception as exc:  # noqa: BLE001  (wandb's errors: login, network, its service)
        raise RuntimeError(f"logging.wandb: wandb.init failed ({type(exc).__name__}: {exc}). "
                           "Log in (wandb login), or set WANDB_MODE=offline on a machine without "
                           "network and `wandb sync` the run folder's wandb/ later.") from exc


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}


class MetricsWriter:
    """The metrics file, and TensorBoard and Weights & Biases where asked for (rank 0 only)."""

    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None,
                 wandb: WandbRun | None = None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self.tb = SummaryWriter(str(tensorboard_dir))
        self.wandb = open_wandb(wandb) if wandb is not None else None

    def write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in _scalars(record).items():
                self.tb.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            # W&B keeps a run's steps increasing: after a resume, the steps redone between the
            # checkpoint and the crash are dropped there (the metrics file replaces them).
            self.wandb.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
