"""Mixed precision under every layout: bf16 and fp16 (fp32 master weights, fp32 gradient
accumulation, fp16 with dynamic loss scaling) and fp8 (row-wise; block-wise under tp2) for
dp2 x tp2 x pp2 and its parts (dp2, ZeRO-1, ZeRO-3, tp2 with sequence parallel, pp2 with 1F1B and
zero bubble), context parallel
(bf16 ring, fp16 all-gather) and a bf16 mixture of experts under expert parallel, each against
one process in the same precision; fp16's overflow handling on every rank; bf16 and fp16
checkpoints resumed in other layouts (fp32 masters, Adam's state, the expert bias and fp16's loss
scale continue).

Two spawns train every case (one of 2 ranks, one of 8: process start-up dominates on two cores);
6 steps of the tiny parity model, a global batch of 8 sequences.

Tolerances, and why (docs/precision.md has the measurements; `measure_precision_parity.py`
in benchmarks/ prints them). Losses: the largest relative difference of a step's loss. Weights:
per tensor, the distance of the final weights from the reference's over the distance the
reference's weights moved from their (common) initial values, the largest over the tensors: a norm
weight that barely moves is held to its own move, not to its size. Each layout is one of three
kinds:
- `same`: data parallel alone (dp2, ZeRO-1, ZeRO-3) computes each micro-batch as one process
  does; only the grouping of fp32 sums of micro-batch gradients changes (measured: bitwise equal):
  1e-5 in any precision.
- `fp32 sums`: pipeline parallel runs the same low-precision operations as one process; it adds
  the tied embedding's two gradients in fp32 where one process adds them in the compute dtype.
  Measured: bf16 2.6e-5 / 0.2%, fp16 5.1e-6 / 0.05%, fp8 2.0e-4 / 3.0%. The tolerances (about 4x)
  sit below each precision's own effect, the distance of an fp32 run from the reference (bf16
  2.1e-4 / 7.5%, fp16 2.8e-5 / 1.5%, fp8 1.2e-3 / 22%): the negative control
  (`test_an_fp32_run_fails_the_low_precision_checks`) shows an fp32 run failing them.
- `regrouped`: tensor and context parallel split low-precision reductions (a matmul's partial
  sums rounded to the compute dtype before the all-reduce; attention blocks merged), expert
  parallel regroups the experts' rows: the arithmetic itself changes, by about as much as the
  precision does. Measured: bf16 2.0e-4 / 3.9% (tp2-sp, dp2 x tp2 x pp2), 4.8% (the experts'
  down_proj under ep2), fp16 2.4e-5 / 1.3%, fp8 5.5e-4 / 18%, against the precision's own effect
  above: no tolerance passes these layouts and fails an fp32 run (after one step too: tp2-sp's
  bf16 gradients differ from one process's by 0.73% of their norm, fp32's by 0.87%). The
  tolerances (about twice the worst) bound the drift; what these layouts compute is checked in
  fp32 to 1e-5 (their parity tests) and the gradient norm of the first step here (1e-2: a factor
  moves it by 100%).
Weights are compared by norm, not element by element: Adam turns a tiny gradient whose sign is
rounding noise into a full step of lr, so a few elements may differ by up to 2 x lr x steps in
any low precision.
"""

from __future__ import annotations

import json
import math
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from parity import make_config, shared
from precision_ranks import run_cases, train_reporting_scales

STEPS = 6
M = 4  # micro-batches of 2 per step on one process

DTYPES = {
    "bf16": ["precision.dtype=bf16"],
    # A short growth window: the scale doubles twice within the 6 steps (and must agree).
    "fp16": ["precision.dtype=fp16", "precision.loss_scale_window=3"],
    "fp8": ["precision.dtype=fp8", "precision.fp8_recipe=rowwise"],
    # DeepSeek-V3's tiles (1 x 128 activations, 128 x 128 weights) under tensor parallel: a
    # row-parallel layer's 128-wide tiles of the contraction dim are cut at the rank boundary.
    # A CPU's scaled matmul takes tensor- and row-wise scales only: block-wise runs its exact
    # reference (quantise, dequantise, fp32 matmul), the same numerics a GPU's kernel computes.
    "fp8-blockwise": ["precision.dtype=fp8", "precision.fp8_recipe=blockwise",
                      "precision.fp8_emulate=true"],
}
# (losses: relative; weights: each tensor's distance over how far the reference moved, at most)
TOLERANCE = {
    "same": {d: (1e-5, 1e-5) for d in ("bf16", "fp16", "fp8")},
    "fp32 sums": {"bf16": (1e-4, 1e-2), "fp16": (1.5e-5, 3e-3), "fp8": (6e-4, 8e-2)},
    "regrouped": {"bf16": (5e-4, 1e-1), "fp16": (6e-5, 3e-2), "fp8": (1.5e-3, 3.6e-1)},
}
# The first step's gradient norm of a regrouped layout: measured within 3e-4 (bf16, fp16) and
# 4e-3 (fp8, after which the weights part) of one process's.
FIRST_NORM_RTOL = {"bf16": 1e-3, "fp16": 1e-3, "fp8": 1e-2}
# Block-wise FP8 is FP8: its tolerances are row-wise's.
for _table in (*TOLERANCE.values(), FIRST_NORM_RTOL):
    _table["fp8-blockwise"] = _table["fp8"]


