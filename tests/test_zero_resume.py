"""Resume under ZeRO: each rank checkpoints its own parameter shards and optimizer-state shards;
a fresh run that resumes from step 3 logs exactly the losses of the uninterrupted run. With
context parallel, ZeRO shards over the cp ranks too (dp=1 here: the shards are cp's alone)."""

import shutil

import pytest

from parity import run_layout


@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.zero=1"],
                                    ["parallel.dp=2", "parallel.zero=3"],
                                    ["parallel.dp=1", "parallel.cp=2", "parallel.zero=3"]],
                         ids=["dp2-zero1", "dp2-zero3", "cp2-zero3"])
def test_resume_gives_identical_losses(layout, tmp_path):
    layout = layout + ["training.steps=6", "parallel.bucket_mb=0.05", f"checkpoint.dir={tmp_path}",
                       "checkpoint.every=3"]
    full = run_layout(layout)
    assert (tmp_path / "step_00000003").is_dir()
    # The run ended at step 6 and wrote it; remove it so resume=auto starts from step 3.
    shutil.rmtree(tmp_path / "step_00000006")
    resumed = run_layout(layout + ["checkpoint.resume=auto"])
    for f, r in zip(full, resumed):
        assert r["losses"] == f["losses"][3:]
        for name, t in f["state"].items():
            assert r["state"][name].equal(t), name
