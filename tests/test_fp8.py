"""FP8 (models/fp8.py): the tile scales of each recipe, the formats' range, the round-trip error
bound, the scaled matmuls against the exact reference (quantise, dequantise, fp32 matmul), and
the FP8 linear layer's gradients. One process, small tensors: torch's CPU kernels for FP8 are
references, not fast ones."""

from __future__ import annotations

import pytest
import torch

from ultrascale.parallel import fp8
from ultrascale.parallel.fp8 import BLOCK, ROWWISE, TENSORWISE, Fp8Recipe, Tile

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# Half the spacing of each format's numbers: relative for normals (3 and 2 mantissa bits), and
# absolute (in units of the scale) below the smallest normal, 2^-6 and 2^-14.
HALF_ULP = {"e4m3": (2.0 ** -4, 2.0 ** -10), "e5m2": (2.0 ** -3, 2.0 ** -17)}


def _spread(shape, seed=0) -> torch.Tensor:
    """Values over many orders of magnitude (as gradients are), with signs."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(shape, generator=gen) * 3)
    return mag * torch.randn(shape, generator=gen).sign()


def test_blockwise_tile_scales():
    """DeepSeek-V3's tiles: 1 x 128 for activations and gradients, 128 x 128 for weights; a
    scale per tile (partial tiles at the ends included) = the tile's largest magnitude / 448."""
    x = _spread((130, 300))
    for tile, shape in ((Tile(1, BLOCK), (130, 3)), (Tile(BLOCK, BLOCK), (2, 3)),
                        (ROWWISE, (130, 1)), (TENSORWISE, (1, 1))):
        _, scale = fp8.quantize_fp8(x, "e4m3", tile)
        assert tuple(scale.shape) == shape
        tr = tile.rows or x.shape[0]
        tc = tile.cols or x.shape[1]
        for i in range(shape[0]):
            for j in range(shape[1]):
                block = x[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
                assert scale[i, j] == pytest.approx(float(block.abs().max()) / E4M3_MAX,
                                                    rel=1e-6)
    # One huge value spoils only its own tile's resolution, not its neighbours'.
    y = torch.ones(4, 256)
    y[0, 0] = 1e4
    _, s = fp8.quantize_fp8(y, "e4m3", Tile(1, BLOCK))
    assert s[0, 0] == pytest.approx(1e4 / E4M3_MAX) and torch.all(s.flatten()[1:] == 1 / E4M3_MAX)


@pytest.mark.parametrize("fmt,fmax", [("e4m3", E4M3_MAX), ("e5m2", E5M2_MAX)])
def test_format_range(fmt, fmax):
    """Quantised values are finite and within the format's range; each tile's largest magnitude
    maps onto the format's largest finite value exactly (nothing saturates, nothing is wasted)."""
    x = _spread((64, 256), seed=1) * 1e3
    q, scale = fp8.quantize_fp8(x, fmt, Tile(1, BLOCK))
    assert q.dtype == fp8.FP8_DTYPES[fmt]
    v = q.float()
    assert torch.isfinite(v).all() and v.abs().max() <= fmax
    per_tile = v.view(64, 2, BLOCK).abs().amax(dim=-1)
    assert torch.all(per_tile == fmax)
    assert torch.finfo(fp8.FP8_DTYPES[fmt]).max == fmax
    # A tile of zeros stays zeros (a tiny scale, no division by zero).
    q0, s0 = fp8.quantize_fp8(torch.zeros(2, BLOCK), fmt, Tile(1, BLOCK))
    assert torch.all(q0.float() == 0) and torch.all(s0 > 0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("tile", [TENSORWISE, ROWWISE, Tile(1, BLOCK), Tile(BLOCK, BLOCK)],
                         ids=["tensor", "row", "1x128", "128x128"])
def test_round_trip_error_bound(fmt, tile):
    """|x - dequantise(quantise(x))| <= max(|x| * 2^-(m+1), scale * smallest-subnormal / 2): half
    a unit in the last place, relative for normal numbers (m mantissa bits), absolute below."""
    x = _spread((200, 300), seed=2)
    q, scale = fp8.quantize_fp8(x, fmt, tile)
    back = fp8.dequantize_fp8(q, scale, tile)
    rel, sub = HALF_ULP[fmt]
    tr, tc = tile.rows or x.shape[0], tile.cols or x.shape[1]
    s = scale.repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:200, :300]
    bound = torch.maximum(x.abs() * rel, s * sub) * (1 + 1e-5)
    err = (x - back).abs()
    assert torch.all(err <= bound), float((err / bound).max())
    # ... and the bound is tight: some element comes close to it.
    assert float((err / bound).max()) > 0.5


def _operands(m=96, n=80, k=300, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, k, generator=gen).to(dtype)
    return a, b


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_reference_matmul_is_quantise_dequantise_matmul(recipe):
    """The emulated FP8 matmul is exactly the fp32 product of the dequantised operands, and it
    is close to the unquantised product (FP8's rounding, a few percent)."""
    a, b = _operands()
    act, w = fp8.RECIPE_TILES[recipe]
    out = fp8.fp8_forward(a, b, Fp8Recipe(recipe))
    qa, sa = fp8.quantize_fp8(a, "e4m3", act)
    qb, sb = fp8.quantize_fp8(b, "e4m3", w)
    expected = fp8.dequantize_fp8(qa, sa, act) @ fp8.dequantize_fp8(qb, sb, w).t()
    assert torch.equal(out, expected)
    exact = a @ b.t()
    assert float((out - exact).norm() / exact.norm()) < 0.06


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_on_cpu_matches_the_reference(recipe):
    """torch._scaled_mm (tensor- and row-wise scales on a CPU) against the reference: the same
    quantised operands and scales, fp32 accumulation in another order; all three matmuls of a
    linear layer."""
    a, b = _operands()
    g = torch.randn(96, 80, generator=torch.Generator().manual_seed(4))
    native, ref = Fp8Recipe(recipe, native=True), Fp8Recipe(recipe)
    pairs = [(fp8.fp8_forward(a, b, native), fp8.fp8_forward(a, b, ref)),
             (fp8.fp8_grad_input(g, b, native), fp8.fp8_grad_input(g, b, ref)),
             (fp8.fp8_grad_weight(g, a, native), fp8.fp8_grad_weight(g, a, ref))]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_tensorwise_scale_passed_per_row_is_the_same_product():
    """On a CPU one tensor-wise scale is passed as every row's (torch's tensor-wise CPU kernel
    is a slow reference): the literal tensor-wise call gives the same product."""
    a, b = _operands(m=32, n=16, k=64)
    qa, sa = fp8.quantize_fp8(a, "e4m3", TENSORWISE)
    qb, sb = fp8.quantize_fp8(b, "e4m3", TENSORWISE)
    literal = torch._scaled_mm(qa, qb.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                               out_dtype=torch.float32)
    ours = fp8.fp8_forward(a, b, Fp8Recipe("tensorwise", native=True))
    torch.testing.assert_close(ours, literal, rtol=1e-5, atol=1e-5 * float(literal.abs().max()))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_linear_gradients(recipe):
    """The FP8 linear layer's backward is the two FP8 matmuls of its recipe (e5m2 gradients),
    and within FP8's error of the exact gradients."""
    x = torch.randn(4, 50, 200, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(96, 200) * 0.05).to(torch.bfloat16).requires_grad_()
    r = Fp8Recipe(recipe, backward="e5m2")
    y = fp8.fp8_linear(x, w, r)
    assert y.shape == (4, 50, 96) and y.dtype == torch.bfloat16
    g = torch.randn_like(y)
    y.backward(g)
    g2, x2 = g.reshape(-1, 96), x.detach().reshape(-1, 200)
    assert torch.equal(x.grad, fp8.fp8_grad_input(g2, w.detach(), r).view(x.shape))
    assert torch.equal(w.grad, fp8.fp8_grad_weight(g2, x2, r).to(w.dtype))
    exact_x, exact_w = (g2.float() @ w.detach().float()), (g2.float().t() @ x2.float())
    for got, exact in ((x.grad.reshape(-1, 200), exact_x), (w.grad, exact_w)):
        assert float((got.float() - exact).norm() / exact.norm()) < 0.12  # e5m2: 2 mantissa bits


def test_fp8_filter_keeps_small_linears_bf16():
    """precision.fp8_filter=auto: torchao's thresholds on K (in) and N (out). Llama 3.2 1B's blocks:
    only down_proj (K 8192, N 2048) gains row-wise; every one tensor-wise. Two Llama 3 70B layers
    (the GPU suite's FP8 shape): all but the kv projections (N 1024) row-wise. The tiny model:
    nothing, and with fp8_filter=all everything."""
    from ultrascale.config import build_config
    from ultrascale.models.llama import Linear, build_model
    from ultrascale.parallel.precision import Fp8Matmul, apply_precision
    from ultrascale.rules import fp8_pays

    one_b = {"q": (2048, 2048), "kv": (2048, 512), "gate_up": (2048, 8192), "down": (8192, 2048)}
    assert {k for k, s in one_b.items() if fp8_pays(*s, "rowwise")} == {"down"}
    assert all(fp8_pays(*s, "tensorwise") for s in one_b.values())
    big = {"q_o": (8192, 8192), "kv": (8192, 1024), "gate_up": (8192, 28672),
           "down": (28672, 8192)}
    assert {k for k, s in big.items() if fp8_pays(*s, "rowwise")} == {"q_o", "gate_up", "down"}
    assert not fp8_pays(8200, 8192, "rowwise")  # not a multiple of 16
    for how, converted in (("auto", 0), ("all", 28)):
        cfg = build_config({"model": {"preset": "tiny"}, "device": "cpu",
                            "precision": {"dtype": "fp8", "fp8_recipe": "rowwise",
                                          "fp8_emulate": True, "fp8_filter": how}}, [])
        model = build_model(cfg.model, 0)
        apply_precision(model, cfg.precision, torch.device("cpu"))
        fp8 = [m for m in model.modules() if isinstance(m, Linear)
               and isinstance(m.matmul, Fp8Matmul)]
        assert len(fp8) == converted


# -- block-wise against DeepSeek-V3's recipe, written here apart from models/fp8.py's tiles -------

def _deepseek_quantise(t: torch.Tensor, rows: int, cols: int, fmt: str):
    """DeepSeek-V3's fine-grained quantisation, tile by tile in plain loops: each `rows` x `cols`
    tile (partial at the ends) scaled by its largest magnitude / the format's largest value
    (e4m3: 448), cast to FP8. (q as fp32 values, scales [tiles down, tiles across])."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    fmax = torch.finfo(dtype).max
    r, c = t.shape
    nr, nc = -(-r // rows), -(-c // cols)
    q = torch.empty(r, c)
    scales = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            tile = t[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float()
            s = max(float(tile.abs().max()), 1e-12)
            scales[i, j] = torch.tensor(s, dtype=torch.float32) / fmax
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = \
                (tile / scales[i, j]).clamp(-fmax, fmax).to(dtype).float()
    return q, scales


def _deepseek_matmul(a, a_tile, fmt_a, b, b_tile, fmt_b):
    """a [m, k] @ b [n, k].T as DeepSeek-V3 computes it: per 128-long slice of k, the FP8
    products summed, then scaled by the two tiles' scales (float64 here); and the bound of fp32
    accumulation of the same products over k terms, for each element."""
    qa, sa = _deepseek_quantise(a, *a_tile, fmt_a)
    qb, sb = _deepseek_quantise(b, *b_tile, fmt_b)
    m, k = a.shape
    n = b.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    size = torch.zeros(m, n, dtype=torch.float64)  # sum of |terms|
    for j in range(-(-k // BLOCK)):
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        part = qa[:, cols].double() @ qb[:, cols].double().t()
        mag = qa[:, cols].double().abs() @ qb[:, cols].double().abs().t()
        row_a = sa[:, j].double().repeat_interleave(a_tile[0])[:m, None]
        row_b = sb[:, j].double().repeat_interleave(b_tile[0])[None, :n]
        out += part * row_a * row_b
        size += mag * row_a * row_b
    return out, size, (sa, sb)


def _recorded_scales(monkeypatch) -> list:
    """(operand shape, format, scale shape) of every quantisation, in call order."""
    calls = []
    real = fp8.quantize_fp8

    def recording(t, fmt, tile):
        q, s = real(t, fmt, tile)
        calls.append((tuple(t.shape), fmt, tuple(s.shape)))
        return q, s

    monkeypatch.setattr(fp8, "quantize_fp8", recording)
    return calls


def test_blockwise_linear_matches_deepseek_v3s_recipe(monkeypatch):
    """The block-wise FP8 linear's three matmuls (forward, input gradient, weight gradient) against
    the quantiser above: activations and gradients in 1 x 128 tiles along each product's
    contraction dim (tokens for the weight gradient: DeepSeek-V3's 128 x 1 activation tiles of
    that product), weights in 128 x 128 blocks; shapes that leave partial tiles (200 tokens, 300
    in, 260 out). Each element within the bound of fp32 accumulation: (k + 2) x 2^-24 of the sum
    of its terms' magnitudes (k products summed, plus each operand's dequantisation rounding)."""
    gen = torch.Generator().manual_seed(11)
    tokens, d_in, d_out = 200, 300, 260
    x = torch.randn(tokens, d_in, generator=gen).requires_grad_()
    w = (torch.randn(d_out, d_in, generator=gen) * 0.05).requires_grad_()
    g = torch.randn(tokens, d_out, generator=gen)
    calls = _recorded_scales(monkeypatch)
    recipe = Fp8Recipe("blockwise", backward="e5m2")
    y = fp8.fp8_linear(x, w, recipe)
    y.backward(g)

    def tiles(n):
        return -(-n // BLOCK)

    # The scale shapes of the three matmuls, in order: forward (x 1x128 along in, w 128x128),
    # input gradient (g 1x128 along out, w.T 128x128), weight gradient (g.T and x.T 1x128 along
    # the tokens).
    assert calls == [
        ((tokens, d_in), "e4m3", (tokens, tiles(d_in))),
        ((d_out, d_in), "e4m3", (tiles(d_out), tiles(d_in))),
        ((tokens, d_out), "e5m2", (tokens, tiles(d_out))),
        ((d_in, d_out), "e4m3", (tiles(d_in), tiles(d_out))),
        ((d_out, tokens), "e5m2", (d_out, tiles(tokens))),
        ((d_in, tokens), "e4m3", (d_in, tiles(tokens))),
    ]
    act, blk = (1, BLOCK), (BLOCK, BLOCK)
    products = {
        "forward": (y, _deepseek_matmul(x.detach(), act, "e4m3", w.detach(), blk, "e4m3")),
        "grad_input": (x.grad, _deepseek_matmul(g, act, "e5m2", w.detach().t(), blk, "e4m3")),
        "grad_weight": (w.grad, _deepseek_matmul(g.t(), act, "e5m2", x.detach().t(), act,
                                                 "e4m3")),
    }
    for name, (got, (want, size, _)) in products.items():
        k = {"forward": d_in, "grad_input": d_out, "grad_weight": tokens}[name]
        bound = (k + 2) * 2.0 ** -24 * size
        err = (got.double() - want).abs()
        assert torch.all(err <= bound), (name, float((err / bound).max()))


def test_the_deepseek_check_sees_weight_tiles_of_the_wrong_shape(monkeypatch):
    """The check above fails if the weights were quantised in 1 x 128 tiles (as activations),
    which the tile table alone cannot tell: the independent quantiser's products differ by far
    more than the accumulation bound."""
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(200, 300, generator=gen), torch.randn(260, 300, generator=gen) * 0.05
    monkeypatch.setitem(fp8.RECIPE_TILES, "blockwise", (Tile(1, BLOCK), Tile(1, BLOCK)))
    got = fp8.fp8_forward(x, w, Fp8Recipe("blockwise")).double()
    want, size, _ = _deepseek_matmul(x, (1, BLOCK), "e4m3", w, (BLOCK, BLOCK), "e4m3")
    assert float(((got - want).abs() / ((300 + 2) * 2.0 ** -24 * size)).max()) > 10


def test_compiled_fp8_linear_equals_eager_on_partial_tiles():
    """A width that is not a whole number of 1 x 128 tiles (300: two whole, one partial):
    `torch.compile` gives the eager output and gradients bit for bit. Inductor (torch 2.13, CPU)
    miscompiled the padded tiles' 8-bit cast and the scales spread by repeat_interleave (the
    output off by 1.4 here, NaNs in q), which quantize_fp8 (eager on partial tiles) and
    dequantize_fp8 (tile by tile on a padded view) now avoid."""
    recipe = Fp8Recipe("blockwise")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g, requires_grad=True)
    w = (torch.randn(200, 300, generator=g) * 0.05).requires_grad_()
    eager = fp8.fp8_linear(x, w, recipe)
    grads = torch.autograd.grad(eager.sum(), (x, w))
    compiled = torch.compile(lambda a, b: fp8.fp8_linear(a, b, recipe))(x, w)
    assert torch.equal(eager, compiled)
    for a, b in zip(grads, torch.autograd.grad(compiled.sum(), (x, w))):
        assert torch.equal(a, b)
