"""Fused Triton kernels for GPUs, one small module each, with the same semantics as the pure-PyTorch
references in `models/ops.py` (the model reaches them through the adapters of
`parallel/kernels.py`, which swaps them into its kernel children):

- `rms_norm`: RMSNorm forward and backward (statistics in fp32, one pass over a row each way);
- `swiglu`: silu(gate) * up and its backward, saving only the two inputs;
- `rotary`: rotary embedding ("rotate half") of q or k and its backward (the inverse rotation);
- `cross_entropy`: the two row passes of a chunk of logits (max and sum of exponentials; then the
  softmax gradient written over the logits in place) under the chunked linear + cross-entropy of
  `ops.linear_cross_entropy`, which never holds the full logits.

Triton compiles for CUDA devices. On a CPU the kernels run only under Triton's interpreter
(`TRITON_INTERPRET=1`, fp32: the interpreter mishandles bf16), which is how the tests check them
against the references. Which implementation a run uses is chosen once, by `training.kernels`, when
`parallelize` swaps the model's parameterless kernel children (`parallel/kernels.py`).

This package imports nothing of ultrascale (the model imports it, not the other way round) and
imports triton only in the kernel modules, so that a machine without triton can import it.
"""

from __future__ import annotations

import importlib.util
import os


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter is on (it reads this variable when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device_type: str) -> tuple[bool, str]:
    """(usable, why not) for Triton kernels on a device of this type."""
    if not triton_installed():
        return False, "triton is not installed (pip install triton)"
    if device_type != "cuda" and not interpreting():
        return False, (f"Triton kernels run on CUDA devices, not on {device_type} (on a CPU only "
                       "under TRITON_INTERPRET=1, for tests)")
    return True, ""


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
