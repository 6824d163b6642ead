"""`parallelize(model, ctx, cfg)`: apply every parallel strategy of the layout to the plain model,
top to bottom in one fixed order, and return the `Runtime` the trainer drives.

    precision -> recompute -> tensor -> context -> expert -> kernels -> pipeline -> compile
              -> data / ZeRO -> (pretrained weights, into what the optimizer steps)

Each step transforms the model through its seams (swapped parameterless children, modules rebased
onto subclasses, the mesh's placements) and hands the next step a plain-looking model; the last
steps choose the runtime's parts (how a micro-batch is prepared, the schedule, the owner of the
gradients and optimizer state). No step calls another or patches its result.
"""

from __future__ import annotations

from functools import partial

from torch import nn

from ultrascale.config import Config
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.attention_backend import apply_attention_backend
from ultrascale.parallel.compile import compile_blocks
from ultrascale.parallel.data import DataParallel
from ultrascale.parallel.expert import apply_expert_parallel
from ultrascale.parallel.kernels import apply_kernels, resolve_kernels
from ultrascale.parallel.mtp import multi_token_losses
from ultrascale.parallel.precision import Precision, apply_precision
from ultrascale.parallel.recompute import apply_recompute
from ultrascale.parallel.replicated import Replicated
from ultrascale.parallel.runtime import Runtime, Sequential, autocast_on, prepare
from ultrascale.rules import zero3_gathers_per_step


def build_data_parallel(module: nn.Module, ctx: ParallelContext, cfg: Config,
                        precision: Precision) -> Replicated:
    """The owner of gradients, optimizer and state for `parallel.zero` (once the module is final:
    split by tp/pp, on its device; ZeRO flattens the parameters). It keeps the fp32 master
    weights of low-precision parameters."""
    p = cfg.parallel
    accum = precision.grad_accum_dtype
    impl = cfg.training.optimizer_impl
    kwargs = dict(bucket_mb=p.bucket_mb, overlap=p.overlap, accum_dtype=accum, impl=impl)
    # ZeRO over a shard group of one rank (dp or dp_shard x cp = 1) has nothing to shard: its
    # buffers would hold every gradient twice (ZeRO-2's full buffers beside the "shard", ZeRO-3's
    # gathered copies), so the plain owner runs it, as the estimator and planner count it.
    zero = p.zero if ctx.size("dp_shard_cp") > 1 else 0
    if zero == 3:
        from ultrascale.parallel.zero3 import FullyShardedDataParallel
        return FullyShardedDataParallel(
            module, ctx, per_step=zero3_gathers_per_step(p.zero3_gather, p.pp), **kwargs)
    if zero in (1, 2):
        from ultrascale.parallel.zero import ShardedDataParallel
        return ShardedDataParallel(module, ctx, stage=zero, **kwargs)
    if ctx.size("dp_cp") > 1:
        return DataParallel(module, ctx, **kwargs)
    return Replicated(module, ctx, accum, impl)


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config,
                pretrained: str | None = None) -> Runtime:
    """`pretrained`: a Hugging Face folder (model.from_hf) whose weights replace the initial ones
    once the model is shaped and its data-parallel owner built: each rank reads its own slices
    into the values its optimizer steps (fp32 masters under bf16/fp16)."""
    precision = apply_precision(model, cfg.precision, ctx.device)
    p = cfg.parallel
    model = model.to(ctx.device)
    # The compute dtype is the parameters' own (parallel/precision.py): no autocast.
    autocast = autocast_on(ctx.device, None)

    apply_recompute(model, cfg.training.recompute)

    tp_plan = None
    if p.tp > 1:
        from ultrascale.parallel.tensor import apply_tensor_parallel
        tp_plan = apply_tensor_parallel(model, ctx, p.sequence_parallel, p.overlap)

    cp_split = None
    if p.cp > 1:
        from ultrascale.parallel.context import apply_context_parallel
        cp_split = apply_context_parallel(model, ctx, p.cp_mode, p.cp_load_balance)

    experts = apply_expert_parallel(model, ctx, cfg)

    t = cfg.training
    apply_kernels(model, resolve_kernels(t.kernels, ctx.device, t.compile), t.chunked_loss)
    attention = apply_attention_backend(model, ctx.device, precision.param_dtype,
                                        t.micro_batch_size, t.seq_len)

    schedule = Sequential(model, autocast)
    if p.pp > 1:
        from ultrascale.parallel.pipeline.runtime import split_into_stages
        schedule = split_into_stages(model, ctx, cfg, autocast,
                                     # micro-batches already hold this cp rank's share
                                     seq_shards=p.tp if p.sequence_parallel else 1)

    if t.compile:  # the blocks are final; the data-parallel owner hooks them next
        compile_blocks(model, t.compile_cache)

    owner = build_data_parallel(model, ctx, cfg, precision)
    if pretrained is not None:
        # Into what the optimizer steps (the fp32 masters under bf16/fp16, ZeRO's shards), as a
        # checkpoint restores; the parameters then follow from them.
        from ultrascale.checkpoint.hf import load_pretrained
        load_pretrained(model, pretrained, tp_plan, owner.held(), ep_rank=ctx.coord("ep"))
        owner.values_loaded()

    # The layout's optional parts, in the order the runtime folds them: the loss scale passes
    # fp16's scaler before the experts' balancing losses take it; full tensors gather over tp,
    # then over ep.
    # Multi-token prediction takes the loss scale after the scaler too.
    mtp = multi_token_losses(model, ctx, cfg, precision.scaler)
    parts = [part for part in (tp_plan, cp_split, precision.scaler, experts, mtp)
             if part is not None]
    # With multi-token prediction, each micro-batch brings the targets of every depth.
    make = partial(prepare, mtp_depth=cfg.model.mtp_layers) if cfg.model.mtp_layers else prepare
    return Runtime(model, ctx, data_parallel=owner, schedule=schedule, prepare=make,
                   parts=parts, precision=precision, header={"attention": attention})
