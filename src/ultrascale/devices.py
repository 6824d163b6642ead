"""What this machine and its devices are: the peak rates of the GPUs we know, whether CUDA is
here, the cores and the RAM a run may take, and what `precision.dtype: auto` means here.

The peak rates (FLOP/s per compute dtype, datasheets, no sparsity) are one table for the two
readers of a peak: the training metrics (MFU of a run, from the name the driver reports) and the
planner's hardware profiles (planner/hardware.py builds its H100, H200, A100 and B200 on these).
fp32 on tensor-core GPUs means TF32 matmuls. Torch is imported only where a GPU driver is present
(to ask it about the GPUs); the planner, the estimator and the launcher's checks read the rest
without it.
"""

from __future__ import annotations

import os
from pathlib import Path

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


# ------------------------------------------------------------------------------------------------
# This machine: its GPUs, cores and memory

GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's (ROCm) device nodes


def gpu_driver_present() -> bool:
    """Whether a GPU driver is installed here (checked without importing torch)."""
    return any(Path(p).exists() for p in GPU_DRIVER_FILES)


def uses_cuda(device: str) -> bool:
    """Whether ranks run with `device` (the config's: auto, cpu, cuda) run on CUDA: asked of torch
    only when a GPU driver is present."""
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    if not gpu_driver_present() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        return False  # no driver: no need to pay for importing torch
    import torch
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_ram() -> int:
    """Bytes a new process can still take: the kernel's MemAvailable, or less under a cgroup
    (container, Slurm job) limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


# ------------------------------------------------------------------------------------------------
# `precision.dtype: auto`, resolved once, when the config is validated (config.py)

# CPU flags (as /proc/cpuinfo spells them) of the instructions that make bf16 matmuls fast:
# AVX-512 BF16 dot products, or AMX tiles with bf16 (Intel Cooper Lake, Sapphire Rapids, AMD Zen 4).
FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of this machine's CPU (empty where /proc/cpuinfo is not there)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_computes_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU has bf16 matmul instructions (then bf16 is several times faster than fp32
    here, and `auto` picks it)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in FAST_BF16_CPU_FLAGS)


def resolve_dtype(dtype: str, cuda: bool, flags: set[str] | None = None) -> str:
    """The one concrete compute dtype a run uses: `dtype` itself unless it is "auto", which is
    bf16 on CUDA and on CPUs with bf16 matmul instructions (FAST_BF16_CPU_FLAGS), fp32 on other
    CPUs. The config's validation asks this, once: downstream every dtype is concrete."""
    if dtype != "auto":
        return dtype
    return "bf16" if cuda or cpu_computes_bf16(flags) else "fp32"
