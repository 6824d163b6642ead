"""The fused optimizer path (parallel/flat.py: flat gradient buffers, the fp64-accumulated
multi-tensor norm, the clip on the device, torch's fused AdamW, the multi-tensor refresh) against
the path it replaced, kept as `training.optimizer_impl=per_tensor`, in each layout: the same
losses, gradient norms and weights over 10 fp32 steps.

per_tensor is the old path numerically: its runs here equal, bit for bit, the runs of the commit
before the flat buffers (checked when this was written: the flat buffers, the copy-in of a step's
first gradient and the device-side clip change no number). The fused AdamW rounds differently from
torch's for-loop one: a weight may end a step one ulp apart (1.2e-7 at the norm weights' ~1.0),
and the next steps' gradients then differ by what such a perturbation moves them. The
tolerances below follow from that, and sit far below a real fault (`test_tolerance_catches_a_
dropped_clip`)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from parity import make_config, train_rank

# Relative, on the losses and norms; absolute on the weights (|w| <= ~1, so 1e-6 is ~8 ulps of the
# largest). Measured worst over the layouts below (this machine, AVX-512 kernels): losses 1.0e-7,
# weights 1.2e-7 (one ulp at 1.0), norms 8.2e-7 (pp2, step 10). The first step's norm is computed
# from the same gradients by the same fp64 reduction in both paths: 1e-15 apart (FIRST_NORM_RTOL).
# The runs use lr 1e-3, not TINY's 3e-3: at 3e-3 step 10 is a loss spike (the norm jumps tenfold,
# to 22), where the one-ulp weight differences move the gradient norm by up to 7.6e-5: that
# measures the spike's sensitivity, not the path.
LOSS_RTOL, WEIGHT_ATOL, NORM_RTOL, FIRST_NORM_RTOL = 1e-6, 1e-6, 2e-6, 1e-12
LR = "training.lr=1e-3"

TWO_RANKS = {
    "dp2-zero0": ["parallel.dp=2"],
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2", "training.grad_accum_steps=2"],
    "dp2-zero1-muon": ["parallel.dp=2", "parallel.zero=1", "training.optimizer=muon"],
}
ONE_RANK = {"dp1": [], "dp1-muon": ["training.optimizer=muon"]}
IMPLS = ("fused", "per_tensor")


def _dicts(layouts: dict) -> list[dict]:
    return [make_config(o + [LR, f"training.optimizer_impl={impl}"]).model_dump(mode="json")
            for o in layouts.values() for impl in IMPLS]


def train_each(config_dicts: list[dict]) -> list[dict]:
    """In each rank: train every config in turn."""
    return [train_rank(d) for d in config_dicts]


def assert_same_training(fused: dict, reference: dict) -> None:
    assert fused["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=FIRST_NORM_RTOL)
    torch.testing.assert_close(torch.tensor(fused["losses"], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=0.0)
    torch.testing.assert_close(torch.tensor(fused["grad_norms"], dtype=torch.float64),
                               torch.tensor(reference["grad_norms"], dtype=torch.float64),
                               rtol=NORM_RTOL, atol=0.0)
    for name, ref in reference["state"].items():
        torch.testing.assert_close(fused["state"][name], ref, rtol=0.0, atol=WEIGHT_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def one_rank() -> dict:
    runs = train_each(_dicts(ONE_RANK))
    return {name: runs[2 * i:2 * i + 2] for i, name in enumerate(ONE_RANK)}


@pytest.mark.parametrize("layout", list(ONE_RANK))
def test_fused_path_matches_the_reference_on_one_rank(one_rank, layout):
    fused, reference = one_rank[layout]
    assert min(reference["grad_norms"]) > 1.0  # the clip (1.0) acts on every step
    assert_same_training(fused, reference)


@pytest.mark.slow
def test_fused_path_matches_the_reference_in_each_layout():
    """One spawn of two ranks trains every layout both ways."""
    ranks = run_ranks(2, train_each, _dicts(TWO_RANKS))
    for i, name in enumerate(TWO_RANKS):
        for rank in ranks:
            fused, reference = rank[2 * i], rank[2 * i + 1]
            try:
                assert_same_training(fused, reference)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None


def test_tolerance_catches_a_dropped_clip(one_rank, monkeypatch):
    """The fault the tolerances must see: the fused step ignoring the clip coefficient (the
    gradients stepped unclipped). Adam is nearly scale-free, so this moves only what eps and the
    moments' mixing of steps feel: the comparison must still fail."""
    import ultrascale.parallel.replicated as replicated

    real = replicated.apply_coefficient
    monkeypatch.setattr(replicated, "apply_coefficient",
                        lambda opt, grads, coef, impl: real(opt, grads, None, impl))
    broken = train_rank(_dicts({"dp1": []})[0])
    with pytest.raises(AssertionError):
        assert_same_training(broken, one_rank["dp1"][1])


def test_cpu_norm_pieces_sum_each_square_in_fp64():
    """On a CPU the fused norm sums 1M-element pieces by fp64 dots (flat._cpu_sq_sum): the same
    squared sum as every element cast to fp64 (per_tensor), to fp64 round-off, across a tensor
    longer than a piece; weighted by the copies (measured: 7e-16 apart; fp32 sums: 9e-8)."""
    from ultrascale.parallel.flat import CPU_PIECE, GradSqSum

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(CPU_PIECE * 2 + 12345, generator=gen) * 1e-3,
             torch.randn(64, 48, generator=gen), torch.randn(7, generator=gen)]
    copies = [1, 2, 4]
    fused = GradSqSum(copies, "fused", torch.device("cpu"))(grads)
    reference = GradSqSum(copies, "per_tensor", torch.device("cpu"))(grads)
    assert fused.dtype == torch.float64
    assert abs(fused.item() - reference.item()) <= 1e-13 * reference.item()
    fp32 = sum(g.square().sum() / n for g, n in zip(grads, copies)).item()
    assert abs(fp32 - reference.item()) > 1e3 * abs(fused.item() - reference.item())


def test_unit_coefficient_skips_the_cpu_kernels_division():
    """A coefficient of exactly 1 on a CPU hands the fused AdamW no `grad_scale` (its division
    writes every gradient back: a second pass), any other the reciprocal, as on a GPU."""
    from ultrascale.parallel.flat import apply_coefficient

    class Optimizer:
        grad_scale = "unset"

    opt = Optimizer()
    apply_coefficient(opt, [], torch.ones((), dtype=torch.float64), "fused")
    assert opt.grad_scale is None
    apply_coefficient(opt, [], torch.tensor(0.5, dtype=torch.float64), "fused")
    assert opt.grad_scale.dtype == torch.float32 and opt.grad_scale.item() == 2.0
