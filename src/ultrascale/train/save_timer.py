"""checkpoint.every_minutes: a save when enough time has passed, at the same step on every rank.

Each rank's clock reads differently, and a rank that saved alone would leave the others waiting
in the checkpoint's barrier. So rank 0's clock decides, after each step, and a 4-byte broadcast
(through comm.py, counted as broadcast/world) tells the others: every rank saves after the same
step, and all restart their wait from there.
"""

from __future__ import annotations

import time

import torch

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext


class SaveTimer:
    def __init__(self, minutes: float | None, ctx: ParallelContext):
        self.seconds = minutes * 60.0 if minutes else None
        self.device = ctx.device
        self.last = time.monotonic()

    def due(self) -> bool:
        """Whether to save after this step: collective (every rank calls it after each step)."""
        if self.seconds is None:
            return False
        late = time.monotonic() - self.last >= self.seconds
        flag = torch.tensor([1 if late else 0], dtype=torch.int32, device=self.device)
        comm.broadcast(flag, "world", 0, tag="checkpoint.every_minutes")
        return bool(flag.item())

    def saved(self) -> None:
        self.last = time.monotonic()
