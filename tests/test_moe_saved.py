"""What one MoE layer keeps for backward (issue 45): each routed row at most twice, going into the
experts and coming out of them, both in the compute dtype (the weighted combine keeps no fp32
copy, expert parallel's regrouping none at all), counted by the estimator
(theory/expert.py `routing_saved`, theory/block.py); and the two autograd functions that make it
so (`_WeightedSum`, `_Permute`) against autograd's own backward."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from test_moe import moe_config, moe_layer
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.layout import Layout
from ultrascale.models.moe import _WeightedSum
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
def test_one_moe_layer_keeps_each_routed_row_twice_in_the_compute_dtype(dtype, dispatch):
    moe = moe_layer(balance="none").to(dtype)
    if dispatch == "all_to_all":  # expert parallel's dispatcher, its exchange of one rank a copy
        comm.set_context(ParallelContext.without_mesh())
        moe.dispatcher = AllToAllDispatcher(1, moe.num_experts)
    x = torch.randn(B, S, 32, dtype=dtype, requires_grad=True)
    saved = _saved(moe, x)
    routed, h = B * S * moe.top_k, 32
    rows = [t for t in saved if tuple(t.shape) == (routed, h)]
    # Before: the combine kept an fp32 copy of each output row in bf16 (`rows.float() * w`), and
    # expert parallel's regrouping (`index_copy`) the output rows once more.
    assert len(rows) == 2 and all(t.dtype == dtype for t in rows)

    shape = Shape.of(model_shape(moe_config(balance="none")),
                     Layout(mbs=B, seq_len=S, dtype="fp32" if dtype == torch.float32 else "bf16"))
    if dispatch == "all_to_all":  # the regrouping's index, counted for ep > 1
        shape = dataclasses.replace(shape, ep=2, experts=shape.experts // 2)
    tok, a = B * S, shape.act
    estimate = (tok * h * a  # the layer's input, kept by the router as it came
                + expert.mlp_rows(shape) * shape.f * a * 4  # SwiGLU: gate, up, silu, product
                + sum(expert.routing_saved(shape).values()))
    # Left out by the estimator, neither per routed row nor hidden-wide: the router's
    # renormalising sum (fp32 per token) and the grouped GEMMs' offsets (int32 per expert, 3).
    left_out = tok * 4 + 3 * moe.num_experts * 4
    assert sum(t.untyped_storage().nbytes() for t in saved) == estimate + left_out


def test_the_weighted_sum_and_the_permutation_have_autograds_backward():
    """gradcheck (a factor wrong in either gradient fails it), and in bf16 the forward
    bit-identical to `(rows.float() * w).to(bf16)` summed per token, the gradients equal to
    autograd's through that composition."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 5, generator=g, requires_grad=True)
    weight = torch.rand(12, generator=g, requires_grad=True)
    token = torch.tensor([0, 3, 1, 1, 2, 0, 3, 2, 1, 0, 2, 3])
    # In fp32, as the products are taken: both functions are linear in each input, so central
    # differences are exact but for rounding, about 1e-7 / eps of outputs of order 1 (1e-5 here),
    # far below a factor wrong (100%).
    close = dict(eps=1e-2, atol=1e-3, rtol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # gradcheck's advice to use fp64
        assert torch.autograd.gradcheck(lambda r, w: _WeightedSum.apply(r, w, token, 4),
                                        (rows, weight), **close)
        order = torch.randperm(12, generator=g)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(12)
        assert torch.autograd.gradcheck(lambda r: _Permute.apply(r, inverse, order), (rows,),
                                        **close)

    rows16 = rows.detach().to(torch.bfloat16).requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    upstream = torch.randn(4, 5, generator=g).to(torch.bfloat16)
    got = _WeightedSum.apply(rows16, w32, token, 4)
    ref = torch.zeros(4, 5, dtype=torch.bfloat16).index_add(
        0, token, (rows16.float() * w32.unsqueeze(1)).to(torch.bfloat16))
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, [rows16, w32], upstream),
                    torch.autograd.grad(ref, [rows16, w32], upstream)):
        # the same products, summed over the 5 columns in one order or another (fp32)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
