"""Checkpoint atomicity and pruning, config overrides, LR schedule."""

import json

import pytest
import torch

from ultrascale.checkpoint import CheckpointMeta, find_latest, load_checkpoint, save_checkpoint
from ultrascale.config import ConfigError, build_config, load_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.train.schedule import lr_at


@pytest.fixture(autouse=True)
def single_process_comm():
    comm.set_context(ParallelContext.without_mesh("cpu"))


def meta(step):
    return CheckpointMeta(step, step * 4, 1, {"dp": 1}, {})


def test_save_load_prune_and_ignore_partial(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, meta(step), {"model/w": torch.full((3,), float(step))}, 0,
                        keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    # A save that died before its rename leaves only a dot-prefixed folder: never picked up.
    partial = tmp_path / ".step_00000004.tmp"
    partial.mkdir()
    (partial / "rank_00000.safetensors").write_bytes(b"half")
    latest = find_latest(tmp_path)
    assert latest.name == "step_00000003"
    m, tensors = load_checkpoint(latest, 0, 0)
    assert m.step == 3 and m.consumed_samples == 12
    assert torch.equal(tensors["model/w"], torch.full((3,), 3.0))
    # Nothing in a checkpoint is unpickled: metadata is JSON, tensors safetensors.
    json.loads((latest / "meta.json").read_text())


def test_rng_state_is_restored(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path, meta(1), {}, 0, keep=1)
    expected = torch.rand(3)
    torch.rand(10)
    load_checkpoint(find_latest(tmp_path), 0, 0)
    assert torch.equal(torch.rand(3), expected)


def test_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  lr: 0.01\nparallel:\n  dp: 4\n")
    cfg = load_config(path, ["training.lr=2e-3", "model.tie_embeddings=false"])
    assert cfg.training.lr == 2e-3 and cfg.parallel.dp == 4 and not cfg.model.tie_embeddings
    assert cfg.global_batch_size == cfg.training.micro_batch_size * 4
    # The printed config round-trips.
    again = build_config(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again == cfg
    with pytest.raises(ConfigError, match="section.key=value"):
        build_config(overrides=["training.lr"])


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 1.0, 10, 100, 0.1) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