def kind(part: str) -> str:
    if part.startswith("dp2") and "tp" not in part and "pp" not in part:
        return "same"
    return "fp32 sums" if part.startswith("pp2") else "regrouped"


PARTS = {  # 2 ranks each
    "dp2": ["parallel.dp=2", "training.grad_accum_steps=2"],
    "dp2-zero1": ["parallel.dp=2", "training.grad_accum_steps=2", "parallel.zero=1"],
    "dp2-zero3": ["parallel.dp=2", "training.grad_accum_steps=2", "parallel.zero=3"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true",
               f"training.grad_accum_steps={M}"],
    "pp2-1f1b": ["parallel.pp=2", f"training.grad_accum_steps={M}"],
    "pp2-zero_bubble": ["parallel.pp=2", f"training.grad_accum_steps={M}",
                        "parallel.pp_schedule=zero_bubble"],
    # fp8 only: without sequence parallel a row-parallel output is all-reduced in place.
    "tp2": ["parallel.tp=2", f"training.grad_accum_steps={M}"],
    # Context parallel, one dtype each: its blocks' core runs in fp32 on a CPU (as one process's
    # attention does) and merges in fp32; what differs is the order of those fp32 sums and the
    # gradients reduced over cp, each rank's computed from half the tokens in the compute dtype.
    "cp2": ["parallel.cp=2", f"training.grad_accum_steps={M}"],
    "cp2-all_gather": ["parallel.cp=2", "parallel.cp_mode=all_gather",
                       f"training.grad_accum_steps={M}"],
}
PART_CASES = [(d, p) for d in ("bf16", "fp16") for p in PARTS if not p.startswith(("tp2", "cp2"))]
PART_CASES += [("bf16", "tp2-sp"), ("fp16", "tp2-sp"), ("bf16", "cp2"),
               ("fp16", "cp2-all_gather"), ("fp8", "dp2-zero3"), ("fp8", "tp2"),
               ("fp8-blockwise", "tp2"),
               ("fp8", "pp2-zero_bubble")]
# A mixture of experts in bf16 (the routed experts' grouped GEMM in bf16, the router's scores
# and the auxiliary-loss-free expert bias in fp32): one process against expert parallel.
MOE = ["model.num_experts=8", "model.experts_top_k=2", "model.moe_ffn_hidden_size=32",
       "model.first_k_dense=1", "model.router=sigmoid", "model.balance=aux_free",
       "model.bias_update_rate=0.01", "precision.dtype=bf16"]
EP2 = ["parallel.dp=2", "parallel.ep=2", "training.grad_accum_steps=2"]
SAVED_AT = 4  # the resume cases start from the checkpoint of this step
THREE_D = {  # 8 ranks: dp2 x tp2 x pp2
    "bf16": ["parallel.zero=1", "parallel.sequence_parallel=true"],
    "fp16": ["parallel.zero=3", "parallel.sequence_parallel=true"],
    "fp8": ["parallel.zero=0", "parallel.sequence_parallel=false"],
}
OVERFLOW = ["precision.dtype=fp16", f"precision.loss_scale_init={2.0 ** 40}", "training.steps=2"]


def _config(*overrides: list[str]) -> dict:
    return make_config([f"training.steps={STEPS}"] + [o for group in overrides for o in group]
                       ).model_dump(mode="json")


def _three_d(extra: list[str]) -> list[str]:
    return ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "training.grad_accum_steps=2",
            *extra]


# Where the resume cases' checkpoints go (removed when the interpreter exits).
_CHECKPOINTS = tempfile.TemporaryDirectory(prefix="ultrascale-precision-")


def _checkpoints() -> Path:
    return Path(_CHECKPOINTS.name)


def _saving(name: str) -> list[str]:
    return [f"checkpoint.dir={_checkpoints() / name}", f"checkpoint.every={SAVED_AT}"]


