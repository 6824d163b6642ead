"""The SwiGLU of `ops.swiglu` as one autograd function: silu(gate) * up, times a per-row weight
when given (a mixture of experts' routing weights), keeping only its inputs for backward
(autograd's own composition would keep silu(gate) too, and with the weight fp32 copies of the
rows). `ops.swiglu` is the primitive the model calls and says how it rounds; this module is its
implementation, beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """`ops.swiglu` saving only its inputs. With p = silu * up and d = dy (weighted: dy * weight in
    fp32, rounded to dy's dtype, the gradient of p): d_up = d * silu, d_silu = d * up, d_gate =
    silu's backward of d_silu, d_weight = the row's sum of dy * p (fp32)."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        product = F.silu(gate) * up
        if weight is not None:  # in place: computed in fp32, stored in the product's dtype
            product.mul_(_per_row(weight, gate))
        return product

    @staticmethod
    def backward(ctx, dy):
        # In an order that holds at most three row-wide temporaries at once, as autograd's
        # backward of silu(gate) * up does (each `del` frees one before the next is made).
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        d, d_weight = dy, None
        if weight is not None:
            if ctx.needs_input_grad[2]:
                d_weight = _row_dots(dy, silu * up).to(weight.dtype)
            d = torch.mul(dy, _per_row(weight, gate), out=torch.empty_like(dy))
        d_up = d * silu if ctx.needs_input_grad[1] else None
        del silu
        d_gate = None
        if ctx.needs_input_grad[0]:
            d_silu = d.mul_(up) if d is not dy else d * up  # our own d: in place
            d_gate = torch.ops.aten.silu_backward(d_silu, gate)
        return d_gate, d_up, d_weight


def _per_row(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """weight [*rows] -> [*rows, 1], against `like` [*rows, width]."""
    if weight.shape != like.shape[:-1]:
        raise ValueError(f"swiglu: a weight per row of {tuple(like.shape[:-1])}, got "
                         f"{tuple(weight.shape)}")
    return weight.unsqueeze(-1)


ROW_DOT_CHUNK = 1 << 22  # elements of the fp32 products `_row_dots` makes at a time (16 MiB)


def _row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a * b, products and sum in fp32 (or a's wider dtype), rows taken a
    chunk at a time so that a lower precision's fp32 copies stay small."""
    wide = torch.promote_types(a.dtype, torch.float32)
    if a.dtype == wide:
        return (a * b).sum(-1)
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    out = torch.empty(a2.shape[0], dtype=wide, device=a.device)
    step = max(1, ROW_DOT_CHUNK // max(1, a2.shape[1]))
    for start in range(0, a2.shape[0], step):
        rows = slice(start, start + step)
        out[rows] = (a2[rows].to(wide) * b2[rows].to(wide)).sum(-1)
    return out.view(a.shape[:-1])
