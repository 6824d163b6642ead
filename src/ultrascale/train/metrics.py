"""Per-step metrics: one JSON line per logged step, plus MFU.

MFU = achieved model FLOP/s / peak dense FLOP/s of the devices used, with the model's training
FLOPs per token taken as 6N + 12 L h s (N parameters doing matmuls, L layers, h hidden size,
s sequence length; the second term is attention scores and their weighted sum, forward and
backward). The peak is null (and so is MFU) on devices whose rate we do not know, such as CPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Dense peak rates per device in FLOP/s, by compute dtype (no sparsity). fp32 on tensor-core GPUs
# means TF32 matmuls.
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 494e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 494e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "fp32": 1100e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp8": 733e12, "fp32": 183e12},
    "A10G": {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp8": 242e12, "fp32": 60e12},
}


def peak_flops(device: torch.device, dtype: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, rates in PEAK_FLOPS.items():
        if key in name:
            return rates.get(dtype)
    return None


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
