"""`parallelize(model, ctx, cfg)`: apply every parallel strategy of the layout to the plain model,
top to bottom in one fixed order, and return the `Runtime` the trainer drives.

    precision -> recompute -> tensor -> context -> expert -> kernels -> pipeline
              -> (pretrained weights) -> compile -> data / ZeRO

Each step transforms the model through its seams (swapped parameterless children, modules rebased
onto subclasses, the mesh's placements) and hands the next step a plain-looking model; the last
steps choose the runtime's parts (how a micro-batch is prepared, the schedule, the owner of the
gradients and optimizer state). No step calls another or patches its result.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.config import Config
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.compile import compile_blocks
from ultrascale.parallel.data import DataParallel
from ultrascale.parallel.expert import apply_expert_parallel
from ultrascale.parallel.kernels import apply_kernels, resolve_kernels
from ultrascale.parallel.recompute import apply_recompute
from ultrascale.parallel.replicated import Replicated
from ultrascale.parallel.runtime import Runtime, Sequential, autocast_on, prepare


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: bf16 on CUDA by default, none (fp32) on CPU."""
    d = cfg.precision.dtype
    if d == "bf16" or (d == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def build_data_parallel(module: nn.Module, ctx: ParallelContext, cfg: Config) -> Replicated:
    """The owner of gradients, optimizer and state for `parallel.zero` (once the module is final:
    split by tp/pp, on its device; ZeRO flattens the parameters)."""
    p = cfg.parallel
    accum = torch.float32 if cfg.precision.grad_accum_dtype == "fp32" else torch.bfloat16
    kwargs = dict(bucket_mb=p.bucket_mb, overlap=p.overlap, accum_dtype=accum)
    if p.zero == 3:
        from ultrascale.parallel.zero3 import FullyShardedDataParallel
        return FullyShardedDataParallel(module, ctx, **kwargs)
    if p.zero in (1, 2):
        from ultrascale.parallel.zero import ShardedDataParallel
        return ShardedDataParallel(module, ctx, stage=p.zero, **kwargs)
    if ctx.size("dp_cp") > 1:
        return DataParallel(module, ctx, **kwargs)
    return Replicated(module, ctx)


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config,
                pretrained: str | None = None) -> Runtime:
    """`pretrained`: a Hugging Face folder (model.from_hf) whose weights replace the initial ones
    once tensor parallel, expert parallel and the pipeline have shaped the model: each rank reads
    its own slices (and experts)."""
    p = cfg.parallel
    model = model.to(ctx.device)
    autocast_dtype = compute_dtype(cfg, ctx.device)
    autocast = autocast_on(ctx.device, autocast_dtype)

    apply_recompute(model, cfg.training.recompute)

    tp_plan = None
    if p.tp > 1:
        from ultrascale.parallel.tensor import apply_tensor_parallel
        tp_plan = apply_tensor_parallel(model, ctx, p.sequence_parallel, p.overlap)

    prepare_batch = prepare
    if p.cp > 1:
        from ultrascale.parallel.context import apply_context_parallel
        prepare_batch = apply_context_parallel(model, ctx, p.cp_mode, p.cp_load_balance)

    experts = apply_expert_parallel(model, ctx, cfg)

    t = cfg.training
    apply_kernels(model, resolve_kernels(t.kernels, ctx.device, t.compile), t.chunked_loss)

    schedule = Sequential(model, autocast)
    if p.pp > 1:
        from ultrascale.parallel.pipeline.runtime import split_into_stages
        schedule = split_into_stages(model, ctx, cfg, autocast,
                                     # micro-batches already hold this cp rank's share
                                     seq_shards=p.tp if p.sequence_parallel else 1)

    if pretrained is not None:
        from ultrascale.checkpoint.hf import load_pretrained
        load_pretrained(model, pretrained, tp_plan, ep_rank=ctx.coord("ep"))

    if t.compile:  # the blocks are final; the data-parallel owner hooks them next
        compile_blocks(model, t.compile_cache)

    return Runtime(model, ctx, data_parallel=build_data_parallel(model, ctx, cfg),
                   schedule=schedule, prepare=prepare_batch, tp_plan=tp_plan,
                   autocast_dtype=autocast_dtype, experts=experts)
