"""The memory meters of one training step: `logging.measure_memory` in a real run, and the fake
step (`memory/fake_step.py`), through the same `train/step.py` step.

    meter = StepMeter(rt.module, tracker)        # tracker: an entered AllocationTracker, or None
    outcome = train_step(rt, micro, loss_tokens, grad_clip, lr, meter)
    meter.report()   # {"activations_peak_bytes": ..., "peak_bytes": ..., "peak_parts": {...}}

Without a tracker it measures what autograd saves (`SavedActivationMeter`); with one, also every
storage's life through the step (`memory/tracker.py`): the tracker must have been entered before
the model was built, so that it knows every storage the step finds alive.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ultrascale.memory.measure import SavedActivationMeter, SavedTensor
from ultrascale.memory.tracker import AllocationTracker, owned_parts, parameters_resized


class _MarkingMeter(SavedActivationMeter):
    """The saved-activation meter that also marks each saved storage as activations in the
    tracker (one pack hook does both: only the innermost hooks see a saved tensor)."""

    def __init__(self, module: nn.Module | None, tracker: AllocationTracker | None):
        super().__init__(module)
        self._tracker = tracker

    def _pack(self, t: torch.Tensor):
        if self._tracker is not None and not isinstance(t, nn.Parameter) \
                and t.untyped_storage().nbytes():
            self._tracker.mark(t, "activations")
        if isinstance(t, FakeTensor):  # no data pointer to count by: the tracker counts
            return SavedTensor(t)
        return super()._pack(t)


class StepMeter:
    def __init__(self, module: nn.Module | None, tracker: AllocationTracker | None = None):
        self.tracker = tracker
        self._saved = _MarkingMeter(module, tracker)
        self._peak = None

    @contextmanager
    def forward_backward(self, rt):
        """The step begins: what the runtime holds is marked, the span starts."""
        if self.tracker is not None:
            for flat in parameters_resized(rt.data_parallel):
                self.tracker.watch(flat)
            self.tracker.mark_owned(owned_parts(rt))
            self.tracker.begin()
        self.phase("forward/backward")
        with self._saved:
            yield

    def phase(self, name: str) -> None:
        if self.tracker is not None:
            self.tracker.phase = name

    def before_optimizer_step(self, rt) -> None:
        """The gradients are reduced and clipped: mark them (they are dropped by the step)."""
        if self.tracker is not None:
            self.tracker.mark_owned(owned_parts(rt))
        self.phase("optimizer step")

    def end(self) -> None:
        """The step is over (call it after the loss is known: its reduction is in the step)."""
        if self.tracker is not None:
            self._peak = self.tracker.end()

    @property
    def peak(self):
        """The step's `tracker.Peak` (None without a tracker)."""
        return self._peak

    def report(self) -> dict:
        out = {"activations_peak_bytes": self._saved.peak_bytes}
        if self._peak is not None:
            out.update(peak_bytes=self._peak.total, peak_parts=dict(self._peak.parts),
                       peak_phase=self._peak.phase)
        return out


def step_tracker(cfg):
    """An AllocationTracker to enter for the whole run when `logging.measure_memory` is on and the
    run computes on a CPU (on CUDA the allocator's own peak is reported), else a null context."""
    from ultrascale.distributed.mesh import resolve_device

    if cfg.logging.measure_memory and resolve_device(cfg.device).type == "cpu":
        return AllocationTracker()
    return nullcontext()
