"""Rotary embedding in Triton, "rotate half" convention (Llama's, as `ops.rotary`):

    out[:half] = x[:half] * cos - x[half:] * sin
    out[half:] = x[half:] * cos + x[:half] * sin

x is [batch, seq, heads, head_dim]; cos and sin are [seq, head_dim] tables whose two halves are
equal (`ops.rotary_tables`), or [batch, seq, head_dim] where positions restart at each packed
document (one table row per token: the kernel then counts rows over batch x seq). The backward is
the inverse rotation (the angle negated), so nothing but the tables is saved. One program rotates
one (batch, position, head) row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultrascale.kernels import next_power_of_2


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, y_ptr, seq, heads, half, sign,
            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = (row // heads) % seq
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    base = row * 2 * half
    x1 = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * 2 * half + cols, mask=mask, other=0.0).to(tl.float32) * sign
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + base + cols, (x1 * c - x2 * s).to(out_ty), mask=mask)
    tl.store(y_ptr + base + half + cols, (x2 * c + x1 * s).to(out_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    b, s, h, d = x.shape
    if d % 2:
        raise ValueError(f"rotary: head_dim {d} must be even")
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = s if cos.dim() == 2 else b * s  # a table row per position, or per token
    if x.numel():
        _rotate[(b * s * h,)](x, cos.contiguous(), sin.contiguous(), y, rows, h, d // 2, sign,
                              BLOCK=next_power_of_2(d // 2))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, -1.0), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, head_dim] rotated by the tables cos, sin [s, head_dim] (or
    [b, s, head_dim])."""
    return _Rotary.apply(x, cos, sin)
