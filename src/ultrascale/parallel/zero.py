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
        self.segments = self._make_segments()

    # -- layout -------------------------------------------------------------------------------
    def _flatten(self, b: Bucket) -> None:
        """Move the bucket's parameters into one flat buffer and take this rank's shard."""
        dtype = b.params[0].dtype
        if any(p.dtype != dtype for p in b.params):
            raise ValueError(f"ZeRO bucket {b.index} mixes parameter dtypes {b.names}")
        flat = torch.zeros(b.padded, dtype=dtype, device=b.params[0].device)
        with torch.no_grad():
            for _, p, lo, hi in b.spans():
                flat[lo:hi].copy_(p.detach().reshape(-1))
                p.data = flat[lo:hi].view(p.shape)
        b.flat_param = flat
        lo, hi = b.shard_range(*self.shard_of(b))
        b.shard = self._master(flat[lo:hi])

    def _master(self, local: torch.Tensor) -> torch.Tensor:
        """fp32 parameters: the master shard is the local slice of the flat parameter itself (no
        copy); lower-precision parameters get an fp32 master copy."""
        return local if local.dtype == torch.float32 else local.float()

    def _make_segments(self) -> list[Segment]:
        segs = []
        for b in self.buckets:
            lo, hi = b.shard_range(*self.shard_of(b))
            for name, p, a, z in b.spans():
                s, e = max(a, lo), min(z, hi)
                if s < e:
                    segs.append(Segment(f"{name}@{s - a}", name, p, b, s - lo, e - lo,
                                        b.shard[s - lo:e - lo], s - a))
        return segs

    # -- reduction ----------------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        b.launched = True
        self.launch_log.append(b.index)
        grad = b.grad_buffer()
        lo, hi = b.shard_range(*self.shard_of(b))
        b.grad_shard = torch.empty(hi - lo, dtype=grad.dtype, device=grad.device)
        b.works.append(comm.reduce_scatter(b.grad_shard, grad, b.shard_dim, async_op=True,
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
            comm.all_reduce(b.grad_shard, "dp_replicate", tag="grad_bucket")
        if self.zero == 1:  # keep only the full buffer: its own slice now holds the reduced sum
            lo, hi = b.shard_range(*self.shard_of(b))
            b.grad[lo:hi].copy_(b.grad_shard)
            b.grad_shard = b.grad[lo:hi]
        else:
            b.free_grad()

    def after_step(self) -> None:
        for b in self.buckets:
            if self.zero == 1:
                b.grad.zero_()
            b.grad_shard = None

    def bucket_is_expert(self, b: Bucket) -> bool:
        return self.is_expert(b.names[0])  # a bucket holds parameters of one view only

    def grad_bytes(self, experts_only: bool = False) -> int:
        total = 0
        for b in self.buckets:
            if experts_only and not self.bucket_is_expert(b):
                continue
            for t in (b.grad, b.grad_shard):
                if t is not None and t._base is None:  # a view of the full buffer is not extra
                    total += t.numel() * t.element_size()
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

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Each gradient element is held by one rank of its shard group, and by every replica
        outside it (hybrid replicas, tp ranks where it is not split, a tied embedding's copy)."""
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for s in self.segments:
            g = s.bucket.grad_shard[s.start:s.end]
            copies = self.ctx.replicas(s.param_name) // self.ctx.size(s.bucket.shard_dim)
            total += g.double().pow(2).sum() / copies
        return total

    def scale_grads(self, coef: float) -> None:
        for b in self.buckets:
            b.grad_shard.mul_(coef)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for s in self.segments:
            s.tensor.grad = s.bucket.grad_shard[s.start:s.end].to(s.tensor.dtype)
        self._count_grads()
        self.optimizer.step()
        for s in self.segments:
            s.tensor.grad = None
        self.after_step()
        self._publish_params()

    def skip_step(self) -> None:
        """No update (fp16 overflow): the reduced gradients are dropped, the shards unchanged."""
        self._count_grads()
        self.after_step()

    def _count_grads(self) -> None:
        self._grad_bytes = self.grad_bytes()
        self._expert_grad_bytes = self.grad_bytes(experts_only=True)

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
        opt += [b.shard for b in keep if b.shard._base is None and self.zero < 3]
        return nbytes(opt)

    def param_bytes(self, experts_only: bool = False) -> int:
        return sum(b.flat_param.untyped_storage().nbytes() for b in self.buckets
                   if not experts_only or self.bucket_is_expert(b))
