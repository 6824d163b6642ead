"""Flat buckets of parameters, the unit of gradient reduction (and of sharding under ZeRO).

A bucket lays the gradients of a few parameters end to end in one flat buffer, so that one
collective moves them all. Its length is padded to a multiple of the shard-group size so that
ZeRO can cut it into equal shards: rank r of the group owns elements [r*S, (r+1)*S).

Gradient flow: a step's first micro-batch copies each parameter's fresh gradient into its slice of
the bucket buffer (so the buffer needs no zero fill between steps); then `p.grad` is that slice
whenever the dtypes agree, and autograd accumulates the later micro-batches in place. When
parameters are in a lower precision than the accumulation dtype (fp32), the hook adds each later
low-precision gradient into the fp32 buffer and drops it: the playbook's fp32 gradient
accumulation buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ultrascale.parallel.flat import same_memory, take_grad


@dataclass
class Bucket:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # unpadded
    padded: int  # numel rounded up to a multiple of the shard-group size
    accum_dtype: torch.dtype
    dim: str = "dp"  # the view its gradients are summed over (ctx.grad_dim)
    shard_dim: str = "dp"  # the view ZeRO / hybrid sharding cuts it over (ctx.shard_dim)
    grad: torch.Tensor | None = None  # full flat gradient; None while freed (ZeRO-2/3)
    ready: set[int] = field(default_factory=set)  # ids of params done in the current backward
    launched: bool = False  # its reduction for this step has started
    works: list = field(default_factory=list)  # in-flight collectives
    fresh: set[int] = field(default_factory=set)  # params whose gradient is in `grad` this step
    # ZeRO: the flat parameter (params are views of it), this rank's master shard and the
    # reduced gradient shard.
    flat_param: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    reduced: torch.Tensor | None = None  # a reduce-scatter's output while it is in flight

    def spans(self):
        """(name, param, start, end) of each parameter in the flat buffer."""
        for n, p, o in zip(self.names, self.params, self.offsets):
            yield n, p, o, o + p.numel()

    def grad_buffer(self) -> torch.Tensor:
        if self.grad is None:
            p = self.params[0]
            self.grad = torch.zeros(self.padded, dtype=self.accum_dtype, device=p.device)
        return self.grad

    def grad_view(self, i: int) -> torch.Tensor:
        p, o = self.params[i], self.offsets[i]
        return self.grad_buffer()[o:o + p.numel()].view(p.shape)

    def absorb(self, i: int, zero_if_none: bool = False) -> None:
        """Make sure parameter i's gradient lives in the buffer: copied in (the step's first) or
        added; with `zero_if_none`, a parameter no backward reached this step gets zeros."""
        p = self.params[i]
        view = self.grad_view(i)
        if p.grad is not None and not same_memory(p.grad, view):
            take_grad(view, p.grad, first=i not in self.fresh)
            p.grad = view if view.dtype == p.dtype else None
        elif p.grad is None and i not in self.fresh:
            if not zero_if_none:
                return
            view.zero_()
        self.fresh.add(i)

    def absorb_all(self) -> None:
        """Every parameter's gradient in the buffer, zeros where none came (before a reduction)."""
        for i in range(len(self.params)):
            self.absorb(i, zero_if_none=True)

    def free_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.grad = None
        self.fresh.clear()

    def shard_range(self, rank: int, n: int) -> tuple[int, int]:
        s = self.padded // n
        return rank * s, (rank + 1) * s


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_bucket(index: int, named: list[tuple[str, nn.Parameter]], pad_to: int,
                accum_dtype: torch.dtype, dim: str = "dp", shard_dim: str = "dp") -> Bucket:
    offsets, o = [], 0
    for _, p in named:
        offsets.append(o)
        o += p.numel()
    return Bucket(index, [n for n, _ in named], [p for _, p in named], offsets, o,
                  _round_up(max(o, 1), pad_to), accum_dtype, dim, shard_dim)


def bucket_views(ctx, name: str, sharded: bool) -> tuple[str, str, int]:
    """(gradient view, shard view, padding multiple) of the parameter `name`."""
    shard_dim = ctx.shard_dim(name)
    return ctx.grad_dim(name), shard_dim, ctx.size(shard_dim) if sharded else 1


def plan_buckets(named: list[tuple[str, nn.Parameter]], cap_bytes: float, ctx, sharded: bool,
                 accum_dtype: torch.dtype) -> list[Bucket]:
    """Group parameters in reverse registration order (roughly the order in which backward
    produces their gradients) into buckets of about `cap_bytes` of gradient each; a bucket holds
    parameters of one gradient view only (experts and dense weights reduce over different ranks).
    `sharded`: pad each bucket to a multiple of its shard group, for ZeRO / hybrid sharding."""
    groups: list[tuple[tuple, list[tuple[str, nn.Parameter]]]] = []
    size = 0
    elem = torch.empty((), dtype=accum_dtype).element_size()
    for n, p in reversed(named):
        views = bucket_views(ctx, n, sharded)
        if not groups or groups[-1][0] != views or (
                groups[-1][1] and size + p.numel() * elem > cap_bytes):
            groups.append((views, []))
            size = 0
        groups[-1][1].append((n, p))
        size += p.numel() * elem
    return [make_bucket(i, g, pad, accum_dtype, dim, shard_dim)
            for i, ((dim, shard_dim, pad), g) in enumerate(groups)]
