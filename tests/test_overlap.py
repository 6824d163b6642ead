"""DualPipeV's paired forward and backward (parallel/overlap.py) run in two threads: the helper
thread must compute under the caller's dispatch modes, or `ultrascale memory --measure` (fake
tensors) fails on a real tensor and a memory tracker misses the backward's allocations."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ultrascale.parallel.overlap import Turns


class _Count(TorchDispatchMode):
    """Counts the ops it sees, by thread name."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import threading
        self.seen.append(threading.current_thread().name)
        return func(*args, **(kwargs or {}))


def test_the_helper_runs_under_the_callers_modes():
    count = _Count()
    with FakeTensorMode(), count:
        stack = _get_current_dispatch_mode_stack()
        made = Turns().run(lambda: torch.ones(4) * 2, lambda: made_by_helper.append(torch.ones(3) + 1))
        assert _get_current_dispatch_mode_stack() == stack  # the caller's stack untouched
    assert isinstance(made, FakeTensor)
    assert len(made_by_helper) == 1 and isinstance(made_by_helper[0], FakeTensor)
    assert "overlap-backward" in count.seen  # the helper's ops were counted too
    # Outside the modes, neither side makes fake tensors (nothing leaked into the next pairing).
    made_by_helper.clear()
    made = Turns().run(lambda: torch.ones(2), lambda: made_by_helper.append(torch.ones(2)))
    assert not isinstance(made, FakeTensor) and not isinstance(made_by_helper[0], FakeTensor)


made_by_helper: list[torch.Tensor] = []


@pytest.mark.slow
def test_measure_runs_dualpipev_with_expert_parallel():
    """The paired chunks overlap their expert all-to-alls only under ep: `memory --measure` of that
    layout (which failed on the helper's real tensors) measures, within 5% of the estimate (the
    grid's median target, docs/memory.md)."""
    out = subprocess.run(
        [sys.executable, "-m", "ultrascale.cli", "memory", "--preset", "tiny-moe", "--dp", "2",
         "--pp", "2", "--ep", "2", "--pp-schedule", "dualpipev", "--seq-len", "128", "--mbs", "2",
         "--grad-accum", "4", "--measure", "--json"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    measured, estimated = report["measured"]["total"], report["total"]
    assert abs(estimated - measured) / measured <= 0.05, (estimated, measured)
