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

With `Fp8Recipe.cache` (`precision.fp8_cache_activations`, DeepSeek-V3's low-precision storage)
backward keeps a linear's input as the forward quantised it, e4m3 and its activation tiles'
scales, shared by the layers that read the same tensor (`QUANTISED`), and dequantises it for the
weight gradient; and every SwiGLU's gate and up (`cached_swiglu`, the activation parallel/
precision.py swaps in), e4m3 in 1 x 128 tiles, silu(gate) and the product recomputed in backward.
`fp8_grouped_mm` is the routed experts' grouped GEMM in FP8 (`precision.fp8_experts`), expert by
expert, so that no tile holds two experts' rows.
"""

from __future__ import annotations

import weakref
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
    # precision.fp8_cache_activations: backward keeps the forward's 8-bit input and its scales
    # (the quantisation the forward made anyway) instead of the compute-dtype input.
    cache: bool = False

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
    tr, tc = _tile_shape(tuple(t.shape), tile)
    if t.shape[0] % tr or t.shape[1] % tc:
        return _quantize_partial_tiles(t, fmt, tile)
    return _quantize_tiles(t, fmt, tile)


@torch.compiler.disable
def _quantize_partial_tiles(t: torch.Tensor, fmt: str, tile: Tile
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager, always: Inductor (torch 2.13, CPU) miscompiles the 8-bit cast of zero-padded tiles
    (NaNs in q; tests/test_fp8.py holds the compiled result equal to the eager one). Whole tiles,
    the widths of real models, stay compiled."""
    return _quantize_tiles(t, fmt, tile)


