"""The Runtime of a pipeline-parallel rank: the trainer's interface over a split model.

`apply_pipeline(model, ctx, cfg)` prunes the plain model to this rank's stages and returns a
`PipelineRuntime`, which replaces `forward_backward` by the schedule executor, adds the tied
embedding exchange to the gradient reduction, and gathers the full weights over pp.
"""

from __future__ import annotations

from typing import Callable

import torch

from ultrascale.config import Config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Llama
from ultrascale.parallel.pipeline.executor import PipelineExecutor
from ultrascale.parallel.pipeline.schedules import owner_of, validate_schedule
from ultrascale.parallel.pipeline.stage import (
    StageChunk, WeightGradStore, defer_weight_grads, split_layers, split_pipeline, sync_tied_grads,
    tied_peer,
)
from ultrascale.parallel.runtime import MicroBatch, Runtime
from ultrascale.parallel.tensor import PLAN_ATTR as TP_PLAN_ATTR


def pipeline_peers(ctx: ParallelContext) -> list[int]:
    """Global rank of each pipeline index in this rank's pp group (same dp, cp, tp coordinates)."""
    if ctx.mesh is None:
        return [ctx.rank]
    mesh = ctx.mesh.mesh
    return [int(r) for r in mesh[:, ctx.coord("dp"), ctx.coord("cp"), ctx.coord("tp")]]


class PipelineRuntime(Runtime):
    """Plain data parallel around a pipeline: gradients are reduced over dp once the whole
    schedule has run (`finish_gradients`). A data-parallel runtime that overlaps the reduction
    with backward could not be reused as is: zero_bubble's W passes add weight gradients outside
    autograd, after the last I."""

    def __init__(self, module: Llama, ctx: ParallelContext, chunks: list[StageChunk],
                 schedule: str, store: WeightGradStore | None, owner: Callable[[str], int],
                 tied_peer_rank: int | None, **kwargs):
        super().__init__(module, ctx, **kwargs)
        peers = pipeline_peers(ctx)
        # Tensor parallel, when on, was applied to the modules before the split (parallelize).
        self.tp_plan = getattr(module, TP_PLAN_ATTR, None)
        sp = self.tp_plan is not None and self.tp_plan.sequence_parallel
        # The loss function is looked up at each call: tensor parallel may swap it later.
        self.executor = PipelineExecutor(
            chunks, schedule, ctx.size("pp"), ctx.coord("pp"), peers, module.cfg.hidden_size,
            next(module.parameters()).dtype, loss_fn=lambda y, t: self.loss_fn(y, t),
            autocast=self.autocast, weight_store=store,
            seq_shards=self.tp_plan.tp if sp else 1)
        self.owner = owner  # plain-model parameter name -> pipeline index holding it
        self.tied_peer_rank = tied_peer_rank  # global rank with the other tied-embedding copy

    def forward_backward(self, micro_batches: list[MicroBatch], loss_scale: float) -> torch.Tensor:
        return self.executor.run(micro_batches, loss_scale, self.no_sync)

    def finish_gradients(self) -> None:
        sync_tied_grads(self.module, self.tied_peer_rank)
        super().finish_gradients()

    # Gathers the tp shards itself, before the pp exchange (see below).
    gathers_tensor_parallel = True

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every pipeline rank broadcasts what it holds, flattened into one buffer per rank; the
        names and shapes are known everywhere from the config. ZeRO-3 and tensor-parallel shards
        are first gathered inside each stage, so that what crosses pp has the plain model's
        shapes."""
        with torch.device("meta"):
            shapes = {n: t.shape for n, t in Llama(self.module.cfg).state_dict().items()}
        mine = super().full_state_dict()  # this stage's tensors (ZeRO-3 gathers them over dp)
        if self.tp_plan is not None:
            mine = self.tp_plan.gather_full(mine)
        me = self.ctx.coord("pp")
        dtype = next(self.module.parameters()).dtype
        out: dict[str, torch.Tensor] = {}
        for q in range(self.ctx.size("pp")):
            names = [n for n in shapes if self.owner(n) == q]
            sizes = [shapes[n].numel() for n in names]
            if q == me:
                flat = torch.cat([mine[n].detach().reshape(-1).to(dtype) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.ctx.device)
            comm.broadcast(flat, "pp", src_local=q, tag="full_state_dict")
            for n, piece in zip(names, flat.split(sizes)):
                out[n] = piece.view(shapes[n]).clone()
        return out


def apply_pipeline(model: Llama, ctx: ParallelContext, cfg: Config,
                   autocast_dtype: torch.dtype | None) -> PipelineRuntime:
    p, mc = cfg.parallel, cfg.model
    pp, v, rank = p.pp, p.pp_virtual_stages, ctx.coord("pp")
    validate_schedule(p.pp_schedule, pp, cfg.training.grad_accum_steps, v, mc.num_layers)
    model, chunks = split_pipeline(model.to(ctx.device), rank, pp, v, p.pp_layers)
    store = None
    if p.pp_schedule == "zero_bubble":
        store = WeightGradStore()
        defer_weight_grads(model, store)
    peer = tied_peer(rank, pp, mc.tie_embeddings)
    return PipelineRuntime(model, ctx, chunks, p.pp_schedule, store,
                           parameter_owner(mc.num_layers, pp, v, p.pp_layers),
                           None if peer is None else pipeline_peers(ctx)[peer],
                           autocast_dtype=autocast_dtype)


def parameter_owner(num_layers: int, pp: int, v: int,
                    pp_layers: list[int] | None) -> Callable[[str], int]:
    """name -> pipeline index holding that plain-model parameter (for a tied embedding, the first
    stage's copy)."""
    rank_of_layer = {i: owner_of(stage, pp)[0]
                     for stage, layers in enumerate(split_layers(num_layers, pp, v, pp_layers))
                     for i in layers}

    def owner(name: str) -> int:
        if name.startswith("layers."):
            return rank_of_layer[int(name.split(".")[1])]
        return 0 if name.startswith("embed.") else pp - 1  # the final norm and the output head

    return owner
