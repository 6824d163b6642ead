"""What one MoE layer keeps for backward (issue 45): each routed row once, going into the experts,
in the compute dtype (the experts' SwiGLU applies the routing weight, so the combine keeps no
output row; expert parallel's regrouping keeps none either), counted by the estimator
(theory/expert.py `routing_saved`, theory/block.py); the autograd functions that make it so
(`_SumRows`, `_Permute`) against autograd's own backward; and the weighted SwiGLU
(`ops.swiglu`, which keeps gate, up and the weight only) against autograd through its
composition."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from test_moe import moe_config, moe_layer
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.layout import Layout
from ultrascale.models import ops, swiglu
from ultrascale.models.moe import _SumRows
from ultrascale.parallel.expert import AllToAllDispatcher, _Permute
from ultrascale.theory import block, expert
from ultrascale.theory.shape import Shape, model_shape

B, S = 2, 8  # two sequences of 8 tokens; 4 experts top-2, hidden 32, expert width 16


def _saved(moe, x) -> list[torch.Tensor]:
    """One tensor per storage autograd saved in the layer's forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in moe.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return list(seen.values())


@pytest.mark.parametrize("dispatch", ["local", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_moe_layer_keeps_each_routed_row_once_in_the_compute_dtype(dtype, dispatch):
    moe = moe_layer(balance="none").to(dtype)
    if dispatch == "all_to_all":  # expert parallel's dispatcher, its exchange of one rank a copy
        comm.set_context(ParallelContext.without_mesh())
        moe.dispatcher = AllToAllDispatcher(1, moe.num_experts)
    x = torch.randn(B, S, 32, dtype=dtype, requires_grad=True)
    saved = _saved(moe, x)
    routed, h = B * S * moe.top_k, 32
    rows = [t for t in saved if tuple(t.shape) == (routed, h)]
    # Before: the weighted combine kept each output row for the weight's gradient (and an fp32
    # copy of it in bf16), expert parallel's regrouping (`index_copy`) the output rows once more.
    assert len(rows) == 1 and rows[0].dtype == dtype
    # The SwiGLU keeps gate and up, the down projection its input: three, not silu(gate) too.
    assert len([t for t in saved if tuple(t.shape) == (routed, 16)]) == 3

    shape = Shape.of(model_shape(moe_config(balance="none")),
                     Layout(mbs=B, seq_len=S, dtype="fp32" if dtype == torch.float32 else "bf16"))
    if dispatch == "all_to_all":  # the regrouping's index, counted for ep > 1
        shape = dataclasses.replace(shape, ep=2, experts=shape.experts // 2)
    tok, a = B * S, shape.act
    estimate = (tok * h * a  # the layer's input, kept by the router as it came
                + expert.mlp_rows(shape) * shape.f * a * 3  # SwiGLU: gate, up, product
                + sum(expert.routing_saved(shape).values()))
    # Left out by the estimator, neither per routed row nor hidden-wide: the router's
    # renormalising sum (fp32 per token) and the grouped GEMMs' offsets (int32 per expert, 3).
    left_out = tok * 4 + 3 * moe.num_experts * 4
    assert sum(t.untyped_storage().nbytes() for t in saved) == estimate + left_out


def test_the_row_sum_and_the_permutation_have_autograds_backward():
    """gradcheck (a factor wrong in a gradient fails it); the sum keeps only its index."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 5, generator=g, dtype=torch.float64, requires_grad=True)
    token = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2, 1, 0, 2, 3])
    order = torch.randperm(12, generator=g)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(12)
    # In fp64 both are linear: central differences exact but for rounding (gradcheck's defaults).
    assert torch.autograd.gradcheck(lambda r: _SumRows.apply(r, token, 4), (rows,))
    assert torch.autograd.gradcheck(lambda r: _Permute.apply(r, inverse, order), (rows,))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        _SumRows.apply(rows, token, 4)
    assert [t is token for t in kept] == [True]


def _swiglu_reference(gate, up, weight):
    """The weighted SwiGLU as autograd composes it, rounded as `ops.swiglu` says: silu and the
    product in the inputs' dtype, times the weight in fp32, rounded to the inputs' dtype."""
    return ((torch.nn.functional.silu(gate) * up).float() * weight[:, None]).to(gate.dtype)


def test_the_weighted_swiglu_has_autograds_gradients_and_keeps_its_inputs_only(monkeypatch):
    """gradcheck in fp64 (a factor wrong in any of the three gradients fails it), then in fp32
    and bf16 the forward and the gradients equal, bit for bit, to autograd's through the
    reference composition (the same elementwise products in the same dtypes; the weight's
    gradient the same row sums); unweighted, bit-identical to `F.silu(gate) * up`, gradients
    included. It keeps gate, up and the weight (autograd's composition keeps silu(gate), and in
    bf16 fp32 copies, too). The weight's gradient is summed a few rows at a time in bf16 (so
    that its fp32 products stay small): here 2 rows, the same sums."""
    monkeypatch.setattr(swiglu, "ROW_DOT_CHUNK", 2 * 13)
    g = torch.Generator().manual_seed(1)
    shape = (9, 13)
    gate, up = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    weight = torch.rand(shape[0], generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (gate, up, weight)]
    assert torch.autograd.gradcheck(ops.swiglu, leaves)
    assert torch.autograd.gradcheck(ops.swiglu, leaves[:2])
    for dtype in (torch.float32, torch.bfloat16):
        gd, ud = (t.detach().to(dtype).requires_grad_() for t in (gate, up))
        w = weight.detach().float().requires_grad_()
        dy = torch.randn(shape, generator=g).to(dtype)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            got = ops.swiglu(gd, ud, w)
        assert [k is t for k, t in zip(kept, (gd, ud, w))] == [True] * 3 and len(kept) == 3
        for out, ref, inputs in ((got, _swiglu_reference(gd, ud, w), [gd, ud, w]),
                                 (ops.swiglu(gd, ud), torch.nn.functional.silu(gd) * ud,
                                  [gd, ud])):
            assert out.dtype == dtype and torch.equal(out, ref)
            for a, b in zip(torch.autograd.grad(out, inputs, dy),
                            torch.autograd.grad(ref, inputs, dy)):
                assert torch.equal(a, b)