def _quantize_tiles(t: torch.Tensor, fmt: str, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
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
    """The fp32 values q * scale, each element times its tile's scale. Tile by tile on a
    zero-padded view, cut back: Inductor (torch 2.13, CPU) miscompiled the scales spread out by
    repeat_interleave and cut to partial tiles."""
    r, c = q.shape
    tr, tc = _tile_shape((r, c), tile)
    nr, nc = scale.shape
    x = q.float()
    if nr * tr != r or nc * tc != c:
        x = F.pad(x, (0, nc * tc - c, 0, nr * tr - r))
    return (x.view(nr, tr, nc, tc) * scale[:, None, :, None]).view(nr * tr, nc * tc)[:r, :c]


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


def scaled_product(qa, sa, qb, sb, tiles: tuple[Tile, Tile], native: bool,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """qa [m, k] @ qb [n, k].T of two quantised operands (their scales `sa`, `sb` by `tiles`),
    fp32 accumulation, the result in `out_dtype`."""
    if native:
        return _native_scaled_mm(qa, sa, qb, sb, tiles, out_dtype)
    return (dequantize_fp8(qa, sa, tiles[0]) @ dequantize_fp8(qb, sb, tiles[1]).t()).to(out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fmt_a: str, fmt_b: str,
               tiles: tuple[Tile, Tile], native: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] @ b [n, k].T with both operands quantised along k (`tiles`: a's and b's), fp32
    accumulation, the result in `out_dtype`."""
    qa, sa = quantize_fp8(a, fmt_a, tiles[0])
    qb, sb = quantize_fp8(b, fmt_b, tiles[1])
    return scaled_product(qa, sa, qb, sb, tiles, native, out_dtype)


def fp8_forward(x2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe,
                quantised: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [tokens, in] @ weight [out, in].T, both e4m3 (`quantised`: x's e4m3 copy and scales,
    when made already)."""
    act, w = recipe.tiles
    qx, sx = quantised if quantised is not None else quantize_fp8(x2d, "e4m3", act)
    qw, sw = quantize_fp8(weight, "e4m3", w)
    return scaled_product(qx, sx, qw, sw, (act, w), recipe.native, x2d.dtype)


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


class QuantisedInputs:
    """The inputs FP8 forwards quantised, while each input lives unchanged and what backward
    keeps of its copy lives: the layers that read one tensor (q, k and v; gate and up; MLA's two
    down-projections; the routed experts' gate and up) quantise it once and keep one 8-bit copy
    between them. Keyed by the tensor itself (the caller's, before any reshape), its version (an
    in-place change makes it new) and how it was quantised; the copy is held weakly (a copy no
    backward kept is not kept alive here), and an entry goes when its tensor does."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, x: torch.Tensor, how, make):
        entry = self._entries.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] == (x._version, how):
            value = _strong(entry[2])
            if value is not None:
                return value
        value = make()
        key = id(x)
        self._entries[key] = (weakref.ref(x, lambda _, k=key: self._entries.pop(k, None)),
                              (x._version, how), _weak(value))
        return value


def _weak(value):
    if isinstance(value, torch.Tensor):
        return weakref.ref(value)
    return type(value)(_weak(v) for v in value)


def _strong(value):
    """The value `_weak` made weak, or None if any of its tensors is gone."""
    if isinstance(value, weakref.ref):
        return value()
    out = type(value)(_strong(v) for v in value)
    return None if any(v is None for v in out) else out


QUANTISED = QuantisedInputs()


def cached_input(x: torch.Tensor, recipe: Fp8Recipe) -> bool:
    """Whether backward keeps x's 8-bit copy: the cache is on, a backward may come (autograd
    records, or x is an input of an autograd function's forward, which runs without recording),
    and x is not recomputed for free anyway (the norms' outputs under DeepSeek-V3's recompute
    policy, parallel/recipes.py, are kept as recipes: nothing to store; a view of one too)."""
    if not recipe.cache or not (torch.is_grad_enabled() or x.requires_grad):
        return False
    return not (getattr(x, "kept_as_recipe", False)
                or (x._base is not None and getattr(x._base, "kept_as_recipe", False)))


def keep_input(x: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, ...]:
    """What backward keeps of a linear's input x for the weight gradient: x, or with the cache
    x [..., in]'s e4m3 copy [tokens, in] and scales, as its forward quantises it (made once per
    tensor, `QUANTISED`)."""
    if not cached_input(x, recipe):
        return (x,)
    act = recipe.tiles[0]
    return QUANTISED.get(x, ("linear", act), lambda: _quantise(x.reshape(-1, x.shape[-1]), act))


def kept_input(kept: tuple[torch.Tensor, ...], recipe: Fp8Recipe) -> torch.Tensor:
    """The input the weight gradient takes from `keep_input`'s: x, or its copy dequantised (fp32,
    exactly q x scale)."""
    return kept[0] if len(kept) == 1 else dequantize_fp8(*kept, recipe.tiles[0])


class _Fp8Linear(torch.autograd.Function):
    """x [tokens, in] @ weight.T with each of the three matmuls in FP8. Saves the weight, and x
    in its own (compute) dtype, or with the cache on x's e4m3 copy and scales that the forward
    made (`quantised`), dequantised for the weight gradient, which quantises it again along the
    tokens (DeepSeek-V3's transposed re-quantisation)."""

    @staticmethod
    def forward(ctx, x2d, weight, recipe, qx=None, sx=None):
        ctx.recipe, ctx.cached, ctx.dtype = recipe, qx is not None, x2d.dtype
        ctx.save_for_backward(*((qx, sx) if ctx.cached else (x2d,)), weight)
        return fp8_forward(x2d, weight, recipe, (qx, sx) if ctx.cached else None)

    @staticmethod
    def backward(ctx, grad):
        *kept, weight = ctx.saved_tensors
        g = grad.to(ctx.dtype)
        x2d = kept_input(tuple(kept), ctx.recipe)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grad_input(g, weight, ctx.recipe)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_grad_weight(g, x2d, ctx.recipe).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """`linear` with FP8 matmuls forward and backward (`recipe`). The tokens are flattened
    outside the autograd function, so that its output is not a view made inside it (tensor
    parallel reduces a row-parallel output in place)."""
    x2d = x.reshape(-1, x.shape[-1])
    kept = keep_input(x, recipe)
    y = _Fp8Linear.apply(x2d, weight, recipe, *(kept if len(kept) == 2 else ()))
    return y.view(*x.shape[:-1], weight.shape[0])


def _quantise(x2d: torch.Tensor, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():  # the 8-bit copy is data, outside autograd's graph
        return quantize_fp8(x2d, "e4m3", tile)


# -- the routed experts' grouped GEMM -------------------------------------------------------------


def quantize_groups(x: torch.Tensor, counts: list[int], tile: Tile
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rows x [N, k] grouped by expert (`counts` rows each) in e4m3, each expert's rows
    quantised on their own (a tile never holds two experts' rows): (q [N, k], each expert's
    scales)."""
    with torch.no_grad():  # an expert without rows: nothing to scale
        parts = [quantize_fp8(part, "e4m3", tile) if len(part) else
                 (part.to(FP8_DTYPES["e4m3"]), part.new_zeros(0, 1, dtype=torch.float32))
                 for part in x.split(counts)]
    return torch.cat([q for q, _ in parts]), [s for _, s in parts]


def _padded(t: torch.Tensor, multiple: int, fill: float = 0.0) -> torch.Tensor:
    """t with rows of `fill` appended up to a multiple of `multiple` rows."""
    extra = -t.shape[0] % multiple
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)]) if extra else t


def _expert_matmuls(recipe: Fp8Recipe):
    """An expert's three FP8 matmuls (forward on its quantised rows, input and weight gradient),
    each taking its rows however many. The device's scaled matmul wants whole tiles along the
    contraction dim and aligned rows (16; 128 for blocks), which an expert's tokens are not: its
    rows are padded with zeros, which change no tile's largest magnitude and add nothing to a
    product (DeepSeek's grouped GEMM aligns each expert's rows so); the reference takes them as
    they are."""
    act, w_tile = recipe.tiles
    align = (BLOCK if recipe.name == "blockwise" else 16) if recipe.native else 1

    def forward(q, s, w, dtype):
        n = q.shape[0]
        if act.rows == 1:  # one scale per row: the padded rows' scales are ones
            s = _padded(s, align, 1.0)
        out = scaled_product(_padded(q, align), s, *quantize_fp8(w, "e4m3", w_tile),
                             (act, w_tile), recipe.native, dtype)
        return out[:n]

    def grad_input(g, w):
        return fp8_grad_input(_padded(g, align), w, recipe)[:g.shape[0]]

    def grad_weight(g, x):
        return fp8_grad_weight(_padded(g, align), _padded(x, align), recipe)

    return forward, grad_input, grad_weight


class _Fp8GroupedMM(torch.autograd.Function):
    """grouped_mm in FP8: for each expert e, rows_e [n_e, in] @ weight[e] [out, in].T and its two
    gradients, each quantised along its own contraction dim as a linear layer's are (forward:
    along `in`; input gradient: along `out`; weight gradient: along expert e's own rows). Saves
    the weight and x, or with the cache x's e4m3 copy and scales (`qx`, `scales`)."""

    @staticmethod
    def forward(ctx, x, weight, counts, recipe, qx, *scales):
        ctx.recipe, ctx.counts, ctx.dtype, ctx.cached = recipe, counts, x.dtype, qx is not None
        if qx is None:
            qx, scales = quantize_groups(x, counts, recipe.tiles[0])
        forward = _expert_matmuls(recipe)[0]
        outs = [forward(q, s, w, x.dtype) if len(q) else x.new_zeros(0, w.shape[0])
                for q, s, w in zip(qx.split(counts), scales, weight.unbind(0))]
        ctx.save_for_backward(weight, *((qx, *scales) if ctx.cached else (x,)))
        return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        act = ctx.recipe.tiles[0]
        if ctx.cached:
            rows = [dequantize_fp8(q, s, act) if len(q) else q.float()
                    for q, s in zip(kept[0].split(ctx.counts), kept[1:])]
        else:
            rows = kept[0].split(ctx.counts)
        grads = grad.to(ctx.dtype).split(ctx.counts)
        _, grad_input, grad_weight = _expert_matmuls(ctx.recipe)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([grad_input(g, w) if len(g) else g.new_zeros(0, w.shape[1])
                                for g, w in zip(grads, weight.unbind(0))])
        if ctx.needs_input_grad[1]:  # an expert without rows gets a zero gradient
            grad_w = torch.stack([
                grad_weight(g, x).to(weight.dtype) if len(g)
                else weight.new_zeros(weight.shape[1:]) for g, x in zip(grads, rows)])
        return (grad_x, grad_w, None, None, None) + (None,) * (len(ctx.saved_tensors) - 2)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   recipe: Fp8Recipe) -> torch.Tensor:
    """`grouped_gemm.grouped_mm` (rows x [N, in] grouped by expert, weight [E, out, in]) with each
    expert's three matmuls in FP8 (`recipe`); with the cache on, backward keeps the rows' e4m3
    copy, shared by the projections that read the same rows (gate and up)."""
    sizes = counts.tolist()
    weight = weight.to(x.dtype)
    if not cached_input(x, recipe):
        return _Fp8GroupedMM.apply(x, weight, sizes, recipe, None)
    act = recipe.tiles[0]
    qx, scales = QUANTISED.get(x, ("grouped", act, tuple(sizes)),
                               lambda: quantize_groups(x, sizes, act))
    return _Fp8GroupedMM.apply(x, weight, sizes, recipe, qx, *scales)


# -- the SwiGLU's inputs, kept in 8 bits ----------------------------------------------------------

# DeepSeek-V3's tiles for a cached activation, whatever the matmuls' recipe: no matmul reads this
# copy, so nothing ties its scales to one, and a scale per 128 elements of a row is the finest
# the recipes keep (a tensor-wise scale over a whole SwiGLU input would lose its small rows).
SWIGLU_TILE = Tile(1, BLOCK)


class _CachedSwiGLU(torch.autograd.Function):
    """swiglu(gate, up[, weight]) whose backward keeps gate and up [rows, ffn] as e4m3 with one
    fp32 scale per 1 x 128 tile (DeepSeek-V3's low-precision storage of the SwiGLU's input: the
    caller's `qg, sg, qu, su`), and nothing else of width ffn: silu(gate), the product and their
    gradients are recomputed in fp32 from the dequantised copies (so each gradient is rounded
    once, to the input's dtype). The forward is the plain `swiglu`'s, bit for bit."""

    @staticmethod
    def forward(ctx, gate, up, weight, swiglu, qg, sg, qu, su):
        ctx.dtype = gate.dtype
        ctx.save_for_backward(qg, sg, qu, su, *((weight,) if weight is not None else ()))
        ctx.shape = gate.shape
        return swiglu(gate, up, weight)

    @staticmethod
    def backward(ctx, grad):
        qg, sg, qu, su, *weight = ctx.saved_tensors
        g = dequantize_fp8(qg, sg, SWIGLU_TILE).view(ctx.shape)
        u = dequantize_fp8(qu, su, SWIGLU_TILE).view(ctx.shape)
        sig = torch.sigmoid(g)
        silu = g * sig
        grad = grad.float()
        grad_weight = None
        if weight:
            if ctx.needs_input_grad[2]:  # d/dw of silu(g) u w: the row's product, summed
                grad_weight = (grad * silu * u).sum(-1).to(weight[0].dtype)
            grad = grad * weight[0].float().unsqueeze(-1)
        grad_up = (grad * silu).to(ctx.dtype)
        # d silu(g) / dg = sig (1 + g (1 - sig))
        grad_gate = (grad * u * sig * (1 + g * (1 - sig))).to(ctx.dtype)
        return grad_gate, grad_up, grad_weight, None, None, None, None, None


# Eager inside a compiled block (a graph break on each side), so that its forward stays the
# plain swiglu's bit for bit: Inductor fuses silu(gate) * up without rounding silu to bf16 first.
@torch.compiler.disable
def cached_swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None,
                  swiglu, mark=None) -> torch.Tensor:
    """`swiglu(gate, up[, weight])` (the plain primitive, passed in) with gate and up kept for
    backward in e4m3 (`_CachedSwiGLU`); with no backward to come, the primitive itself. `mark`
    (a `Recipes.mark`, DeepSeek-V3's recompute policy): the product is saved by whoever reads it
    (the down projection) as its recipe, rebuilt from those 8-bit copies (`swiglu_from_cache`)."""
    args = (gate, up, weight)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args)):
        return swiglu(gate, up, weight)
    qg, sg = _quantise(gate.reshape(-1, gate.shape[-1]), SWIGLU_TILE)
    qu, su = _quantise(up.reshape(-1, up.shape[-1]), SWIGLU_TILE)
    out = _CachedSwiGLU.apply(gate, up, weight, swiglu, qg, sg, qu, su)
    if mark is not None:
        mark(out, swiglu_from_cache, (qg, sg, qu, su, weight, gate.shape, gate.dtype, swiglu))
    return out


def swiglu_from_cache(qg, sg, qu, su, weight, shape, dtype, swiglu) -> torch.Tensor:
    """The SwiGLU's product rebuilt from gate and up's 8-bit copies (in their dtype, as the
    forward took them): what DeepSeek-V3 recomputes for the down projection's weight gradient
    instead of keeping its input."""
    g = dequantize_fp8(qg, sg, SWIGLU_TILE).view(shape).to(dtype)
    u = dequantize_fp8(qu, su, SWIGLU_TILE).view(shape).to(dtype)
    return swiglu(g, u, weight)
