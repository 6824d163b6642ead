"""The runtime's part for multi-token prediction (models/mtp.py).

- Each micro-batch brings the targets of every depth (`future`), made from the whole sequence
  before `prepare` splits it (a context-parallel rank's positions are not contiguous, and the
  tokens ahead of its last ones are another rank's).
- Each step the MTP losses' gradient scale is set (the step's loss scale x mtp_loss_weight / D,
  fp16's dynamic scale included) and their records reset; after the step, the per-depth sums are
  all-reduced over every rank once (the last pipeline stage holds them, the tp ranks each hold the
  whole value, as the main loss), for the metrics: `mtp_loss` (their mean over the depths, what
  the weight multiplies) and `mtp_loss_per_depth`, per token of the global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.mtp import future_targets


class MultiTokenLosses:
    def __init__(self, module: nn.Module, ctx: ParallelContext, depth: int, weight: float):
        self.module, self.ctx = module, ctx
        self.depth, self.weight = depth, weight
        self.sums: torch.Tensor | None = None  # the last step's, summed over the ranks

    def future(self, targets: torch.Tensor) -> torch.Tensor:
        return future_targets(targets, self.depth)

    def begin_step(self, loss_scale: float) -> None:
        mtp = self.module.mtp  # None on a pipeline stage without the head
        if mtp is not None:
            mtp.loss_scale = loss_scale * self.weight / self.depth
            mtp.reset()

    def after_step(self) -> None:
        sums = torch.zeros(self.depth, dtype=torch.float64, device=self.ctx.device)
        mtp = self.module.mtp
        if mtp is not None:
            for k, s in enumerate(mtp.loss_sums):
                sums[k] = s
        if self.ctx.world_size > 1:
            comm.all_reduce(sums, "world", tag="mtp_loss")
        self.sums = sums / self.ctx.size("tp")

    def metrics(self, tokens: int) -> dict | None:
        if self.sums is None:
            return None
        per_depth = (self.sums / tokens).tolist()
        return {"mtp_loss": sum(per_depth) / self.depth, "mtp_loss_per_depth": per_depth}


def multi_token_losses(model: nn.Module, ctx: ParallelContext, cfg) -> MultiTokenLosses | None:
    """The runtime's part for a model with MTP modules (on every rank, whatever it holds)."""
    if not cfg.model.mtp_layers:
        return None
    return MultiTokenLosses(model, ctx, cfg.model.mtp_layers, cfg.training.mtp_loss_weight)
