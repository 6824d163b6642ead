"""Learning rate: linear warm-up from 0, then cosine decay to min_lr_ratio x lr.

A run resumed with another `training.steps` does not jump back up the curve: `continue_from`
keeps the saved warm-up and, past it, restarts the cosine's decay from the learning rate the saved
step had reached (the anchor), so that it reaches min_lr_ratio x lr at the new last step. The
anchor is saved with each checkpoint, so that resuming again continues the same curve exactly.
Torch-free (the launcher says how the schedule continues before any process starts).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """`step` counts from 1 (the first optimizer step)."""
    if warmup and step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_ratio + (1 - min_ratio) * cosine)


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    warmup: int
    total: int
    min_ratio: float
    # Set when a resume changed the total after the warm-up: the cosine decays from anchor_lr at
    # anchor_step to min_ratio x lr at `total`.
    anchor_step: int = 0
    anchor_lr: float | None = None

    @classmethod
    def of(cls, training) -> "LRSchedule":
        """The schedule of a `TrainingConfig` (a fresh run)."""
        return cls(training.lr, training.warmup_steps, training.steps, training.min_lr_ratio)

    def at(self, step: int) -> float:
        if self.anchor_lr is None or step <= self.anchor_step:
            return lr_at(step, self.lr, self.warmup, self.total, self.min_ratio)
        low = self.lr * self.min_ratio
        progress = (step - self.anchor_step) / max(1, self.total - self.anchor_step)
        return low + (self.anchor_lr - low) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def continue_from(self, step: int, training) -> tuple["LRSchedule", str]:
        """The schedule a run resumed at `step` (saved with this schedule) follows under the
        `TrainingConfig` `training`, and one phrase saying how it continues."""
        wanted = LRSchedule.of(training)
        if wanted.total == self.total:
            # Same length: the saved curve (an anchor included), with the peak and the floor
            # given now (the one-line summary names them when they changed).
            return replace(wanted, anchor_step=self.anchor_step, anchor_lr=self.anchor_lr), \
                "the schedule continues as saved"
        end = f"{wanted.lr * wanted.min_ratio:.3g} at step {wanted.total}"
        if step < self.warmup:
            new = replace(wanted, warmup=self.warmup)
            return new, (f"training.steps {self.total} -> {wanted.total}: the warm-up ends at step "
                         f"{self.warmup} as saved, then the cosine decays over the new total to "
                         f"{end}")
        here = self.at(step)
        new = replace(wanted, warmup=self.warmup, anchor_step=step, anchor_lr=here)
        if here <= wanted.lr * wanted.min_ratio * (1 + 1e-9):
            return new, (f"training.steps {self.total} -> {wanted.total}: the lr stays at the "
                         f"floor {here:.3g} the saved run had decayed to (no jump back up)")
        return new, (f"training.steps {self.total} -> {wanted.total}: the cosine decays from the "
                     f"saved lr {here:.3g} at step {step} to {end} (no jump back up)")

    def as_dict(self) -> dict:
        return asdict(self)
