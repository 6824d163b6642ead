"""SwiGLU in Triton: silu(gate) * up, times a per-row weight when given (a mixture of experts'
routing weights), elementwise, and its backward. The forward saves only gate, up (and the weight;
eager PyTorch also keeps silu(gate)); the backward recomputes the sigmoid. Arithmetic in fp32,
each result rounded to the inputs' dtype where `ops.swiglu` rounds it: silu's output, the
product, the weighted product; the backward's gradients rounded once each.

The tensors are taken as rows of their last dimension: program (r, c) handles columns
c * BLOCK .. of row r, so that a row's weight is one load. The weight's gradient, the row's sum of
dy * silu * up, is summed per program into an fp32 [rows, column blocks] buffer and those partial
sums added in PyTorch (no atomics: the order, and so the result, is fixed)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _forward(g_ptr, u_ptr, w_ptr, y_ptr, cols, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    at = row * cols + offs
    g = tl.load(g_ptr + at, mask=mask, other=0.0)
    u = tl.load(u_ptr + at, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf * tl.sigmoid(gf)).to(g.dtype)
    y = silu.to(tl.float32) * u.to(tl.float32)
    if HAS_W:  # the product rounded as the unweighted one, then times the weight in fp32
        y = y.to(g.dtype).to(tl.float32) * tl.load(w_ptr + row).to(tl.float32)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(dy_ptr, g_ptr, u_ptr, w_ptr, dg_ptr, du_ptr, dw_ptr, cols, col_blocks,
              HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    at = row * cols + offs
    dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    d = dy
    if HAS_W:
        tl.store(dw_ptr + row * col_blocks + block, tl.sum(dy * silu * u, axis=0))
        d = dy * tl.load(w_ptr + row).to(tl.float32)
    du = d * silu
    dg = d * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + at, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty), mask=mask)


def _grid(gate: torch.Tensor) -> tuple[int, int, int]:
    """(rows, column blocks, block) for a contiguous gate."""
    cols = gate.shape[-1] if gate.dim() else 1
    block = min(BLOCK, triton.next_power_of_2(max(cols, 1)))
    return gate.numel() // max(cols, 1), triton.cdiv(cols, block), block


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight):
        gate, up = gate.contiguous(), up.contiguous()
        weight = None if weight is None else weight.contiguous()
        y = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        rows, blocks, block = _grid(gate)
        if gate.numel():
            _forward[(rows, blocks)](gate, up, gate if weight is None else weight, y,
                                     gate.shape[-1] if gate.dim() else 1,
                                     HAS_W=weight is not None, BLOCK=block)
        ctx.save_for_backward(gate, up, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        rows, blocks, block = _grid(gate)
        partial = torch.zeros(rows, blocks, dtype=torch.float32, device=gate.device)
        if gate.numel():
            _backward[(rows, blocks)](dy, gate, up, gate if weight is None else weight, dg, du,
                                      partial, gate.shape[-1] if gate.dim() else 1, blocks,
                                      HAS_W=weight is not None, BLOCK=block)
        dw = None
        if weight is not None and ctx.needs_input_grad[2]:
            dw = partial.sum(1).view(weight.shape).to(weight.dtype)
        return dg, du, dw


def swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None = None
           ) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if weight is not None and weight.shape != gate.shape[:-1]:
        raise ValueError(f"swiglu: a weight per row of {tuple(gate.shape[:-1])}, got "
                         f"{tuple(weight.shape)}")
    return _SwiGLU.apply(gate, up, weight)
