"""MFU's peak rates: one table (devices.py) for the planner and the training metrics."""

import torch

from ultrascale.devices import device_peak_flops
from ultrascale.planner.hardware import PROFILES
from ultrascale.train.metrics import peak_flops


def test_gpu_names_map_to_the_planner_profiles():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == PROFILES["h100"].peak("bf16")
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert device_peak_flops("NVIDIA H200", "bf16") == PROFILES["h200"].peak("bf16")
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert device_peak_flops("NVIDIA L4", "fp8") == 242e12  # a GPU with a peak but no profile


def test_unknown_devices_have_no_peak_and_so_no_mfu():
    assert device_peak_flops("Tesla T4", "bf16") is None
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on an A100
    assert peak_flops(torch.device("cpu"), "fp32") is None
