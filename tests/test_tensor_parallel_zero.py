"""Tensor parallel inside data parallel with ZeRO on one mesh (tp innermost): dp2 x tp2 trains
like one process with the same global batch."""

import pytest

from parity import run_layout
from test_tensor_parallel import assert_training_parity


@pytest.fixture(scope="module")
def reference():
    # Global batch of dp x micro_batch_size x grad_accum = 2 x 2 x 1 sequences.
    return run_layout(["training.grad_accum_steps=2"])[0]


@pytest.mark.parametrize("layout", [
    ["parallel.zero=1"],
    ["parallel.zero=3", "parallel.sequence_parallel=true"],
])
def test_dp2_tp2_zero_matches_one_process(reference, layout):
    results = run_layout(["parallel.dp=2", "parallel.tp=2"] + layout)
    for r in results:
        assert_training_parity(reference, r)
