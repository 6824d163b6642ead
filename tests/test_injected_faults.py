"""The parity checks fail when the code is wrong: each fault of tests/injected_faults.py, injected
in the ranks of a layout it touches, makes that layout's parity check (tests/parity.py, with the
tolerances its parity tests use) raise, and the effect it has on the checked figure is at least
ten times the check's tolerance:

- a gradient summed twice (dp2, as tests/test_parity_dp.py; dp2 ZeRO-2 with a clip that acts
  on every step, as tests/test_zero_parity.py): the first step's gradient norm and gradients;
- one pipeline stage's gradients doubled (pp2 1F1B, tied embedding, as
  tests/test_pipeline_parity.py): the first step's gradient norm and gradients;
- one rank's all-to-all off by 1e-3 (ep2 with a capacity factor, as
  tests/test_expert_parallel.py's ep2-capacity): the first step's gradients; and the losses,
  norms and weights of the 10 steps.

One spawn of two ranks runs every faulty case; the clean runs of the same layouts are those
parity tests, which pass.
"""

from __future__ import annotations

import copy

import pytest
import torch

from parity import (FIRST_NORM_RTOL, GRAD_RTOL, RANK_FUNCTIONS, TINY, assemble_step_grads,
                    assert_gradients_match, assert_parity, assert_step_grads_match, make_config,
                    merge_gradients, shared, spawn_cases, step_grads_config, train_rank)

MOE = copy.deepcopy(TINY)
MOE["model"].update(num_experts=8, experts_top_k=2, moe_ffn_hidden_size=32, first_k_dense=1,
                    z_loss_coeff=1e-3, capacity_factor=1.0)
ZERO = ["training.grad_clip=0.05", "parallel.bucket_mb=0.05"]
PIPE = ["model.tie_embeddings=true", "parallel.pp_schedule=1f1b", "training.grad_accum_steps=2"]
# name -> (fault, base, layout, one process's overrides for the same global batch)
CASES = {
    "dp2": ("grad_summed_twice", TINY, ["parallel.dp=2", "training.grad_accum_steps=2"],
            ["training.grad_accum_steps=4"]),
    "dp2-zero2": ("grad_summed_twice", TINY, ["parallel.dp=2", "parallel.zero=2"] + ZERO,
                  ["training.grad_accum_steps=2"] + ZERO),
    "pp2": ("stage_grads_doubled", TINY, ["parallel.pp=2"] + PIPE, PIPE),
    "ep2-capacity": ("all_to_all_off", MOE, ["parallel.dp=2", "parallel.ep=2",
                                             "training.grad_accum_steps=2"],
                     ["training.grad_accum_steps=4"]),
}


def _data(base: dict, overrides: list[str]) -> dict:
    return make_config(overrides, base=base).model_dump(mode="json")


def _grads_case(name: str, overrides: list[str]) -> tuple[str, dict]:
    """Expert parallel: the autograd gradients gathered over ep (`grad_rank`); the others: what
    the optimizer receives (`step_grads_rank`: ZeRO's shards), as their parity tests take them."""
    _, base, _, _ = CASES[name]
    if name.startswith("ep"):
        return "grads", _data(base, overrides)
    return "step_grads", step_grads_config(overrides, base=base)


@shared
def faulty() -> dict[str, list]:
    cases = {}
    for name, (fault, base, layout, _) in CASES.items():
        cases[f"train-{name}"] = ("train", _data(base, layout), fault)
        cases[f"grads-{name}"] = (*_grads_case(name, layout), fault)
    return spawn_cases(2, cases)


@shared
def reference(name: str) -> dict:
    _, base, _, one = CASES[name]
    kind, data = _grads_case(name, one)
    return {"train": train_rank(_data(base, one)), "grads": RANK_FUNCTIONS[kind](data)}


def _whole(result: dict, like: dict | None = None) -> dict:
    if "pieces" in result:  # one process's pieces are whole tensors
        like = like or {n: g for n, _, g in result["pieces"]}
        return assemble_step_grads([result], like)
    return result["grads"]


def _check_grads(ref: dict, per_rank: list[dict]) -> None:
    if "pieces" in ref:
        assert_step_grads_match(ref, per_rank)
    else:
        assert_gradients_match(ref, per_rank)


def _grad_effect(ref: dict, per_rank: list[dict]) -> float:
    """The largest difference of a gradient element, over its tensor's largest element."""
    want = _whole(ref)
    got = assemble_step_grads(per_rank, want) if "pieces" in ref else merge_gradients(per_rank)
    return max(float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_each_fault_fails_the_parity_check_of_its_layout(name):
    ref = reference(name)
    trained, grads = faulty()[f"train-{name}"], faulty()[f"grads-{name}"]
    for r in trained:
        with pytest.raises(AssertionError):
            assert_parity(ref["train"], r)
    with pytest.raises(AssertionError):
        _check_grads(ref["grads"], grads)
    # The effect, against the tolerance that must see it.
    assert _grad_effect(ref["grads"], grads) > 10 * GRAD_RTOL
    norm_effect = abs(trained[0]["grad_norms"][0] / ref["train"]["grad_norms"][0] - 1)
    if name != "ep2-capacity":  # a factor: the norm moves by ~100%
        assert norm_effect > 10 * FIRST_NORM_RTOL
    else:  # 1e-3 on what one rank hands over: every step's figures move too
        losses = torch.tensor(trained[0]["losses"]) / torch.tensor(ref["train"]["losses"]) - 1
        assert float(losses.abs().max()) > 1e-5


def test_a_failed_shared_spawn_fails_the_later_tests_at_once():
    """`parity.shared`: the first call's error is raised; later calls fail at once, saying where
    the traceback is, instead of spawning the ranks again (and failing again, slowly)."""
    calls = []

    @shared
    def spawn(world: int) -> None:
        calls.append(world)
        raise RuntimeError("rank 1 failed:\nTraceback ...\nValueError: bad layout")

    with pytest.raises(RuntimeError, match="bad layout"):
        spawn(2)
    with pytest.raises(pytest.fail.Exception, match="failed in an earlier test.*bad layout"):
        spawn(2)
    assert calls == [2]