def _resuming(saved: str, name: str) -> list[str]:
    return [f"checkpoint.resume={_checkpoints() / saved / f'step_{SAVED_AT:08d}'}",
            f"checkpoint.dir={_checkpoints() / name}"]


@shared
def _two_ranks() -> dict:
    cases = {("train", d, p): ("train", _config(DTYPES[d], PARTS[p])) for d, p in PART_CASES}
    # fp16 saved by dp2 ZeRO-1 at step 4, resumed on two pipeline stages (and on one process:
    # test_fp16_resumes_across_layouts_with_its_loss_scale).
    cases[("train", "fp16", "dp2-zero1")] = ("train", _config(
        DTYPES["fp16"], PARTS["dp2-zero1"], _saving("fp16-dp2-zero1")))
    cases["fp16-resume-pp2"] = ("train", _config(DTYPES["fp16"], PARTS["pp2-1f1b"],
                                                 _resuming("fp16-dp2-zero1", "fp16-pp2")))
    _moe_reference()  # its checkpoint of step 4 first
    cases["moe-ep2"] = ("train", _config(MOE, EP2))
    cases["moe-resume-ep2"] = ("train", _config(MOE, EP2, _resuming("moe-one", "moe-ep2")))
    cases["overflow"] = ("train", _config(PARTS["dp2"], OVERFLOW))
    cases["poison"] = ("poison", _config(DTYPES["fp16"], PARTS["dp2"]))
    for p in ("tp2", "pp2-zero_bubble"):
        cases[("inspect", p)] = ("inspect", _config(DTYPES["fp8"], PARTS[p]))
    per_rank = run_ranks(2, run_cases, list(cases.values()), timeout=540.0)
    return {key: [per_rank[r][i] for r in range(2)] for i, key in enumerate(cases)}


@shared
def _eight_ranks() -> dict:
    cases = {d: ("train", _config(DTYPES[d], _three_d(extra))) for d, extra in THREE_D.items()}
    per_rank = run_ranks(8, run_cases, list(cases.values()), timeout=540.0)
    return {key: [per_rank[r][i] for r in range(8)] for i, key in enumerate(cases)}


@contextmanager
def _one_thread():
    """One process on one thread, as each spawned rank runs (and much faster than two threads
    on two cores that other tests share)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@lru_cache(maxsize=None)
def _reference(dtype: str) -> dict:
    with _one_thread():
        return train_reporting_scales(_config(DTYPES[dtype], [f"training.grad_accum_steps={M}"]))


@lru_cache(maxsize=None)
def _moe_reference() -> dict:
    with _one_thread():
        return train_reporting_scales(_config(MOE, [f"training.grad_accum_steps={M}"],
                                              _saving("moe-one")))


@lru_cache(maxsize=None)
def _initial(dtype: str, moe: bool = False) -> dict[str, torch.Tensor]:
    """The weights every run of `dtype` starts from: the model's initial weights in the
    parameters' dtype (the fp32 masters are made from them; fp8 keeps bf16 parameters)."""
    from ultrascale.models.llama import build_model

    cfg = make_config(MOE if moe else [])
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
            "fp8-blockwise": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = build_model(cfg.model, cfg.training.seed)
    return {n: t.to(cast).float() for n, t in model.state_dict().items()}


def precision_distances(ref: dict, got: dict, initial: dict) -> tuple[float, dict[str, float]]:
    """(largest relative difference of a step's loss, per tensor: the distance of the final
    weights from the reference's over the distance the reference's moved from `initial`)."""
    losses, want = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    loss = float(((losses - want).abs() / want.abs()).max())
    weights = {}
    for name, w in ref["state"].items():
        if name.endswith("expert_bias"):  # a buffer that moves by whole steps: _assert_bias
            continue
        weights[name] = float((got["state"][name] - w).norm() / (w - initial[name]).norm())
    return loss, weights


def assert_close_in_precision(ref: dict, got: dict, tol: tuple[float, float], initial: dict,
                              label: str = "") -> None:
    loss_rtol, weight_rtol = tol
    assert ref["state"].keys() == got["state"].keys()
    for name, t in got["state"].items():
        assert t.dtype == torch.float32, name  # the fp32 masters, gathered
    loss, weights = precision_distances(ref, got, initial)
    worst = max(weights, key=weights.get)
    # Printed (pytest -s): the measured figures docs/precision.md quotes.
    print(f"precision parity {label}: losses {loss:.1e}, weights {weights[worst]:.2%} ({worst}); "
          f"tolerance {loss_rtol:.1g} / {weight_rtol:.2g}")
    assert loss <= loss_rtol, f"losses differ by {loss:.2e} > {loss_rtol:.0e}"
    assert weights[worst] <= weight_rtol, \
        f"{worst}: {weights[worst]:.2e} of the reference's move > {weight_rtol:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype,part", PART_CASES, ids=[f"{d}-{p}" for d, p in PART_CASES])
