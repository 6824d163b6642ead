"""Checkpoint atomicity, pruning and background saving, the layout-free geometry, the RNG, config
overrides, the LR schedule and how it continues on resume."""

import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ultrascale.checkpoint.index import (coverage_problems, find_latest, load_meta, parse_key,
                                         piece_key)
from ultrascale.checkpoint.state import flat_boxes, local_offset
from ultrascale.checkpoint.store import CheckpointMeta, CheckpointReader, CheckpointWriter
from ultrascale.config import ConfigError, build_config, load_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.train.schedule import LRSchedule, lr_at


@pytest.fixture(autouse=True)
def single_process_comm():
    comm.set_context(ParallelContext.without_mesh("cpu"))


def meta(step):
    schedule = LRSchedule(1e-3, 0, 10, 0.1).as_dict()
    return CheckpointMeta(step, step * 4, 1, {"dp": 1}, {}, schedule, {"w": [3, 2]})


def pieces_of(value: float) -> dict:
    """The value of a [3, 2] tensor "w" in two pieces (rows 0 and 1-2), Adam's step as a scalar."""
    w = torch.arange(6, dtype=torch.float32).view(3, 2) + value
    return {piece_key("param", "w", (0, 0)): w[:1], piece_key("param", "w", (1, 0)): w[1:],
            piece_key("step", "w", ()): torch.tensor(value)}


def test_save_load_prune_and_ignore_partial(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2, rank=0, world_size=1)
    for step in (1, 2, 3):
        writer.save(meta(step), pieces_of(float(step)))
    assert writer.close() == tmp_path / "step_00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    # A save that died before its rename leaves only a dot-prefixed folder: never picked up.
    partial = tmp_path / ".step_00000004.tmp"
    partial.mkdir()
    (partial / "rank_00000.safetensors").write_bytes(b"half")
    latest = find_latest(tmp_path)
    assert latest.name == "step_00000003"
    m = load_meta(latest)
    assert m["step"] == 3 and m["consumed_samples"] == 12 and coverage_problems(m) == []
    # Nothing in a checkpoint is unpickled: metadata is JSON, tensors safetensors.
    assert json.loads((latest / "meta.json").read_text())["tensors"]["w"]["shape"] == [3, 2]
    with CheckpointReader(latest, m) as reader:
        out = torch.zeros(2, 2)  # rows 1-2 of w: the second piece whole
        reader.read_into("w", "param", (1, 0), out)
        assert torch.equal(out, torch.arange(2, 6, dtype=torch.float32).view(2, 2) + 3)
        across = torch.zeros(2, 1)  # column 1 of rows 0-1: a box across both pieces
        reader.read_into("w", "param", (0, 1), across)
        assert across.view(-1).tolist() == [4.0, 6.0]
        assert reader.is_scalar("w", "step") and reader.scalar("w", "step").item() == 3.0
        assert torch.equal(reader.tensor("w"), torch.arange(6, dtype=torch.float32).view(3, 2) + 3)
    # The next save removes the leftover of the killed one.
    writer.save(meta(5), pieces_of(5.0))
    assert not partial.exists()


def test_a_missing_piece_or_file_is_named(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=1, rank=0, world_size=1)
    writer.save(meta(1), pieces_of(1.0))
    path = find_latest(tmp_path)
    m = load_meta(path)
    m["tensors"]["w"]["states"]["param"].pop()
    assert coverage_problems(m) == ["param of w: the pieces hold 2 of its 6 elements (a shard "
                                    "is missing)"]
    with CheckpointReader(path, m) as reader, pytest.raises(ValueError, match="a shard is missing"):
        reader.read_into("w", "param", (0, 0), torch.zeros(3, 2))
    (path / "rank_00000.safetensors").unlink()
    with pytest.raises(ValueError, match="rank_00000.safetensors is missing"):
        load_meta(path)


def test_background_save_commits_at_a_later_poll(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2, rank=0, world_size=1, asynchronous=True)
    live = torch.ones(3, 2)
    writer.save(meta(1), {piece_key("param", "w", (0, 0)): live})
    live.add_(1)  # training goes on: the save holds its own copy
    writer.pending.thread.join()
    assert (tmp_path / ".step_00000001.tmp").is_dir() and find_latest(tmp_path) is None
    writer.poll()
    assert find_latest(tmp_path) == tmp_path / "step_00000001"
    with CheckpointReader(find_latest(tmp_path), load_meta(find_latest(tmp_path))) as reader:
        out = torch.zeros(3, 2)
        reader.read_into("w", "param", (0, 0), out)
    assert torch.equal(out, torch.ones(3, 2))


