"""`parallelize(model, ctx, cfg)`: apply every parallel strategy of the layout to the plain model,
in a fixed order, and return the `Runtime` the trainer drives.

Order: recomputation patches the plain modules; tensor parallel splits them; the pipeline prunes
the model to this rank's stages; data parallel / ZeRO wraps what is left.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.config import Config
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.data import attach_data_parallel
from ultrascale.parallel.runtime import Runtime


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: bf16 on CUDA by default, none (fp32) on CPU."""
    d = cfg.precision.dtype
    if d == "bf16" or (d == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config) -> Runtime:
    # Recomputation patches the plain model's block/attention/MLP instances; every strategy below
    # keeps those instances, so it applies whatever the layout.
    if not hasattr(model, "_ultrascale_recompute"):
        from ultrascale.parallel.recompute import apply_recompute
        apply_recompute(model, cfg.training.recompute)
        model._ultrascale_recompute = cfg.training.recompute
    # -- tensor parallel (parallel/tensor.py): split the modules first, then build the runtime of
    # the other dimensions around them and give it the vocabulary-parallel loss and state gather.
    if cfg.parallel.tp > 1 and not hasattr(model, "_ultrascale_tp_plan"):
        from ultrascale.parallel.tensor import apply_tensor_parallel, attach_tensor_parallel
        plan = apply_tensor_parallel(model.to(ctx.device), ctx, cfg.parallel.sequence_parallel,
                                     cfg.parallel.overlap)
        return attach_tensor_parallel(parallelize(model, ctx, cfg), plan)
    # -- end tensor parallel -----------------------------------------------------------------------
    # -- pipeline parallel: prune to this rank's stages; its runtime runs the schedule ------------
    if cfg.parallel.pp > 1:
        from ultrascale.parallel.pipeline.runtime import apply_pipeline
        return attach_data_parallel(apply_pipeline(model, ctx, cfg, compute_dtype(cfg, ctx.device)),
                                    cfg)
    # -- end pipeline parallel ---------------------------------------------------------------------
    return attach_data_parallel(
        Runtime(model.to(ctx.device), ctx, autocast_dtype=compute_dtype(cfg, ctx.device)), cfg)