def test_parts_of_3d_match_one_process(dtype, part):
    ref = _reference(dtype)
    for r in _two_ranks()[("train", dtype, part)]:
        assert_close_in_precision(ref, r, TOLERANCE[kind(part)][dtype], _initial(dtype),
                                  f"{dtype} {part}")
        if kind(part) == "regrouped":
            assert r["grad_norms"][0] == pytest.approx(ref["grad_norms"][0],
                                                       rel=FIRST_NORM_RTOL[dtype])
        assert r["loss_scales"] == ref["loss_scales"] and r["skipped"] == ref["skipped"] == []
    if dtype == "fp16":  # the scale grew after each 3 clean steps, the same on every rank
        assert ref["loss_scales"] == [1024.0] * 3 + [2048.0] * 3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(THREE_D))
def test_dp2_tp2_pp2_matches_one_process(dtype):
    ref = _reference(dtype)
    for r in _eight_ranks()[dtype]:
        assert_close_in_precision(ref, r, TOLERANCE["regrouped"][dtype], _initial(dtype),
                                  f"{dtype} dp2 x tp2 x pp2")
        assert r["grad_norms"][0] == pytest.approx(ref["grad_norms"][0],
                                                   rel=FIRST_NORM_RTOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_an_fp32_run_fails_the_low_precision_checks(dtype):
    """The negative control: one process in fp32 on the same batch fails the `same` and
    `fp32 sums` checks of bf16 and fp8, by the precision's own effect (and passes none of them by
    a narrow margin: its effect is at least twice each tolerance)."""
    ref = _reference(dtype)
    fp32 = _fp32_run()
    loss, weights = precision_distances(ref, fp32, _initial(dtype))
    print(f"precision parity: fp32 against {dtype}: losses {loss:.1e}, weights "
          f"{max(weights.values()):.2%}")
    for k in ("same", "fp32 sums"):
        with pytest.raises(AssertionError):
            assert_close_in_precision(ref, fp32, TOLERANCE[k][dtype], _initial(dtype))
    loss_tol, weight_tol = TOLERANCE["fp32 sums"][dtype]
    assert max(loss / loss_tol, max(weights.values()) / weight_tol) > 2


@lru_cache(maxsize=None)
def _fp32_run() -> dict:
    with _one_thread():
        return train_reporting_scales(_config(["precision.dtype=fp32"],
                                              [f"training.grad_accum_steps={M}"]))


def _initial_weights(fp16: bool = True) -> dict[str, torch.Tensor]:
    from ultrascale.models.llama import build_model

    cfg = make_config([])
    model = build_model(cfg.model, cfg.training.seed)
    return {n: (t.half() if fp16 else t).float() for n, t in model.state_dict().items()}


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_halves_the_scale_and_changes_no_weight():
    """A loss scale of 2^40 overflows fp16's gradients (65504 at most): each step is skipped on
    every rank, the scale halves each time, and the weights stay the initial ones (rounded to
    fp16, as the run starts from them)."""
    initial = _initial_weights()
    for r in _two_ranks()["overflow"]:
        assert r["skipped"] == [1, 2]
        assert r["loss_scales"] == [2.0 ** 40, 2.0 ** 39]
        for name, w in initial.items():
            assert torch.equal(r["state"][name], w), name


@pytest.mark.slow
def test_an_overflow_on_one_rank_is_skipped_by_every_rank():
    """Only rank 0's gradient holds an inf; the gradient norm's all-reduce over the world tells
    rank 1 too: both skip, halve the scale, and keep weights and optimizer state."""
    for r in _two_ranks()["poison"]:
        assert r["stepped"] is False and not math.isfinite(r["norm"])
        assert r["scale_after"] == r["scale_before"] / 2 and r["skipped"] == 1
        assert r["weights_unchanged"] and r["params_follow_masters"]
        assert r["optimizer_state"] == 0  # no Adam step was taken


@pytest.mark.slow
@pytest.mark.parametrize("part", ["tp2", "pp2-zero_bubble"])
def test_fp8_reaches_every_linear_of_the_blocks(part):
    """Tensor parallel's column/row matmuls and zero bubble's deferred linears use the layers'
    FP8 matmuls; parameters are bf16."""
    for r in _two_ranks()[("inspect", part)]:
        assert r["param_dtypes"] == ["torch.bfloat16"]
        blocks = {n: v for n, v in r["linears"].items() if n.startswith("layers.")}
        assert len(blocks) == 7 * (2 if part.startswith("pp2") else 4)  # q k v o gate up down
        matmul = "DeferredMatmul(Fp8Matmul)" if part == "pp2-zero_bubble" else "Fp8Matmul"
        assert set(blocks.values()) == {("Linear", matmul)}


@pytest.mark.slow
def test_fp16_resumes_across_layouts_with_its_loss_scale():
    """fp16 saved by dp2 ZeRO-1 at step 4 (its fp32 master shards, Adam's state and the loss
    scaler in meta.json) resumes on one process exactly as the run that saved it goes on (data
    parallel alone computes the same numbers: the `same` tolerance), and on two pipeline stages
    within fp16's tolerance. The scale continues: 2048 at steps 5 and 6, one clean step already
    counted before the save, so both end with the scale doubled to 4096 as the saving run did."""
    ref = _reference("fp16")
    saver = _two_ranks()[("train", "fp16", "dp2-zero1")]
    saved = json.loads((_checkpoints() / "fp16-dp2-zero1" / f"step_{SAVED_AT:08d}" /
                        "meta.json").read_text())
    assert saved["loss_scaler"] == {"scale": 2048.0, "clean_steps": 1, "skipped_steps": 0}
    with _one_thread():
        one = train_reporting_scales(_config(DTYPES["fp16"], [f"training.grad_accum_steps={M}"],
                                             _resuming("fp16-dp2-zero1", "fp16-one")))
    tail = {"losses": ref["losses"][SAVED_AT:], "state": ref["state"]}
    same, initial = TOLERANCE["same"]["fp16"], _initial("fp16")
    assert_close_in_precision(tail, one, same, initial, "fp16 resumed on one process")
    assert_close_in_precision({"losses": saver[0]["losses"][SAVED_AT:],
                               "state": saver[0]["state"]}, one, same, initial)
    for r in _two_ranks()["fp16-resume-pp2"]:
        assert_close_in_precision(tail, r, TOLERANCE["fp32 sums"]["fp16"], initial,
                                  "fp16 resumed on pp2")
    for run in ("fp16-dp2-zero1", "fp16-one", "fp16-pp2"):
        final = json.loads((_checkpoints() / run / f"step_{STEPS:08d}" / "meta.json").read_text())
        assert final["loss_scaler"] == {"scale": 4096.0, "clean_steps": 0, "skipped_steps": 0}
    for r in [one, *_two_ranks()["fp16-resume-pp2"]]:
        assert r["loss_scales"] == ref["loss_scales"][SAVED_AT:] == [2048.0, 2048.0]


def _expert_bias(state: dict) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if n.endswith("expert_bias")}


