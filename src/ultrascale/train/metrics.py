"""Per-step metrics: one JSON line per logged step, plus MFU.

MFU = achieved model FLOP/s / peak dense FLOP/s of the devices used, with the model's training
FLOPs per token taken as 6N + 12 L h s (N parameters doing matmuls on each token: of a mixture
of experts only the active ones, router, shared and top-k experts; L layers, h hidden size,
s sequence length; the second term is attention scores and their weighted sum, forward and
backward). The peak is null (and so is MFU) on devices whose rate we do not know, such as CPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ultrascale.devices import device_peak_flops

def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak for `dtype` (devices.py holds the table), None on CPUs."""
    if device.type != "cuda":
        return None
    return device_peak_flops(torch.cuda.get_device_name(device), dtype)


class MetricsWriter:
    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self.tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
