"""The schedule part of a pipeline-parallel rank's runtime.

`split_into_stages(model, ctx, cfg)` prunes the plain model to this rank's stages and returns a
`PipelineSchedule`: it runs the forwards and backwards of the schedule (the executor), adds the
tied embedding's exchange before the data-parallel reduction, and gathers the full weights over pp.
"""

from __future__ import annotations

from typing import Callable

import torch

from ultrascale.config import Config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Llama
from ultrascale.models.moe import MoE
from ultrascale.parallel.pipeline.executor import PipelineExecutor
from ultrascale.parallel.pipeline.schedules import (
    SPLIT_BACKWARD, owner_of, placement_of, validate_schedule,
)
from ultrascale.parallel.pipeline.stage import (
    WeightGradStore, defer_weight_grads, shares_embedding, split_layers, split_pipeline,
    sync_tied_grads, tied_peer,
)
from ultrascale.parallel.runtime import MicroBatch


class PipelineSchedule:
    def __init__(self, module: Llama, ctx: ParallelContext, executor: PipelineExecutor,
                 owner: Callable[[str], int], tied_peer_rank: int | None):
        self.module, self.ctx, self.executor = module, ctx, executor
        self.owner = owner  # plain-model parameter name -> pipeline index holding it
        self.tied_peer_rank = tied_peer_rank  # global rank with the other tied-embedding copy

    def run(self, batches: list[MicroBatch], loss_scale: float,
            no_sync: Callable[[bool], object]) -> torch.Tensor:
        return self.executor.run(batches, loss_scale, no_sync)

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only, one micro-batch after another through the virtual stages in order (the
        validation loss: no backward to overlap, so no schedule). Every rank walks the same
        (micro-batch, stage) sequence, so each send meets its receive. Returns the summed token
        loss of the micro-batches on the last stage's ranks, zero elsewhere."""
        ex = self.executor
        chunks = {ch.stage: ch for ch in ex.chunks}
        stages = ex.pp * ex.v
        total = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
        for mb in batches:
            b, s = mb.tokens.shape
            shape = (b, s // ex.seq_shards, ex.hidden_size)
            y = None  # the last output, when the next stage is ours too (dualpipev's turn)
            for stage in range(stages):
                if not ex.is_local(stage):
                    continue
                chunk = chunks[stage]
                if chunk.is_first:
                    x = mb.tokens
                elif ex.is_local(stage - 1):
                    x = y
                else:
                    x = torch.empty(shape, dtype=ex.dtype, device=total.device)
                    self._transfer("recv", x, self._owner(stage - 1))
                with ex.autocast():
                    y = chunk(x, mb.positions, mb.targets if chunk.is_last else None,
                              mb.documents)
                if chunk.is_last:
                    total += y.double()
                elif not ex.is_local(stage + 1):
                    self._transfer("send", y.to(ex.dtype).contiguous(), self._owner(stage + 1))
        return total

    def _owner(self, stage: int) -> int:
        return owner_of(stage, self.executor.pp, self.executor.placement)[0]

    def _transfer(self, kind: str, tensor: torch.Tensor, pp_index: int) -> None:
        for work in comm.batch_p2p([(kind, tensor, self.executor.peers[pp_index])], dim="pp",
                                   tag="pipeline_eval"):
            work.wait()

    def before_reduce(self, accumulated_grad: Callable) -> None:
        sync_tied_grads(self.module, self.tied_peer_rank, accumulated_grad)

    def saves(self, name: str) -> bool:
        """This stage saves what it owns: of the tied embedding's two copies, the first stage's."""
        return self.owner(name) == self.ctx.coord("pp")

    def gather_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pipeline rank broadcasts what it holds (already in plain-model shapes), flattened
        into one buffer per rank; the names and shapes are known everywhere from the config."""
        with torch.device("meta"):
            shapes = {n: t.shape for n, t in Llama(self.module.cfg).state_dict().items()}
        me = self.ctx.coord("pp")
        # The owner's values (fp32 masters under mixed precision): the same dtype on every rank.
        dtype = next(iter(mine.values())).dtype
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


def split_into_stages(model: Llama, ctx: ParallelContext, cfg: Config, autocast: Callable,
                      seq_shards: int) -> PipelineSchedule:
    """Prune `model` in place to this rank's stages. `seq_shards`: the parts of the sequence each
    rank's hidden states hold (tp under sequence parallel), which sets what the stages send."""
    p, mc = cfg.parallel, cfg.model
    pp, v, rank = p.pp, p.pp_virtual_stages, ctx.coord("pp")
    placement = placement_of(p.pp_schedule)
    validate_schedule(p.pp_schedule, pp, cfg.training.grad_accum_steps, v, mc.num_layers)
    model, chunks = split_pipeline(model, rank, pp, v, p.pp_layers, ctx, placement)
    store = None
    if p.pp_schedule in SPLIT_BACKWARD:
        store = WeightGradStore()
        defer_weight_grads(model, store)
    peers = ctx.peers("pp")
    # A forward and a backward that dualpipev pairs take turns at each expert all-to-all.
    overlap = placement == "v" and ctx.size("ep") > 1 and any(
        isinstance(block.mlp, MoE) for block in model.layers.values())
    executor = PipelineExecutor(chunks, p.pp_schedule, pp, rank, peers, mc.hidden_size,
                                next(model.parameters()).dtype, autocast=autocast,
                               weight_store=store, seq_shards=seq_shards, overlap_pairs=overlap)
    peer = tied_peer(rank, pp, shares_embedding(mc), placement, v)
    return PipelineSchedule(model, ctx, executor,
                            parameter_owner(mc.num_layers, pp, v, p.pp_layers, placement),
                            None if peer is None else peers[peer])


def parameter_owner(num_layers: int, pp: int, v: int, pp_layers: list[int] | None,
                    placement: str = "loop") -> Callable[[str], int]:
    """name -> pipeline index holding that plain-model parameter (for a tied embedding, the first
    stage's copy)."""
    rank_of_layer = {i: owner_of(stage, pp, placement)[0]
                     for stage, layers in enumerate(split_layers(num_layers, pp, v, pp_layers))
                     for i in layers}
    head = owner_of(pp * v - 1, pp, placement)[0]  # rank 0 under dualpipev's V

    def owner(name: str) -> int:
        if name.startswith("layers."):
            return rank_of_layer[int(name.split(".")[1])]
        return 0 if name.startswith("embed.") else head  # the final norm and the output head

    return owner
