"""ZeRO-3: parameters sharded too, gathered one unit at a time around its forward and backward.

The units are the model's own (`model.shard_units()`): for Llama the embedding, each layer, and
the head (final norm + the module holding the output weight). Units that share a parameter (a
tied embedding is the embedding and the head) are merged. A unit's parameters go into one bucket
per gradient view (dense and expert weights shard over different ranks). Between uses a bucket
holds only this rank's shard; its flat parameter keeps its shape but its storage is resized to
zero bytes (the parameters stay views of it, so autograd's saved tensors see the data again once
it is re-gathered).

    forward   pre-hook of the unit's first module: gather the unit (waiting for a prefetch if one
              is in flight) and prefetch the next unit; post-hook: free it, and hook its output's
              gradient
    backward  output-gradient hook: gather the unit again, prefetch the previous one; when every
              gradient of a bucket is in: free the parameters, reduce-scatter the gradients
    step      AdamW on the shards only; nothing is gathered until the next forward

A unit whose first module does not hold all its parameters (the head: its weight is used after the
final norm returns, outside a module call) is freed by the root module's post-forward hook, or,
for a pipeline stage whose root forward is not called, at the end of the step (a stage may run
several backwards in a row). Traffic per step: 2m psi all-gather + psi reduce-scatter for m
micro-batches. Micro-batch forwards and backwards may interleave (1F1B): each hook gathers
whatever is freed.

`per_step` (`parallel.zero3_gather: step`, the default under pp) keeps a unit from its first
gather to the end of the step instead: nothing is freed after a forward or a backward, so the
step all-gathers psi once (a pipeline stage its own parameters) whatever m, and holds the
stage's parameters whole through its micro-batches, as FSDP under torch.distributed.pipelining
does. `peak_gathered_bytes` is the most this rank held gathered at once (the memory the two
modes trade).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.buckets import Bucket, bucket_views, make_bucket
from ultrascale.parallel.zero import ShardedDataParallel


@dataclass
class Unit:
    """Parameters gathered together, and where their forward starts."""

    params: list[tuple[str, nn.Parameter]]
    starts: list[nn.Module] = field(default_factory=list)  # modules whose forward needs it
    buckets: list[Bucket] = field(default_factory=list)
    covered: bool = True  # its first module holds all its parameters (freed after its forward)


def plan_units(module: nn.Module, named: list[tuple[str, nn.Parameter]]
               ) -> tuple[list[Unit], list[tuple[nn.Module, Unit]]]:
    """The model's units with shared parameters merged, and the forward chain: (module, unit) for
    each of the model's units in order."""
    trainable = {id(p): (n, p) for n, p in named}
    units: list[Unit] = []
    unit_of: dict[int, Unit] = {}
    chain = []
    for mods in module.shard_units():
        params = list({id(p): trainable[id(p)] for m in mods for p in m.parameters()
                       if id(p) in trainable}.values())
        if not params:
            continue
        unit = next((unit_of[id(p)] for _, p in params if id(p) in unit_of), None)
        if unit is None:
            unit = Unit([])
            units.append(unit)
        unit.params += [(n, p) for n, p in params if id(p) not in unit_of]
        for _, p in params:
            unit_of[id(p)] = unit
        chain.append((mods[0], unit))
    for first, unit in chain:
        unit.starts.append(first)
        held = {id(p) for p in first.parameters()}
        unit.covered = unit.covered and all(id(p) in held for _, p in unit.params)
    return units, chain


