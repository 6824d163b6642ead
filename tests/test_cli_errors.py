"""Invalid input is refused before any work: one paragraph naming the key, the value and the fix,
a non-zero exit, and no Python traceback."""

import sys

import pytest

from cli_helpers import FAST, ultrascale


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("override,needles", [
    ("training.lrr=0.1", ["training.lrr", "Did you mean `training.lr`"]),
    ("parallel.tp=3", ["parallel.tp=3", "num_heads=4", "Choose tp among [1, 2, 4]"]),
    ("training.lr=-1", ["training.lr", "greater than 0"]),
    ("data.source=/nonexistent/corpus.txt", ["data.source='/nonexistent/corpus.txt'",
                                             "does not exist"]),
    ("parallel.pp=3", ["parallel.pp=3", "model.num_layers=4"]),
    ("model.preset=gpt5", ["model.preset='gpt5'", "tiny"]),
])
def test_invalid_config_is_refused(tmp_path, override, needles):
    proc = ultrascale("train", *FAST, "--set", override, cwd=tmp_path, timeout=60)
    assert_clean_error(proc, *needles)
    assert proc.returncode == 2
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_missing_config_file(tmp_path):
    proc = ultrascale("train", "nope.yaml", cwd=tmp_path, timeout=60)
    assert_clean_error(proc, "nope.yaml", "does not exist")


def test_world_size_mismatch_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=1", "-m", "ultrascale.cli"]
    proc = ultrascale("train", *FAST, "--set", "parallel.dp=2", cwd=tmp_path, launcher=torchrun,
                      timeout=120)
    assert proc.returncode != 0
    assert "started 1 process(es) but the layout needs" in proc.stderr
    # torchrun's own process reports the failed child with a traceback of its own frames; ours
    # must not appear in it: the rank said what is wrong in one paragraph and exited.
    assert "ultrascale/" not in "".join(l for l in proc.stderr.splitlines(True)
                                        if l.strip().startswith("File "))


def test_a_layout_the_mesh_cannot_carve_is_refused(tmp_path):
    proc = ultrascale("train", *FAST, "--set", "model.preset=tiny-moe", "--set", "parallel.dp=6",
                      "--set", "parallel.ep=2", "--set", "parallel.dp_shard=3",
                      cwd=tmp_path, timeout=60)
    assert_clean_error(proc, "parallel.ep=2 must divide parallel.dp_shard=3",
                       "expert-parallel ranks lie inside one shard group", "Choose ep among")
