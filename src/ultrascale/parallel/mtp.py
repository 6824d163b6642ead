"""The runtime's part for multi-token prediction (models/mtp.py).

- The micro-batches bring the targets of every depth (`prepare`'s `mtp_depth`, made from the whole
  sequence before any part splits it: a context-parallel rank's positions are not contiguous, and
  the tokens ahead of its last ones are another rank's).
- Each step the MTP losses' gradient scale is set (the step's loss scale, fp16's dynamic scale
  included, x mtp_loss_weight / D) and their records reset; after the step, the per-depth sums are
  all-reduced over every rank once (the last pipeline stage holds them, the tp ranks each hold the
  whole value, as the main loss), for the metrics: `mtp_loss` (their mean over the depths, what
  the weight multiplies) and `mtp_loss_per_depth`, per loss token of the global batch as `loss`
  is.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.runtime import RuntimePart


class MultiTokenLosses(RuntimePart):
    """`scaler`: fp16's loss scaler (a part before this one), whose factor the step's loss scale
    carries; the metrics take it out."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, depth: int, weight: float,
                 scaler: RuntimePart | None = None):
        self.module, self.ctx, self.scaler = module, ctx, scaler
        self.depth, self.weight = depth, weight
        self.per_token = 1.0  # the step's 1 / loss tokens
        self.last: torch.Tensor | None = None  # the last step's per-depth losses

    def scale_loss(self, loss_scale: float) -> float:
        self.per_token = loss_scale / (self.scaler.grad_factor() if self.scaler else 1.0)
        mtp = self.module.mtp  # None on a pipeline stage without the head
        if mtp is not None:
            mtp.loss_scale = loss_scale * self.weight / self.depth
            mtp.reset()
        return loss_scale

    def after_step(self, skipped: bool) -> None:
        sums = torch.zeros(self.depth, dtype=torch.float64, device=self.ctx.device)
        mtp = self.module.mtp
        if mtp is not None:
            for k, s in enumerate(mtp.loss_sums):
                sums[k] = s
        if self.ctx.world_size > 1:
            comm.all_reduce(sums, "world", tag="mtp_loss")
        # A device tensor: read only by the steps that log (nothing waits for it here).
        self.last = sums * (self.per_token / self.ctx.size("tp"))

    def metrics(self) -> dict:
        if self.last is None:
            return {}
        per_depth = self.last.tolist()
        return {"mtp_loss": sum(per_depth) / self.depth, "mtp_loss_per_depth": per_depth}


def multi_token_losses(model: nn.Module, ctx: ParallelContext, cfg,
                       scaler: RuntimePart | None) -> MultiTokenLosses | None:
    """The runtime's part for a model with MTP modules (on every rank, whatever it holds)."""
    if not cfg.model.mtp_layers:
        return None
    return MultiTokenLosses(model, ctx, cfg.model.mtp_layers, cfg.training.mtp_loss_weight,
                            scaler)
