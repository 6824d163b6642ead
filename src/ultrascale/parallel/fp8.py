"""FP8 matmuls (`precision.dtype: fp8`): 8-bit inputs with scales, fp32 accumulation. The numerics
behind `parallel/precision.py`'s `Fp8Matmul`, its one consumer.

A matmul a @ b.T (a [m, k], b [n, k]) quantises both operands along the contraction dim k, each in
tiles with one fp32 scale per tile, multiplies with fp32 accumulation and returns the compute
dtype. The recipe sets the tiles: tensorwise (one scale per operand), rowwise (one per row), or
DeepSeek-V3's blockwise (1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights).
A linear layer's three matmuls (forward, input gradient, weight gradient) each quantise their
operands along their own contraction dim; the forward's inputs are e4m3, the gradients e5m2 or
e4m3. `native` runs the device's scaled matmul (`torch._scaled_mm` for tensor- and row-wise
scales, `torch.nn.functional.scaled_mm` for blocks); otherwise the exact reference: quantise,
dequantise, fp32 matmul. The model reaches this through `Linear.matmul` (swapped by
parallel/precision.py), tensor parallel and zero-bubble through the same child; nothing here
calls `F.linear` (models/ops.py's primitives stay the only door to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128  # DeepSeek-V3's tile length


@dataclass(frozen=True)
class Tile:
    """The part of a 2-D operand one scale covers: `rows` x `cols` elements, None meaning all of
    them (cols run along the contraction dim)."""

    rows: int | None
    cols: int | None


TENSORWISE, ROWWISE = Tile(None, None), Tile(1, None)
RECIPE_TILES = {  # (activations and gradients, weights)
    "tensorwise": (TENSORWISE, TENSORWISE),
    "rowwise": (ROWWISE, ROWWISE),
    "blockwise": (Tile(1, BLOCK), Tile(BLOCK, BLOCK)),
}


@dataclass(frozen=True)
class Fp8Recipe:
    name: str  # tensorwise, rowwise, blockwise
    backward: str = "e5m2"  # the gradients' format (the forward's inputs are e4m3)
    native: bool = False  # the device's scaled matmul, else the reference

    @property
    def tiles(self) -> tuple[Tile, Tile]:
        return RECIPE_TILES[self.name]


def _tile_shape(shape: tuple[int, int], tile: Tile) -> tuple[int, int]:
    return (shape[0] if tile.rows is None else tile.rows,
            shape[1] if tile.cols is None else tile.cols)


def quantize_fp8(t: torch.Tensor, fmt: str, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): `t` [r, c] in 8 bits and the fp32 dequantisation scale of each tile, so that
    t ~ q * scale. A tile's scale is its largest magnitude over the format's largest finite value
    (448 for e4m3), so that the tile's extreme maps onto it; a tile of zeros gets a tiny scale.
    scale has one entry per tile: [ceil(r / tile rows), ceil(c / tile cols)] (partial tiles at the
    ends)."""
    dtype = FP8_DTYPES[fmt]
    r, c = t.shape
    tr, tc = _tile_shape((r, c), tile)
    nr, nc = -(-r // tr), -(-c // tc)
    x = t.float()
    if nr * tr != r or nc * tc != c:  # pad with zeros to whole tiles (zeros change no maximum)
        x = F.pad(x, (0, nc * tc - c, 0, nr * tr - r))
    blocks = x.view(nr, tr, nc, tc)
    fmax = torch.finfo(dtype).max
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
    q = (blocks / scale[:, None, :, None]).clamp_(-fmax, fmax).to(dtype)
    q = q.view(nr * tr, nc * tc)[:r, :c]
    return q.contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The fp32 values q * scale, each element times its tile's scale."""
    r, c = q.shape
    tr, tc = _tile_shape((r, c), tile)
    full = scale.repeat_interleave(tr, dim=0).repeat_interleave(tc, dim=1)[:r, :c]
    return q.float() * full


def _native_scaled_mm(qa, sa, qb, sb, tiles: tuple[Tile, Tile], out_dtype):
    """qa @ qb.T on the device's scaled matmul (qb is [n, k]: its transpose is column-major)."""
    ta, tb = tiles
    cpu = qa.device.type == "cpu"
    if ta == TENSORWISE and tb == TENSORWISE and not cpu:
        return torch._scaled_mm(qa, qb.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                                out_dtype=out_dtype)
    if {ta, tb} <= {TENSORWISE, ROWWISE}:
        # torch's CPU kernel for a tensor-wise scale is a slow reference (seconds for what the
        # row-wise one does in milliseconds): there, one scale is passed as every row's. Its
        # row-wise kernel is also faster with an fp32 result (rounded once to the compute dtype
        # after it, as on a GPU).
        sa = sa.expand(qa.shape[0], 1).contiguous()
        sb = sb.expand(qb.shape[0], 1).t().contiguous()
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb,
                               out_dtype=torch.float32 if cpu else out_dtype)
        return out.to(out_dtype)
    kinds = {Tile(1, BLOCK): F.ScalingType.BlockWise1x128,
             Tile(BLOCK, BLOCK): F.ScalingType.BlockWise128x128}
    return F.scaled_mm(qa, qb.t(), sa, kinds[ta], sb.t() if tb == Tile(1, BLOCK) else sb,
                       kinds[tb], output_dtype=out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fmt_a: str, fmt_b: str,
               tiles: tuple[Tile, Tile], native: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] @ b [n, k].T with both operands quantised along k (`tiles`: a's and b's), fp32
    accumulation, the result in `out_dtype`."""
    qa, sa = quantize_fp8(a, fmt_a, tiles[0])
    qb, sb = quantize_fp8(b, fmt_b, tiles[1])
    if native:
        return _native_scaled_mm(qa, sa, qb, sb, tiles, out_dtype)
    return (dequantize_fp8(qa, sa, tiles[0]) @ dequantize_fp8(qb, sb, tiles[1]).t()).to(out_dtype)


def fp8_forward(x2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """x [tokens, in] @ weight [out, in].T, both e4m3."""
    act, w = recipe.tiles
    return fp8_matmul(x2d, weight, "e4m3", "e4m3", (act, w), recipe.native, x2d.dtype)


def fp8_grad_input(grad2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """grad [tokens, out] @ weight [out, in]: the contraction runs over the output features, so
    the weight is quantised along them (its transpose's rows)."""
    act, w = recipe.tiles
    return fp8_matmul(grad2d, weight.t().contiguous(), recipe.backward, "e4m3", (act, w),
                      recipe.native, grad2d.dtype)


def fp8_grad_weight(grad2d: torch.Tensor, x2d: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """grad [tokens, out].T @ x [tokens, in]: the contraction runs over the tokens, so both are
    quantised along them (DeepSeek-V3's 128 x 1 tiles of activations for this product)."""
    act, _ = recipe.tiles
    return fp8_matmul(grad2d.t().contiguous(), x2d.t().contiguous(), recipe.backward, "e4m3",
                      (act, act), recipe.native, grad2d.dtype)


class _Fp8Linear(torch.autograd.Function):
    """x [tokens, in] @ weight.T with each of the three matmuls in FP8. Saves x and the weight in
    their own (compute) dtype: each backward matmul quantises along its own contraction dim."""

    @staticmethod
    def forward(ctx, x2d, weight, recipe):
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        return fp8_forward(x2d, weight, recipe)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        g = grad.to(x2d.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grad_input(g, weight, ctx.recipe)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_grad_weight(g, x2d, ctx.recipe).to(weight.dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """`linear` with FP8 matmuls forward and backward (`recipe`). The tokens are flattened
    outside the autograd function, so that its output is not a view made inside it (tensor
    parallel reduces a row-parallel output in place)."""
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    return y.view(*x.shape[:-1], weight.shape[0])
