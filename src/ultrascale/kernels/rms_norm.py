"""RMSNorm forward and backward in Triton: y = (x * rstd).to(x.dtype) * w, rstd = 1/sqrt(mean(x^2) +
eps) in fp32, the output in the dtype x and w promote to (as `ops.rms_norm`). Forward saves x and
the per-row rstd only; backward recomputes x-hat and writes dx, and per-program partial sums of dw
that a final sum over programs reduces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ultrascale.kernels import next_power_of_2


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = (xf * rstd).to(x.dtype).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * n_cols + cols, normed * w.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
              BLOCK: tl.constexpr):
    """Program p handles rows p, p + P, ...; it writes their dx and its partial dw row."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        offs = tl.cast(row, tl.int64) * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x.to(tl.float32) * rstd
        dw += dy * xhat.to(x.dtype).to(tl.float32)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = next_power_of_2(cols)
        if rows:
            _forward[(rows,)](x2, weight.contiguous(), y, rstd, cols, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.block = shape, block
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, min(rows, 4 * _multiprocessors(x2.device)))
        dw = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
        if rows:
            _backward[(programs,)](dy2, x2, weight.contiguous(), rstd, dx, dw, rows, cols,
                                   BLOCK=ctx.block)
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), None


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: a couple of programs, so the strided row loop is exercised


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)
