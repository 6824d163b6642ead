"""ZeRO-1 and ZeRO-2: the optimizer state (and for stage 2 the gradients) sharded over dp.

Every bucket's flat parameter is cut into equal shards over its shard view (`ctx.shard_dim`: dp,
dp x cp under context parallel, edp for expert weights, dp_shard when hybrid); rank r owns
shard r. The optimizer is an ordinary AdamW over *segments*: the pieces of this rank's shard that
fall inside each parameter (so matrices and norm weights keep their own weight decay, and the
update is exactly AdamW's, element by element). Per step:

    backward    each bucket is reduce-scattered as soon as it is ready (overlapped); rank r gets
                the summed gradient of its shard. ZeRO-1 keeps the full gradient buffer,
                ZeRO-2 frees it once its shard is reduced.
    step        AdamW updates this rank's shard of the parameters (the master shard),
                then every bucket's parameters are all-gathered.

The reduced gradient shards are slices of one flat buffer (ZeRO-1: of the full flat gradient
buffer, each rank's own part of it; ZeRO-2/3: of one flat shard buffer, kept from step to step),
and so are the fp32 master shards of low-precision parameters: the norm, the clip and the fused
AdamW run over them as over the whole buffers of data parallel (flat.py).

Communication per step: reduce-scatter psi + all-gather psi = the bytes of one all-reduce.
Memory per rank: params psi, grads psi (ZeRO-1) or psi/N (ZeRO-2), optimizer state 2 psi/N.
With hybrid sharding the shard group is dp_shard and the reduced shard is all-reduced across
dp_replicate (identical shards there). ZeRO-3 (zero3.py) extends this class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.buckets import Bucket
from ultrascale.parallel.data import DataParallel
from ultrascale.optim.muon import is_matrix
from ultrascale.parallel.muon_exchange import MatrixSlot
from ultrascale.parallel.flat import flat_copy, flat_views, same_memory
from ultrascale.parallel.replicated import (Held, buffers_held, nbytes, persistent_buffers)


@dataclass
class Segment:
    """The part [start, end) of a bucket's local shard that belongs to one parameter."""

    name: str  # "<param name>@<offset inside the parameter>"
    param_name: str
    param: nn.Parameter
    bucket: Bucket
    start: int
    end: int
    tensor: torch.Tensor  # view of the master shard: what the optimizer updates
    offset: int  # where the segment starts inside the parameter (flat)


