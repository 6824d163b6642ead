"""Resume under ZeRO: each rank checkpoints its own parameter shards and optimizer-state shards;
a fresh run that resumes from step 3 logs exactly the losses of the uninterrupted run. With
context parallel, ZeRO shards over the cp ranks too (dp=1 here: the shards are cp's alone)."""

import pytest

from parity import assert_resumes_exactly


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.zero=1"],
                                    ["parallel.dp=2", "parallel.zero=3"],
                                    ["parallel.dp=1", "parallel.cp=2", "parallel.zero=3"]],
                         ids=["dp2-zero1", "dp2-zero3", "cp2-zero3"])
def test_resume_gives_identical_losses(layout, tmp_path):
    assert_resumes_exactly(layout + ["parallel.bucket_mb=0.05"], tmp_path)
