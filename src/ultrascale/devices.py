"""Dense peak rates of the GPUs we know (FLOP/s per compute dtype, datasheets, no sparsity).

One table for the two readers of a peak: the training metrics (MFU of a run, from the name the
driver reports) and the planner's hardware profiles (planner/hardware.py builds its H100, H200,
A100 and B200 on these). Plain data: no torch, no planner import. fp32 on tensor-core GPUs means
TF32 matmuls.
"""

from __future__ import annotations

TFLOPS = 1e12

_H100 = {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
         "fp32": 494.7 * TFLOPS}

# Name fragments as drivers report them ("NVIDIA H100 80GB HBM3"), matched in this order.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100": _H100,
    "h200": dict(_H100),  # the H100's compute with more and faster memory
    "a100": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "fp32": 156 * TFLOPS},
    "b200": {"bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS,
             "fp32": 1125 * TFLOPS},
    # GPUs without a full planner profile: the training metrics' MFU needs only the peak.
    "l40s": {"bf16": 362 * TFLOPS, "fp16": 362 * TFLOPS, "fp8": 733 * TFLOPS, "fp32": 183 * TFLOPS},
    "a10g": {"bf16": 125 * TFLOPS, "fp16": 125 * TFLOPS, "fp32": 62.5 * TFLOPS},
    "l4": {"bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS, "fp8": 242 * TFLOPS, "fp32": 60 * TFLOPS},
}


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a GPU from the name its driver reports (e.g. "NVIDIA H100 80GB HBM3"),
    or None when it is not known (CPUs, unlisted GPUs: the metrics then report no MFU)."""
    name = device_name.lower()
    for key, rates in PEAK_FLOPS.items():
        if key in name:
            return rates.get(dtype)
    return None
