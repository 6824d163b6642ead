"""The two row passes of the chunked linear + cross-entropy in Triton (`ops.linear_cross_entropy`
drives them over chunks of tokens, with the vocabulary-parallel reduction between them):

- `row_stats(logits)`: per row, the max and the sum of exp(logit - max), in one online pass over
  the vocabulary;
- `softmax_grad_(logits, lse, targets)`: overwrites the logits with exp(logit - lse) - onehot,
  the gradient of the summed cross-entropy, where `targets` holds each row's target column, or -1
  when the target is not among these columns (another rank's vocabulary slice).

Logits are fp32 [rows, cols] with unit column stride (a row may be a prefix of a wider buffer:
`row_stride` steps between rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultrascale.kernels import next_power_of_2


@triton.jit
def _row_stats(l_ptr, max_ptr, sum_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * row_stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)


@triton.jit
def _softmax_grad(l_ptr, lse_ptr, t_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = l_ptr + row * row_stride
    lse = tl.load(lse_ptr + row)
    target = tl.load(t_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0)
        g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(base + cols, g, mask=mask)


def _block(cols: int) -> int:
    return min(4096, next_power_of_2(max(cols, 1)))


def _check(logits: torch.Tensor) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("cross_entropy kernels take fp32 [rows, cols] logits with unit column "
                         f"stride, got {logits.dtype} {tuple(logits.shape)} {logits.stride()}")


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits)
    rows, cols = logits.shape
    mx = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sm = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _row_stats[(rows,)](logits, mx, sm, cols, logits.stride(0), BLOCK=_block(cols))
    return mx, sm


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    _check(logits)
    rows, cols = logits.shape
    if rows:
        _softmax_grad[(rows,)](logits, lse.contiguous(), targets.contiguous(), cols,
                               logits.stride(0), BLOCK=_block(cols))
    return logits
