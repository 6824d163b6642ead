"""Parallel strategies, each a small module that transforms the plain model.

`parallelize` applies them in a fixed order (tensor parallel inside, pipeline split, then data
parallel / ZeRO around the result) and returns the `Runtime` the trainer drives.
`check_supported` refuses, before any process starts, combinations that are not implemented.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.config import Config, ConfigError
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.data import attach_data_parallel
from ultrascale.parallel.runtime import Runtime


def check_supported(cfg: Config) -> None:
    """Raise ConfigError for settings the engine cannot run yet (never fall back silently)."""
    p, m = cfg.parallel, cfg.model
    unsupported = []
    # -- pipeline parallel (parallel/pipeline/) ----------------------------------------------------
    if p.pp > 1:
        from ultrascale.parallel.pipeline.schedules import validate_schedule
        try:
            validate_schedule(p.pp_schedule, p.pp, cfg.training.grad_accum_steps,
                              p.pp_virtual_stages, m.num_layers)
        except ValueError as e:
            unsupported.append(("parallel.pp_schedule", p.pp_schedule, str(e).rstrip(".")))
        for key, value in (("parallel.tp", p.tp), ("parallel.cp", p.cp), ("parallel.zero", p.zero)):
            if value > (0 if key == "parallel.zero" else 1):
                unsupported.append((key, value, "pipeline parallel is not combined with it yet "
                                    "(its stages have not been tested together); use pp=1 or "
                                    "leave this at its default"))
    # -- end pipeline parallel ---------------------------------------------------------------------
    if p.cp > 1:
        unsupported.append(("parallel.cp", p.cp, "context parallel is not implemented yet; set cp=1"))
    if p.ep > 1 or m.num_experts:
        unsupported.append(("model.num_experts", m.num_experts,
                            "mixture of experts is not implemented yet; use a dense model"))
    # -- data parallel / ZeRO (parallel/data.py, zero.py, zero3.py) -------------------------------
    if p.zero > 0 and p.cp > 1:
        unsupported.append(("parallel.zero", p.zero, "ZeRO shards over dp only; with cp > 1 the "
                            "gradients would also need a cp reduction of the shards. Set zero=0"))
    if p.zero == 3 and p.pp > 1:
        unsupported.append(("parallel.zero", p.zero, "ZeRO-3 gathers parameters from module hooks "
                            "that pipeline stages do not run through yet. Use zero<=2 or pp=1"))
    if p.zero == 3 and cfg.training.recompute != "none":
        unsupported.append(("parallel.zero", p.zero, "ZeRO-3 frees a block's parameters after its "
                            "forward; recomputation would run it again without them. Use zero<=2 "
                            "or training.recompute=none"))
    # -- end data parallel / ZeRO ------------------------------------------------------------------
    if cfg.precision.dtype in ("fp16", "fp8"):
        unsupported.append(("precision.dtype", cfg.precision.dtype,
                            "only fp32 and bf16 are implemented; use bf16 on GPUs, fp32 on CPUs"))
    if unsupported:
        raise ConfigError("\n".join(f"{key}={value!r}: {why}." for key, value, why in unsupported))


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
