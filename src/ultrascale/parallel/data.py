"""Data parallel as a component driven by autograd hooks: bucketed, overlapped gradient reduction.

Each parameter gets a post-accumulate-grad hook. When every gradient of a bucket has been
accumulated during the backward of the last micro-batch, the bucket's reduction is launched
asynchronously, so it runs under the rest of the backward; `finish()` (called by the runtime
before clipping) waits only for what is still in flight. Backwards under `no_sync(last=False)`
only accumulate. The component knows nothing about how forward/backward are scheduled, so a
pipeline runtime that runs micro-batches in its own order gets the same reduction for free.

Low-precision parameters (parallel/precision.py) accumulate in fp32 buckets, and the fp32 master
weights (replicated.py) take the reduced fp32 sum as their gradient: no cast back to the
parameters' dtype. Without ZeRO-2/3 the buckets are slices of one flat gradient buffer, kept
from step to step (flat.py): a step's first micro-batch copies each gradient into its slice.

Gradients are SUMMED over each parameter's gradient view (`ctx.grad_dim`: dp, or dp x cp when
context parallel splits the sequences; the trainer already scales each loss by 1/global tokens).
A bucket holds parameters of one view only.

Hybrid sharding (`parallel.dp_shard` < dp, the playbook's hierarchical all-reduce): a bucket is
reduce-scattered inside the dp_shard group, the shard all-reduced across dp_replicate groups (slow
links carry 1/dp_shard of the bytes), then all-gathered back inside the group.

ZeRO stages extend this class (zero.py, zero3.py).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.buckets import Bucket, plan_buckets
from ultrascale.parallel.replicated import Replicated, weak_hook

MB = 2 ** 20


class DataParallel(Replicated):
    """ZeRO-0: full replicas; each bucket all-reduced over its view as soon as it is ready."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, *, bucket_mb: float = 25.0,
                 overlap: bool = True, accum_dtype: torch.dtype = torch.float32,
                 impl: str = "fused"):
        self.overlap, self.bucket_mb = overlap, bucket_mb
        self.hybrid = ctx.size("dp_replicate") > 1
        super().__init__(module, ctx, accum_dtype, impl)

    def _init_grads(self) -> None:
        """Buckets instead of one buffer; without ZeRO-2/3 (which free a bucket's gradient once
        it is reduced) every bucket's gradient is a slice of one flat buffer."""
        self.buckets = self._plan(self.bucket_mb)
        if self.zero < 2 and self.buckets:
            flat = torch.zeros(sum(b.padded for b in self.buckets), dtype=self.accum_dtype,
                               device=self.buckets[0].params[0].device)
            offset = 0
            for b in self.buckets:
                b.grad = flat[offset:offset + b.padded]
                offset += b.padded
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        self._sync = True  # outside no_sync, every backward is the last one
        # Bucket indices in launch order over the last step (tests, debugging).
        self.launch_log: deque[int] = deque(maxlen=len(self.buckets))

    def _plan(self, bucket_mb: float) -> list[Bucket]:
        sharded = self.hybrid or self.zero > 0  # buckets are cut into equal shards
        return plan_buckets(self.named, bucket_mb * MB, self.ctx, sharded, self.accum_dtype)

    def shard_of(self, b: Bucket) -> tuple[int, int]:
        """(this rank's index, ranks) in the group that shards bucket `b`."""
        return self.ctx.coord(b.shard_dim), self.ctx.size(b.shard_dim)

    # -- during backward ----------------------------------------------------------------------
    @contextmanager
    def no_sync(self, last: bool):
        """Wrap one micro-batch's backward; only the last one (last=True) launches reductions."""
        prev, self._sync = self._sync, last
        try:
            yield
        finally:
            self._sync = prev

    def accumulated_grad(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """The parameter's slice of its bucket, its gradient taken in (zeros if none came)."""
        b, i = self._where[id(p)]
        b.absorb(i, zero_if_none=True)
        return b.grad_view(i)

    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        b.absorb(i)
        b.ready.add(id(p))
        if len(b.ready) < len(b.params):
            return
        b.ready.clear()
        self._backward_done(b)
        if self._sync and self.overlap and not b.launched and not self._deferred(b):
            self._launch(b)

    def _backward_done(self, b: Bucket) -> None:
        """All gradients of `b` are in for this backward (ZeRO-3 frees the parameters here)."""

    def _deferred(self, b: Bucket) -> bool:
        """A tied embedding held by two pipeline stages gets its peer's gradient added after
        backward (pipeline runtime), so its bucket is reduced only in finish()."""
        return any(self.ctx.placement(n).copies > 1 for n in b.names)

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        self.launch_log.append(b.index)
        grad = b.grad_buffer()
        if self.hybrid:
            lo, hi = b.shard_range(*self.shard_of(b))
            b.grad_shard = torch.empty(hi - lo, dtype=grad.dtype, device=grad.device)
            b.works.append(comm.reduce_scatter(b.grad_shard, grad, b.shard_dim, async_op=True,
                                               tag="grad_bucket"))
        else:
            b.works.append(comm.all_reduce(grad, b.dim, async_op=True, tag="grad_bucket"))

    def _wait(self, b: Bucket) -> None:
        for w in b.works:
            w.wait()
        b.works.clear()

    def _complete(self, b: Bucket) -> None:
        self._wait(b)
        if self.hybrid:
            comm.all_reduce(b.grad_shard, "dp_replicate", tag="grad_bucket")
            comm.all_gather(b.grad, b.grad_shard, b.shard_dim, tag="grad_bucket")
            b.grad_shard = None
        for i, (name, p) in enumerate(zip(b.names, b.params)):
            self._link(name, p, b.grad_view(i))

    # -- after backward -----------------------------------------------------------------------
    def finish(self) -> None:
        """Launch what backward did not (deferred buckets, overlap off, gradients assigned by
        hand), then wait for every reduction."""
        for b in self.buckets:
            b.ready.clear()
            if not b.launched:
                b.absorb_all()
                self._launch(b)
        for b in self.buckets:
            self._complete(b)
            b.launched = False

    def _drop_grads(self) -> None:
        super()._drop_grads()
        for b in self.buckets:
            b.fresh.clear()

    def grad_bytes(self) -> int:
        return sum(b.grad.numel() * b.grad.element_size() for b in self.buckets
                   if b.grad is not None)
