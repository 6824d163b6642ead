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

Zero-bubble schedules split each backward into I (input gradients) and W (weight gradients):
`defer_weight_grads` rebases the model's `Linear` modules onto `DeferredLinear`, whose weight
gradient is stored during I and computed in W. Other parameters (norms, embedding) are small and get their gradient in I.
A data-parallel reduction driven by gradient hooks sees the linears' gradients arrive in W.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.memory.measure import track_held
from ultrascale.models.llama import Linear, LinearMatmul, Llama
from ultrascale.parallel.pipeline.schedules import stage_of
from ultrascale.parallel.seams import rebase
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
                 targets: torch.Tensor | None = None,
                 future: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first stage) or hidden [b, s, h] -> hidden, or on the last stage the
        summed token loss of `targets` (with multi-token prediction's `future` targets: its
        losses attached, models/mtp.py).

        The model's own pieces, limited to this chunk; the embedding is applied only on the first
        stage, because the last stage of a tied model holds it as its head. `positions` are those
        of the micro-batch (the whole sequence under sequence parallel, whose hidden states hold a
        shard of it while attention sees all of it)."""
        m = self.model
        if self.is_first:
            x = m.embed_tokens(x)
        rope = m.rope(positions)
        x = m.run_layers(x, rope, self.layer_ids)
        return m.head(x, targets, rope, future) if self.is_last else x


def split_pipeline(model: Llama, pp_rank: int, pp: int, v: int = 1,
                   pp_layers: list[int] | None = None, ctx: ParallelContext | None = None
                   ) -> tuple[Llama, list[StageChunk]]:
    """Prune `model` in place to what `pp_rank` holds; return it and its chunks (local order).
    A tied embedding held by two stages is placed as two copies on `ctx`."""
    cfg = model.cfg
    bounds = split_layers(cfg.num_layers, pp, v, pp_layers)
    chunks = [StageChunk(model, stage_of(pp_rank, c, pp), pp * v, bounds[stage_of(pp_rank, c, pp)])
              for c in range(v)]
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
    if shared and pp > 1 and (first or last) and ctx is not None:
        ctx.place("embed.weight", copies=2)
    return model, chunks


def shares_embedding(cfg) -> bool:
    """Whether the last stage uses the embedding too: as its head (tied embeddings), or to embed
    multi-token prediction's tokens. It then keeps a copy, kept equal to the first stage's."""
    return cfg.tie_embeddings or bool(cfg.mtp_layers)


def tied_peer(pp_rank: int, pp: int, tied: bool) -> int | None:
    """The pipeline rank holding the other copy of the tied embedding, or None."""
    if not tied or pp == 1 or pp_rank not in (0, pp - 1):
        return None
    return pp - 1 - pp_rank


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


# ------------------------------------------------------------------------------------------------
# Deferred weight gradients (I / W split)


class WeightGradStore:
    """Weight-gradient work recorded during an I pass, keyed by (micro-batch, chunk), run in W."""

    def __init__(self) -> None:
        self._key = None
        self._pending: dict[object, list] = defaultdict(list)

    @contextmanager
    def capturing(self, key):
        """Within this block, deferred linears store their weight gradient under `key`."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def put(self, weight: nn.Parameter, inputs: torch.Tensor, grad_out: torch.Tensor,
            matmul: LinearMatmul) -> bool:
        """Record the work (`matmul`: the layer's, which computes it); False outside an I pass
        (the caller then computes it at once)."""
        if self._key is None:
            return False
        # A memory meter, when one runs, counts the two tensors until W has used them.
        self._pending[self._key].append((weight, inputs, grad_out, matmul,
                                         track_held(inputs, grad_out)))
        return True

    def flush(self, key) -> None:
        """Run the weight-gradient work of `key`: dW = grad_out^T @ input for each linear.

        The gradients go in through autograd (a backward from the weights themselves), so that
        they are accumulated like any other and the parameters' post-accumulate hooks (data
        parallel's bucketed reduction) fire now, when the gradient is really there."""
        work = self._pending.pop(key, [])
        while work:  # one linear at a time: only one weight gradient is ever held extra
            weight, inputs, grad_out, matmul, _held = work.pop()
            torch.autograd.backward(weight, _weight_grad(inputs, grad_out, matmul).to(weight.dtype))

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())


def _weight_grad(inputs: torch.Tensor, grad_out: torch.Tensor,
                 matmul: LinearMatmul) -> torch.Tensor:
    # In the dtype of the backward, as autograd's own linear would (FP8: the layer's recipe).
    return matmul.grad_weight(grad_out.reshape(-1, grad_out.shape[-1]),
                              inputs.reshape(-1, inputs.shape[-1]))


class _DeferredLinearFn(torch.autograd.Function):
    """y = x W^T, with W given detached: autograd holds no edge to the parameter, so nothing
    (no gradient, no hook) reaches it during the I pass."""

    @staticmethod
    def forward(ctx, x, detached_weight, module, store):
        # The parameter is reached through its module: passed as a tensor argument, it would
        # get an autograd edge (and its hooks would fire, gradient-less, in I).
        ctx.save_for_backward(x, detached_weight)
        ctx.weight, ctx.store, ctx.matmul = module.weight, store, module.matmul
        return module.matmul(x, detached_weight)  # the layer's own (FP8: its recipe)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_in = ctx.matmul.grad_input(grad_out, w)
        if not ctx.store.put(ctx.weight, x, grad_out, ctx.matmul):
            # An ordinary backward (outside an I pass): no reason to defer. Accumulated by hand,
            # as a hook-driven data-parallel reduction then picks it up after backward.
            with torch.no_grad():  # .grad may be a view of a data-parallel bucket
                g = _weight_grad(x, grad_out, ctx.matmul).to(ctx.weight.dtype)
                if ctx.weight.grad is None:
                    ctx.weight.grad = g
                else:
                    ctx.weight.grad.add_(g)
        return grad_in, None, None, None


class DeferredLinear(Linear):
    """The model's bias-free `Linear`, with its weight gradient deferred to a W pass. Rebased from
    the plain one: the very same Parameter, so names, initial values and the optimizer state are
    unchanged."""

    store: WeightGradStore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:
            # Nothing to propagate to the input, so no I pass to split from: plain autograd.
            y = self.matmul(x, self.weight)
        else:
            y = _DeferredLinearFn.apply(x, self.weight.detach(), self, self.store)
        # A bias (Qwen2's q, k, v) is small: its gradient comes in I, as the norms' do.
        return y if self.bias is None else y + self.bias


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Rebase every `Linear` under `module` onto DeferredLinear; returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear:
                setattr(parent, name, rebase(child, DeferredLinear, store=store))
                swapped += 1
    return swapped