def test_rng_state_is_restored(tmp_path):
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    writer = CheckpointWriter(tmp_path, keep=1, rank=0, world_size=1)
    writer.save(meta(1), pieces_of(1.0))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(10), random.random(), np.random.rand()
    with CheckpointReader(find_latest(tmp_path), load_meta(find_latest(tmp_path))) as reader:
        reader.restore_rng(rank=3)  # a larger world: rank 3 takes saved rank 3 mod 1's
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_boxes_tile_a_flat_range_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    marks = torch.zeros(shape, dtype=torch.int64)
    flat = start
    boxes = flat_boxes(tuple(shape), start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    for offset, size in boxes:
        region = marks[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        # Each box is the next contiguous run of the range, in flat order.
        index = torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        assert index.reshape(-1).tolist() == list(range(flat, flat + region.numel()))
        region += 1
        flat += region.numel()
    assert flat == stop
    expected = torch.zeros(n, dtype=torch.int64)
    expected[start:stop] = 1
    assert torch.equal(marks.view(-1), expected)


class Mesh:
    """The two questions local_offset asks of a ParallelContext."""

    def __init__(self, **coords_and_sizes: tuple[int, int]):
        self.at = coords_and_sizes

    def size(self, dim: str) -> int:
        return self.at.get(dim, (0, 1))[1]

    def coord(self, dim: str) -> int:
        return self.at.get(dim, (0, 1))[0]


def test_a_slice_is_placed_from_the_placement_and_the_shapes():
    mesh = Mesh(ep=(3, 4), tp=(1, 2))
    # Experts [E, ffn, h] sliced over ep: nothing records the dim, the shapes tell it.
    assert local_offset("w1", (2, 64, 32), (8, 64, 32), ("ep",), mesh, {}) == (6, 0, 0)
    # Sliced over ep and tp: tensor parallel records its dim, ep takes the other.
    assert local_offset("w1", (2, 32, 32), (8, 64, 32), ("ep", "tp"), mesh, {"tp": 1}) == (6, 32, 0)
    # The vocabulary padded to a multiple of tp: rank 1 starts at its padded row.
    assert local_offset("embed.weight", (3, 4), (5, 4), ("tp",), mesh, {"tp": 0}) == (3, 0)
    with pytest.raises(ValueError, match="cannot tell which dims"):
        local_offset("w1", (2, 32, 32), (8, 64, 32), ("ep", "tp"), mesh, {})


def test_an_old_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"step": 3, "world_size": 2}))
    with pytest.raises(ValueError, match="older checkpoint format"):
        load_meta(tmp_path)


def test_piece_keys_round_trip():
    assert parse_key(piece_key("exp_avg", "layers.0.attn.q_proj.weight", (32, 0))) == \
        ("exp_avg", "layers.0.attn.q_proj.weight", (32, 0))
    assert parse_key(piece_key("step", "norm.weight", ())) == ("step", "norm.weight", ())


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


def training(steps: int, warmup: int = 10):
    return build_config({"training": {"steps": steps, "warmup_steps": warmup, "lr": 1.0,
                                      "min_lr_ratio": 0.1}}).training


def test_resume_with_the_same_steps_follows_the_saved_curve_exactly():
    saved = LRSchedule.of(training(100))
    same, how = saved.continue_from(40, training(100))
    assert [same.at(s) for s in range(41, 101)] == [saved.at(s) for s in range(41, 101)]
    assert how == "the schedule continues as saved"


def test_raising_steps_decays_from_the_saved_lr_without_jumping_back_up():
    saved = LRSchedule.of(training(100))
    longer, how = saved.continue_from(60, training(200, warmup=20))  # warm-up default moved too
    assert longer.at(61) < saved.at(60)  # no jump: it keeps decaying
    assert all(a >= b for a, b in zip([longer.at(s) for s in range(60, 200)],
                                      [longer.at(s) for s in range(61, 201)]))
    assert longer.at(200) == pytest.approx(0.1)
    assert f"{saved.at(60):.3g} at step 60" in how and "0.1 at step 200" in how
    # Resumed again with the same total, the re-anchored curve continues exactly.
    again, _ = LRSchedule(**longer.as_dict()).continue_from(120, training(200, warmup=20))
    assert [again.at(s) for s in range(121, 201)] == [longer.at(s) for s in range(121, 201)]
    # Saved during warm-up: the warm-up ends as saved, then the cosine spans the new total.
    early, how = saved.continue_from(5, training(200, warmup=20))
    assert early.at(6) == saved.at(6) and early.at(10) == pytest.approx(1.0)
    assert early.at(200) == pytest.approx(0.1) and "warm-up ends at step 10" in how
