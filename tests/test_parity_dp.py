"""Plain data parallel: dp = 1, 2, 4 at the same global batch give the same run (tests/parity.py:
losses, gradient norms, final weights), and the same first-step gradients as the optimizer
receives them, every element of every weight within 1e-5 of its tensor's scale."""

import pytest

from parity import (assert_parity, assert_step_grads_match, make_config, run_layout, shared,
                    spawn_cases, step_grads_config, step_grads_rank)


@pytest.fixture(scope="module")
def reference():
    # One process, global batch of 8 sequences as 4 micro-batches of 2.
    return run_layout(["parallel.dp=1", "training.grad_accum_steps=4"])[0]


@shared
def step_grads_reference() -> dict:
    return step_grads_rank(step_grads_config(["training.grad_accum_steps=4"]))


@shared
def runs(dp: int, accum: int) -> dict:
    layout = [f"parallel.dp={dp}", f"training.grad_accum_steps={accum}"]
    return spawn_cases(dp, {"train": ("train", make_config(layout).model_dump(mode="json")),
                            "step_grads": ("step_grads", step_grads_config(layout))})


@pytest.mark.parametrize("dp,accum", [(2, 2), (4, 1)])
def test_dp_matches_one_process(reference, dp, accum):
    for r in runs(dp, accum)["train"]:
        assert_parity(reference, r)


@pytest.mark.parametrize("dp,accum", [(2, 2), (4, 1)])
def test_dp_first_step_gradients_match_one_process(dp, accum):
    assert_step_grads_match(step_grads_reference(), runs(dp, accum)["step_grads"])


def test_loss_decreases(reference):
    assert reference["losses"][-1] < reference["losses"][0]
