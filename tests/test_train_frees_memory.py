"""A finished `train()` leaves no tensor behind: its model, fp32 master weights, gradients and
optimizer state are all freed, so a second run in the same process (a notebook, the GPU suite's
back-to-back runs) starts from an empty device. Gradient hooks are held from C++, where Python's
collector cannot see, so a hook that held its owner strongly would keep all of it alive: the GPU
suite found exactly that on an H200 (after five 1B runs, the next one's peak read 105 GiB instead
of 25: benchmarks/gpu/results/2026-11-27-h200-run1)."""

from __future__ import annotations

import gc

import pytest
import torch

from distributed import run_ranks
from parity import make_config
from ultrascale.parallel.replicated import weak_hook


def _live_tensor_bytes() -> int:
    """Bytes of the real tensors Python can reach (compile's fake tensors hold no memory)."""
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and "Fake" not in type(obj).__name__:
            total += obj.untyped_storage().nbytes()
    return total


def _assert_nothing_left(after: list[int]) -> None:
    """Nothing of a run is left (the model alone is ~300 KB; a leaked run, all its states) and
    nothing grows from one run to the next. A few scalars may come and go with the moment of the
    count: torch's device-mesh cache keeps the mesh's rank list, and with two pytest workers a
    rank once counted 24 bytes after its first run and 8 after its second."""
    assert max(after) < 1024 and after[1] <= after[0] + 64, after


def _train_twice(config_dict: dict) -> list[int]:
    """Live tensor bytes this process holds beyond what it held before, after each of two runs of
    the same config (earlier tests in the same process may hold tensors of their own)."""
    from ultrascale.config import Config
    from ultrascale.train.trainer import train

    cfg = Config.model_validate(config_dict)
    before = _live_tensor_bytes()
    after = []
    for _ in range(2):
        train(cfg, generate_sample=False)
        after.append(_live_tensor_bytes() - before)
    return after


@pytest.mark.parametrize("overrides", [
    ["precision.dtype=fp32"],
    ["precision.dtype=bf16"],  # fp32 masters, filled by gradient hooks
])
def test_one_process_run_frees_its_tensors(overrides):
    cfg = make_config(overrides + ["training.steps=2"])
    _assert_nothing_left(_train_twice(cfg.model_dump(mode="json")))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_run_frees_its_tensors(zero):
    """Data parallel's bucket hooks and ZeRO's sharded masters, on two ranks."""
    cfg = make_config(["parallel.dp=2", f"parallel.zero={zero}", "precision.dtype=bf16",
                       "training.steps=2"])
    for after in run_ranks(2, _train_twice, cfg.model_dump(mode="json")):
        _assert_nothing_left(after)


def test_weak_hook_calls_while_its_owner_lives_and_lets_it_go():
    class Owner:
        def __init__(self):
            self.seen = []

        def on(self, tag, value):
            self.seen.append((tag, value))

    owner = Owner()
    hook = weak_hook(owner.on, "a")
    hook(1)
    assert owner.seen == [("a", 1)]
    seen = owner.seen
    del owner
    gc.collect()
    hook(2)  # the owner is gone: nothing happens, nothing is kept alive
    assert seen == [("a", 1)]