def _assert_bias(ref: dict, got: dict, rate: float = 0.01) -> None:
    """The aux-free bias moves each step by +-rate or 0 (the sign of mean load - load): it stays
    fp32 on the lattice of whole steps (bf16 would round 0.03 to 0.0300293), within STEPS steps
    of 0, and within one sign flip (2 x rate) of the reference per element. A flip is bf16's
    noise, not an error: when an expert's load sits at the mean, one token routed otherwise
    flips the step's sign; one process regrouping its own batch into micro-batches of 1 moves 3
    of the 24 elements by 0.02 after 6 steps (measured: 2026-11-27)."""
    for name, bias in _expert_bias(ref["state"]).items():
        b = got["state"][name]
        assert b.dtype == torch.float32
        steps = b / rate
        assert torch.allclose(steps, steps.round(), atol=1e-4), (name, b)
        assert float(steps.abs().max()) <= STEPS + 1e-4
        torch.testing.assert_close(b, bias, rtol=0, atol=2 * rate + 1e-6)


@pytest.mark.slow
def test_bf16_experts_match_one_process_and_resume_across_layouts():
    """A bf16 mixture of experts (sigmoid router, aux-free bias) under expert parallel against one
    process, and one process's checkpoint of step 4 resumed under expert parallel: both within
    bf16's tolerance of the uninterrupted one-process run. The expert bias stays fp32 (a step of
    0.01 would be lost to bf16's rounding near 1), saved and restored with the weights."""
    ref = _moe_reference()
    _assert_bias(ref, ref)
    tail = {"losses": ref["losses"][SAVED_AT:], "state": ref["state"]}
    for key, want in (("moe-ep2", ref), ("moe-resume-ep2", tail)):
        for r in _two_ranks()[key]:
            assert_close_in_precision(want, r, TOLERANCE["regrouped"]["bf16"],
                                      _initial("bf16", moe=True), f"bf16 experts {key}")
            _assert_bias(ref, r)
