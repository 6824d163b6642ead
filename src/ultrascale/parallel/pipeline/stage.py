"""Split the plain model into pipeline stages.

The model is cut into `pp * v` virtual stages of consecutive layers; rank r keeps the chunks r,
r+pp, ... (see schedules.py). The first virtual stage also holds the embedding, the last the final
norm and the output head (the loss is the runtime's). Each rank keeps one pruned `Llama` that holds
only its pieces, so parameter names stay those of the plain model (checkpoints, full_state_dict),
and one `StageChunk` per local chunk that runs its part of the forward.

Tied embeddings: the last stage needs the embedding matrix as its head (or, with multi-token
prediction on the last stage, to embed the tokens ahead). It keeps its own copy
(under the same name, `embed.weight`, placed as two copies on the mesh); both copies get the sum
of the two stages' gradients (`sync_tied_grads`), so that the same optimizer step keeps them
equal.

Schedules that split each backward into I (input gradients) and W (weight gradients), zero_bubble
and dualpipev, defer the linears' weight gradients: deferred.py (`WeightGradStore`,
`defer_weight_grads`, re-exported here).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Llama
from ultrascale.parallel.pipeline.deferred import (  # noqa: F401 (re-exported)
    DeferredMatmul, WeightGradStore, defer_weight_grads,
)
from ultrascale.parallel.pipeline.schedules import owner_of, stage_of
from ultrascale.rules import split_layers


class StageChunk:
    """One virtual stage on this rank: a view on the pruned model's modules (owns no parameters)."""

    def __init__(self, model: Llama, stage: int, num_stages: int, layers: range):
        self.model = model
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.layer_ids = list(layers)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 targets: torch.Tensor | None = None, documents=None,
                 future: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first stage) or hidden [b, s, h] -> hidden, or on the last stage the
        summed token loss of `targets` (with multi-token prediction's `future` targets: its
        losses attached, models/mtp.py).

        The model's own pieces, limited to this chunk; the embedding is applied only on the first
        stage, because the last stage of a tied model holds it as its head. `positions` are those
        of the micro-batch (the whole sequence under sequence parallel, whose hidden states hold a
        shard of it while attention sees all of it), `documents` its documents' boundaries."""
        m = self.model
        if self.is_first:
            x = m.embed_tokens(x)
        rope = m.rope(positions, documents)
        x = m.run_layers(x, rope, self.layer_ids)
        return m.head(x, targets, rope, future) if self.is_last else x


def split_pipeline(model: Llama, pp_rank: int, pp: int, v: int = 1,
                   pp_layers: list[int] | None = None, ctx: ParallelContext | None = None,
                   placement: str = "loop") -> tuple[Llama, list[StageChunk]]:
    """Prune `model` in place to what `pp_rank` holds; return it and its chunks (local order).
    A tied embedding held by two ranks is placed as two copies on `ctx` (under dualpipev's V the
    first and the last stage share rank 0, and one copy serves both)."""
    cfg = model.cfg
    bounds = split_layers(cfg.num_layers, pp, v, pp_layers)
    stages = [stage_of(pp_rank, c, pp, placement) for c in range(v)]
    chunks = [StageChunk(model, stage, pp * v, bounds[stage]) for stage in stages]
    keep = {i for ch in chunks for i in ch.layer_ids}
    for name in [n for n in model.layers if int(n) not in keep]:
        del model.layers[name]
    first = any(ch.is_first for ch in chunks)
    last = any(ch.is_last for ch in chunks)
    shared = shares_embedding(cfg)
    if not (first or (last and shared)):
        model.embed = None
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    if tied_peer(pp_rank, pp, shared, placement, v) is not None and ctx is not None:
        ctx.place("embed.weight", copies=2)
    return model, chunks


def shares_embedding(cfg) -> bool:
    """Whether the last stage uses the embedding too: as its head (tied embeddings), or to embed
    multi-token prediction's tokens. It then keeps a copy, kept equal to the first stage's."""
    return cfg.tie_embeddings or bool(cfg.mtp_layers)


def tied_peer(pp_rank: int, pp: int, tied: bool, placement: str = "loop",
              v: int = 1) -> int | None:
    """The pipeline rank holding the other copy of the tied embedding, or None (untied, or the
    first and the last stage on one rank)."""
    first, last = owner_of(0, pp, placement)[0], owner_of(pp * v - 1, pp, placement)[0]
    if not tied or first == last or pp_rank not in (first, last):
        return None
    return last if pp_rank == first else first


def sync_tied_grads(model: Llama, peer_global_rank: int | None,
                    accumulated_grad: Callable[[str, nn.Parameter], torch.Tensor]) -> None:
    """Give both copies of a tied embedding the sum of their gradients (one exchange over pp).

    `accumulated_grad(name, param)` is the data-parallel owner's: the tensor that holds the
    gradient so far (`.grad`, a view of a bucket, or under mixed precision the fp32 accumulation
    buffer). The two ranks add the same two tensors (a + b == b + a exactly), so the copies stay
    bitwise equal after the optimizer step."""
    if peer_global_rank is None:
        return
    grad = accumulated_grad("embed.weight", model.embed.weight)
    theirs = torch.empty_like(grad)
    works = comm.batch_p2p([("send", grad.contiguous(), peer_global_rank),
                            ("recv", theirs, peer_global_rank)], dim="pp", tag="tied_embedding")
    for w in works:
        w.wait()
    with torch.no_grad():  # a view of a data-parallel bucket, or a master's buffer
        grad.add_(theirs)