class FullyShardedDataParallel(ShardedDataParallel):
    def __init__(self, module: nn.Module, ctx: ParallelContext, per_step: bool = False,
                 **kwargs):
        super().__init__(module, ctx, stage=3, **kwargs)
        self.per_step = per_step  # keep each unit gathered from its first use to the step's end
        self._state = {b.index: "full" for b in self.buckets}
        # Flat parameters held whole right now (all of them until the loop below frees them).
        self._gathered_bytes = sum(b.flat_param.untyped_storage().nbytes() for b in self.buckets)
        self.peak_gathered_bytes = 0
        self._root_ran = False  # this step, the root module's forward ran (not a pipeline stage)
        self._gathering: dict[int, tuple] = {}  # index -> (work, source tensor kept alive)
        for b in self.buckets:
            self._free(b)
        self._hook_modules()

    def _plan(self, bucket_mb: float) -> list[Bucket]:
        # The unit of gathering is the model's unit; bucket_mb does not apply.
        self.units, self._chain = plan_units(self.module, self.named)
        self._unit_of: dict[int, Unit] = {}
        buckets: list[Bucket] = []
        for unit in self.units:
            by_view: dict[tuple, list] = {}
            for n, p in unit.params:
                by_view.setdefault(bucket_views(self.ctx, n, True), []).append((n, p))
            for (dim, shard_dim, pad), params in by_view.items():
                b = make_bucket(len(buckets), params, pad, self.accum_dtype, dim, shard_dim)
                unit.buckets.append(b)
                self._unit_of[b.index] = unit
                buckets.append(b)
        return buckets

    # -- gather / free ------------------------------------------------------------------------
    def _start_gather(self, b: Bucket) -> None:
        if self._state[b.index] != "free":
            return
        flat = b.flat_param
        flat.untyped_storage().resize_(b.padded * flat.element_size())
        self._gathered_bytes += b.padded * flat.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        src = b.shard.to(flat.dtype, copy=True)
        work = comm.all_gather(flat, src, b.shard_dim, async_op=True, tag="param_gather")
        self._gathering[b.index] = (work, src)
        self._state[b.index] = "gathering"

    def gather(self, b: Bucket) -> None:
        self._start_gather(b)
        if self._state[b.index] == "gathering":
            self._gathering.pop(b.index)[0].wait()
            self._state[b.index] = "full"

    def _free(self, b: Bucket) -> None:
        if self._state[b.index] == "gathering":
            self.gather(b)
        if self._state[b.index] == "full":
            self._gathered_bytes -= b.flat_param.untyped_storage().nbytes()
            b.flat_param.untyped_storage().resize_(0)
            self._state[b.index] = "free"

    def _gather_unit(self, unit: Unit) -> None:
        for b in unit.buckets:
            self._start_gather(b)
        for b in unit.buckets:
            self.gather(b)

    def _prefetch(self, unit: Unit | None) -> None:
        for b in unit.buckets if unit is not None else ():
            self._start_gather(b)

    def _free_unit(self, unit: Unit) -> None:
        for b in unit.buckets:
            self._free(b)

    # -- hooks --------------------------------------------------------------------------------
    def _hook_modules(self) -> None:
        """Hook the first module of each unit; prefetch follows the forward chain and its
        reverse in backward."""
        chain = self._chain
        self._bwd_next: dict[int, Unit | None] = {}  # a merged unit's backward starts at its
        for i, (mod, unit) in enumerate(chain):     # last place in the chain: the last one wins
            fwd_next = chain[i + 1][1] if i + 1 < len(chain) else None
            self._bwd_next[id(unit)] = chain[i - 1][1] if i > 0 else None
            mod.register_forward_pre_hook(self._pre_forward(unit, fwd_next))
            mod.register_forward_hook(self._post_forward(unit))
        self.module.register_forward_hook(self._root_post_forward)

    def _pre_forward(self, unit: Unit, prefetch: Unit | None):
        def hook(module, args):
            self._gather_unit(unit)
            self._prefetch(prefetch)
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, out):
            if unit.covered and not self.per_step:
                self._free_unit(unit)
                self._hook_output(out, unit)
        return hook

    def _root_post_forward(self, module, args, out):
        """Units used outside module calls (the head, multi-token prediction's modules) are
        freed now; their backward, which comes first, gathers them all again."""
        self._root_ran = True
        if self.per_step:
            return
        held = [u for u in self.units if any(self._state[b.index] != "free" for b in u.buckets)]
        for unit in held:
            self._free_unit(unit)
        if held and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._pre_backward_all(held))

    def _pre_backward_all(self, units: list[Unit]) -> None:
        for unit in units:
            self._gather_unit(unit)
        after = (self._bwd_next.get(id(u)) for u in units)  # the first outside them, prefetched
        self._prefetch(next((n for n in after if n is not None
                             and all(n is not u for u in units)), None))

    def _hook_output(self, out, unit: Unit) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        self._gather_unit(unit)
        self._prefetch(self._bwd_next.get(id(unit)))

    def _backward_done(self, b: Bucket) -> None:
        # A head on a pipeline stage has no regather hook (no root forward ran to free it and
        # hook the loss): it stays gathered until finish(), or a later micro-batch's backward
        # (all-forward-all-backward) would find its weights freed.
        if self.per_step or (not self._unit_of[b.index].covered and not self._root_ran):
            return
        self._free(b)

    # -- step and state -----------------------------------------------------------------------
    def finish(self) -> None:
        super().finish()
        for b in self.buckets:  # a unit left gathered by a partial schedule, or a stage's head
            self._free(b)
        self._root_ran = False

    def _publish_params(self) -> None:
        """Nothing to gather after the step: each unit is gathered by its next forward."""
        for b in self.buckets:
            self._free(b)

    def full_local_state(self) -> dict[str, torch.Tensor]:
        if self.low_precision:  # the fp32 master shards, gathered (zero.py)
            return super().full_local_state()
        for b in self.buckets:
            self.gather(b)
        state = super().full_local_state()
        for b in self.buckets:
            self._free(b)
        return state

    def param_bytes(self, experts_only: bool = False) -> int:
        return sum(b.shard.numel() * b.shard.element_size()
                   + b.flat_param.untyped_storage().nbytes() for b in self.buckets
                   if not experts_only or self.bucket_is_expert(b))
