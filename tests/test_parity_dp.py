"""Plain data parallel: dp = 1, 2, 4 at the same global batch give the same run."""

import pytest

from parity import assert_parity, run_layout


@pytest.fixture(scope="module")
def reference():
    # One process, global batch of 8 sequences as 4 micro-batches of 2.
    return run_layout(["parallel.dp=1", "training.grad_accum_steps=4"])[0]


@pytest.mark.parametrize("dp,accum", [(2, 2), (4, 1)])
def test_dp_matches_one_process(reference, dp, accum):
    results = run_layout([f"parallel.dp={dp}", f"training.grad_accum_steps={accum}"])
    for r in results:
        assert_parity(reference, r)


def test_loss_decreases(reference):
    assert reference["losses"][-1] < reference["losses"][0]
