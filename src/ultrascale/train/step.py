"""One optimizer step of a runtime: what the trainer runs each step, and what `ultrascale memory
--measure` runs on fake tensors (memory/fake_step.py), so that both measure the same step."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ultrascale.memory.step_meter import StepMeter


@dataclass
class StepOutcome:
    loss_sum: torch.Tensor  # this rank's summed token loss (Runtime.global_loss sums the ranks')
    grad_norm: torch.Tensor | float  # a device tensor where the runtime keeps it there
    stepped: bool  # False: skipped for an fp16 overflow


def train_step(rt, micro_batches: list[tuple], loss_tokens: int, grad_clip: float | None,
               lr: float, meter: StepMeter | None = None, after_backward=None) -> StepOutcome:
    """Forward and backward every micro-batch (the loss scaled by 1 / the global batch's loss
    tokens), reduce and clip the gradients, step the optimizer; `meter` sees each phase;
    `after_backward()` runs between the backward and the reduction (the next batch's copy)."""
    with meter.forward_backward(rt) if meter is not None else nullcontext():
        loss_sum = rt.forward_backward(micro_batches, 1.0 / loss_tokens)
    if after_backward is not None:
        after_backward()
    if meter is not None:
        meter.phase("gradients")
    rt.finish_gradients()
    grad_norm = rt.clip_grad_norm(grad_clip)
    if meter is not None:
        meter.before_optimizer_step(rt)
    stepped = rt.optimizer_step(lr)
    return StepOutcome(loss_sum, grad_norm, stepped)