class ShardedDataParallel(DataParallel):
    def __init__(self, module: nn.Module, ctx: ParallelContext, *, stage: int, **kwargs):
        self.zero = stage  # read by _plan (padding) before the base constructor returns
        super().__init__(module, ctx, **kwargs)
        for b in self.buckets:
            self._flatten(b)
        self._make_shards()
        self.segments = self._make_segments()

    # -- layout -------------------------------------------------------------------------------
    def _flatten(self, b: Bucket) -> None:
        """Move the bucket's parameters into one flat buffer."""
        dtype = b.params[0].dtype
        if any(p.dtype != dtype for p in b.params):
            raise ValueError(f"ZeRO bucket {b.index} mixes parameter dtypes {b.names}")
        flat = torch.zeros(b.padded, dtype=dtype, device=b.params[0].device)
        with torch.no_grad():
            for _, p, lo, hi in b.spans():
                flat[lo:hi].copy_(p.detach().reshape(-1))
                p.data = flat[lo:hi].view(p.shape)
        b.flat_param = flat

    def _copies_master(self, b: Bucket) -> bool:
        """Whether the bucket's master shard is a copy: fp32 parameters' is the local slice of the
        flat parameter itself (ZeRO-1/2); lower-precision parameters get fp32 masters, and under
        ZeRO-3 the shard is the only copy between gathers (the flat parameter is freed)."""
        return self.zero >= 3 or b.flat_param.dtype != torch.float32

    def _make_shards(self) -> None:
        """This rank's master shard and reduced-gradient shard of every bucket: the copied
        masters slices of one flat fp32 buffer; the gradient shards slices of the full flat
        gradient buffer (ZeRO-1) or of one flat shard buffer (ZeRO-2/3)."""
        local = {b.index: b.flat_param[slice(*b.shard_range(*self.shard_of(b)))]
                 for b in self.buckets}
        copied = [b for b in self.buckets if self._copies_master(b)]
        _, views = flat_copy([local[b.index] for b in copied], torch.float32,
                             device=self.ctx.device)
        masters = {b.index: v for b, v in zip(copied, views)}
        for b in self.buckets:
            b.shard = masters.get(b.index, local[b.index])
        if self.zero == 1:
            for b in self.buckets:
                b.grad_shard = b.grad[slice(*b.shard_range(*self.shard_of(b)))]
            return
        sizes = [b.padded // self.shard_of(b)[1] for b in self.buckets]
        flat = torch.zeros(sum(sizes), dtype=self.accum_dtype, device=self.ctx.device)
        for b, view in zip(self.buckets, flat_views(flat, [(n,) for n in sizes])):
            b.grad_shard = view

    def _make_segments(self) -> list[Segment]:
        segs = []
        for b in self.buckets:
            lo, hi = b.shard_range(*self.shard_of(b))
            for name, p, a, z in b.spans():
                s, e = max(a, lo), min(z, hi)
                if s < e:
                    seg = Segment(f"{name}@{s - a}", name, p, b, s - lo, e - lo,
                                  b.shard[s - lo:e - lo], s - a)
                    seg.tensor.grad = self._segment_grad(seg)
                    segs.append(seg)
        return segs

    def _segment_grad(self, s: Segment) -> torch.Tensor:
        """What the optimizer reads for a segment: its slice of the reduced gradient shard (a
        cast copy, each step, where the accumulation dtype differs from the master's)."""
        g = s.bucket.grad_shard[s.start:s.end]
        return g if g.dtype == s.tensor.dtype else g.to(s.tensor.dtype)

    # -- reduction ----------------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        b.launched = True
        self.launch_log.append(b.index)
        grad = b.grad_buffer()
        # ZeRO-2/3 reduce straight into the shard; ZeRO-1's shard is a slice of the buffer
        # being reduced, so its sum lands beside it first.
        b.reduced = b.grad_shard if self.zero >= 2 else torch.empty_like(b.grad_shard)
        b.works.append(comm.reduce_scatter(b.reduced, grad, b.shard_dim, async_op=True,
                                           tag="grad_bucket"))
        self._release_reduced()

    def _release_reduced(self) -> None:
        """ZeRO-2/3: a bucket whose reduce-scatter has landed no longer needs its full gradient;
        free it during backward rather than at the end, so full gradients never pile up."""
        if self.zero < 2:
            return
        for b in self.buckets:
            if b.launched and b.grad is not None and all(w.is_completed() for w in b.works):
                self._wait(b)
                b.free_grad()

    def _complete(self, b: Bucket) -> None:
        self._wait(b)
        if self.hybrid:
            comm.all_reduce(b.reduced, "dp_replicate", tag="grad_bucket")
        if b.reduced is not b.grad_shard:  # ZeRO-1: the full buffer keeps the reduced shard
            b.grad_shard.copy_(b.reduced)
        b.reduced = None
        if self.zero >= 2:
            b.free_grad()

    def bucket_is_expert(self, b: Bucket) -> bool:
        return self.is_expert(b.names[0])  # a bucket holds parameters of one view only

    def grad_bytes(self, experts_only: bool = False) -> int:
        """Gradient bytes held: the full buffers (ZeRO-1, whose shards are slices of them; ZeRO-2/3
        while a bucket is being reduced) and ZeRO-2/3's shard buffer."""
        total = 0
        for b in self.buckets:
            if experts_only and not self.bucket_is_expert(b):
                continue
            held = [b.grad] + ([b.grad_shard] if self.zero >= 2 else [])
            total += nbytes(t for t in held if t is not None)
        return total

    # -- optimizer ----------------------------------------------------------------------------
    def _stepped(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """This rank's segments of the master shards (the base class builds the optimizer)."""
        return [(s.param_name, s.param, s.tensor) for s in self.segments]

    def _matrix_slots(self, stepped, split_dim) -> list[MatrixSlot]:
        """Muon's matrices, every one of them (this rank may hold no piece of one that it is
        dealt to orthogonalise), with the flat range each rank of the shard view holds."""
        mine = {s.param_name: s.tensor for s in self.segments}
        where = {name: (b, a, z) for b in self.buckets for name, _, a, z in b.spans()}
        slots = []
        for name, p in self.named:
            if not is_matrix(name, p.dim()):
                continue
            b, a, z = where[name]
            n = self.ctx.size(b.shard_dim)
            ranges = []
            for r in range(n):
                lo, hi = b.shard_range(r, n)
                s, e = max(a, lo), min(z, hi)
                ranges.append((s - a, e - a) if s < e else (0, 0))
            slots.append(MatrixSlot(name, p.shape, mine.get(name), b.shard_dim, tuple(ranges),
                                    split_dim(name)))
        return slots

    def _grads(self):
        """(name, gradient) of each segment this rank steps."""
        for s in self.segments:
            yield s.param_name, s.tensor.grad

    def _norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        """Each gradient element is held by one rank of its shard group, and by every replica
        outside it (hybrid replicas, tp ranks where it is not split, a tied embedding's copy)."""
        return [(s.tensor.grad, self.ctx.replicas(s.param_name) // self.ctx.size(
            s.bucket.shard_dim)) for s in self.segments]

    def finish(self) -> None:
        super().finish()
        for s in self.segments:  # a cast copy of this step's reduced shard, where one is needed
            if not same_memory(s.tensor.grad, s.bucket.grad_shard[s.start:]):
                s.tensor.grad = self._segment_grad(s)

    def _count_grads(self) -> None:
        self._grad_bytes = self.grad_bytes()
        self._expert_grad_bytes = self.grad_bytes(experts_only=True)

    def _after_update(self) -> None:
        self._publish_params()

    def _publish_params(self) -> None:
        """All-gather the updated shards into the full parameters (ZeRO-3 gathers lazily)."""
        works = []
        for b in self.buckets:
            src = b.shard.to(b.flat_param.dtype, copy=True)
            works.append((comm.all_gather(b.flat_param, src, b.shard_dim, async_op=True,
                                          tag="param_gather"), src))
        for w, _ in works:
            w.wait()

    # -- state --------------------------------------------------------------------------------
    def full_local_state(self) -> dict[str, torch.Tensor]:
        """Full tensors by name; with low-precision parameters, the fp32 master shards gathered
        (what the optimizer updates), not the parameters' low-precision copies."""
        if not self.low_precision:
            return super().full_local_state()
        state = {}
        for b in self.buckets:
            full = torch.empty(b.padded, dtype=b.shard.dtype, device=b.shard.device)
            comm.all_gather(full, b.shard, b.shard_dim, tag="full_state")
            for name, p, lo, hi in b.spans():
                state[name] = full[lo:hi].view(p.shape).clone()
        state.update({n: t.detach().clone() for n, t in persistent_buffers(self.module).items()})
        return state

    def held(self) -> list[Held]:
        """This rank's segments of the master shards: every rank of a shard group holds others."""
        return [Held(s.param_name, s.param, s.offset, s.tensor,
                     self.ctx.views[s.bucket.shard_dim]) for s in self.segments] \
            + buffers_held(self.module)

    def values_loaded(self) -> None:
        """The master shards were written: the full parameters follow (ZeRO-3: at their next
        gather)."""
        self._publish_params()

    def memory_report(self) -> dict:
        return {"params_bytes": self.param_bytes(), "grads_bytes": self._grad_bytes,
                "optimizer_bytes": self._optimizer_bytes(),
                "experts": {"params_bytes": self.param_bytes(experts_only=True),
                            "grads_bytes": self._expert_grad_bytes,
                            "optimizer_bytes": self._optimizer_bytes(experts_only=True)}}

    def _optimizer_bytes(self, experts_only: bool = False) -> int:
        keep = [b for b in self.buckets if not experts_only or self.bucket_is_expert(b)]
        kept = {b.index for b in keep}
        mine = {id(s.tensor) for s in self.segments if s.bucket.index in kept}
        opt = [v for t, st in self.optimizer.state.items() if id(t) in mine
               for v in st.values() if torch.is_tensor(v)]
        # A separate master copy (low-precision parameters) is optimizer state too.
        opt += [b.shard for b in keep if self._copies_master(b) and self.zero < 3]
        return nbytes(opt)

    def param_bytes(self, experts_only: bool = False) -> int:
        return sum(b.flat_param.untyped_storage().nbytes() for b in self.buckets
                   if not experts_only or self.bucket_is_expert(b))
