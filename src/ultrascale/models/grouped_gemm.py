"""The routed experts' grouped GEMM: one matmul per expert over its contiguous rows, for
`models/moe.py`'s `GroupedExperts`, its one consumer (through `GroupedMatmul`, its seam).

The grouped kernel is PyTorch's `F.grouped_mm`; the reference loop multiplies each expert's rows
through `ops.linear`, the primitive (models/ops.py stays the only caller of `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.models.ops import linear


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
               impl: str = "grouped") -> torch.Tensor:
    """Rows of x [N, in] grouped by expert (the first counts[0] rows for expert 0, and so on)
    times their expert's weight [E, out, in] (E stacked linear weights), transposed: [N, out].

    impl "grouped" is one `F.grouped_mm` call (PyTorch's grouped GEMM, on CPU in fp32 and bf16);
    "loop" is one `linear` per expert, the reference. The grouped kernel wants rows of a multiple
    of 16 bytes (widths divisible by 4 in fp32, 8 in bf16) and, on CUDA, bf16: other shapes and
    dtypes take the loop, whose results are the same."""
    if impl == "loop" or not grouped_mm_applies(x, weight):
        return grouped_mm_loop(x, weight, counts)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # grouped_mm has no autocast rule: cast as linear is
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    offs = counts.cumsum(0).to(torch.int32)
    return _DenseGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


class GroupedMatmul(nn.Module):
    """Parameterless: the routed experts' grouped GEMM, `grouped_mm`. A precision recipe swaps
    it (FP8: parallel/precision.py's `Fp8GroupedMatmul`), as `Linear.matmul` is swapped."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                impl: str = "grouped") -> torch.Tensor:
        return grouped_mm(x, weight, counts, impl)


def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as a loop over the experts: the reference path."""
    parts = x.split(counts.tolist())
    return torch.cat([linear(part, w) for part, w in zip(parts, weight.unbind(0))])


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` takes these operands (see `grouped_mm`)."""
    dtype = torch.get_autocast_dtype(x.device.type) \
        if torch.is_autocast_enabled(x.device.type) else x.dtype
    size = torch.empty((), dtype=dtype).element_size()
    aligned = all(d * size % 16 == 0 for d in (weight.shape[1], weight.shape[2]))
    usable = dtype in (torch.float32, torch.bfloat16) if x.device.type == "cpu" \
        else dtype == torch.bfloat16
    return aligned and usable


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward refuses
    expanded (stride-0) ones, which a plain `.sum()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
