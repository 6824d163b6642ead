"""The communication of tensor parallel, written as autograd functions (Megatron's f/g pairs).

Without sequence parallel the activations entering a block are replicated on the tp ranks:
    f = copy_to_tp          identity forward,      all-reduce backward   (before a column layer)
    g = reduce_from_tp      all-reduce forward,    identity backward     (after a row layer)
With sequence parallel they are split along the sequence (dim 1 of [batch, seq, hidden]):
    gather_seq              all-gather forward,    reduce-scatter backward
    reduce_scatter_seq      reduce-scatter forward, all-gather backward

`column_parallel` fuses f (or the gather) with the matmuls of the layers that share one input
(q/k/v, gate/up): one collective for all of them, and in backward the input-gradient reduction is
launched asynchronously and overlapped with the weight-gradient matmuls when `overlap` is on.
Under sequence parallel it saves only the local sequence shard of its input and gathers it again in
backward (Korthikanti et al. 2022), so that the saved activations shrink by 1/tp.

Every collective goes through `distributed/comm.py` on the mesh dimension "tp".
"""

from __future__ import annotations

import torch

from ultrascale.distributed import comm
from ultrascale.models.llama import LinearMatmul

TP = "tp"


def tp_size() -> int:
    return comm.context().size(TP)


# -- sequence-dim collectives ([b, s, h] layout; comm gathers along dim 0, so go through [s, b, h])


class _Pending:
    """A launched collective and how to read its result once it has completed."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def _gather_seq(x: torch.Tensor, tag: str, async_op: bool = False):
    inp = x.transpose(0, 1).contiguous()
    out = inp.new_empty((tp_size() * inp.shape[0],) + tuple(inp.shape[1:]))
    work = comm.all_gather(out, inp, TP, async_op=async_op, tag=tag)
    pending = _Pending(work, lambda: out.transpose(0, 1))
    return pending if async_op else pending.wait()


def _reduce_scatter_seq(x: torch.Tensor, tag: str, async_op: bool = False):
    inp = x.transpose(0, 1).contiguous()
    n = tp_size()
    if inp.shape[0] % n:
        raise ValueError(f"sequence length {inp.shape[0]} is not divisible by tp={n}")
    out = inp.new_empty((inp.shape[0] // n,) + tuple(inp.shape[1:]))
    work = comm.reduce_scatter(out, inp, TP, async_op=async_op, tag=tag)
    pending = _Pending(work, lambda: out.transpose(0, 1))
    return pending if async_op else pending.wait()


def _all_reduce(x: torch.Tensor, tag: str, async_op: bool = False):
    """All-reduce a tensor this module owns (it is reduced in place)."""
    x = x.contiguous()
    work = comm.all_reduce(x, TP, async_op=async_op, tag=tag)
    pending = _Pending(work, lambda: x)
    return pending if async_op else pending.wait()


# -- the f/g pairs ----------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward. Also used on a replicated
    parameter whose gradient each rank computes only in part (norm weights under sequence
    parallel, kv projections replicated for grouped-query attention)."""

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tag), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        if x.is_contiguous():  # a fresh matmul output: reduce it in place rather than copy it
            ctx.mark_dirty(x)
            return _all_reduce(x, "tp_fwd")
        return _all_reduce(x.contiguous(), "tp_fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_seq(x, "tp_fwd")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, "tp_bwd")


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x, "tp_fwd")

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, "tp_bwd")


def copy_to_tp(x: torch.Tensor, tag: str = "tp_bwd") -> torch.Tensor:
    return _CopyToTP.apply(x, tag)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTP.apply(x)


def gather_seq(x: torch.Tensor) -> torch.Tensor:
    return _GatherSeq.apply(x)


def reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x)


def enter_tp(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Make a block input usable by a column-parallel layer: full sequence, gradient summed."""
    return gather_seq(x) if sequence_parallel else copy_to_tp(x)


def exit_tp(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Sum the partial outputs of a row-parallel layer (scattered along the sequence under SP)."""
    return reduce_scatter_seq(x) if sequence_parallel else reduce_from_tp(x)


# -- column-parallel matmuls sharing one input ---------------------------------------------------


class _Weights:
    """The weights as given, out of autograd's sight: a matmul that may defer its weight gradients
    (zero bubble) gets them detached, so that an I pass reaches neither them nor the graph that made
    them (a replicated kv projection's rows, summed over tp), and its W feeds them later."""

    __slots__ = ("weights",)

    def __init__(self, weights):
        self.weights = weights


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sequence_parallel, overlap, matmul, held, *weights):
        ctx.sp, ctx.overlap, ctx.matmul, ctx.held = sequence_parallel, overlap, matmul, held
        xg = _gather_seq(x, "tp_fwd") if sequence_parallel else x
        # Under SP only the local shard is kept; backward gathers it again.
        ctx.save_for_backward(x, *weights)
        return tuple(matmul(xg, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        dtype = next(g.dtype for g in grads if g is not None)  # the compute dtype
        if ctx.held is None:  # autograd takes the weight gradients as this function's outputs
            wanted = [(w, g) for w, g, need in zip(weights, grads, ctx.needs_input_grad[5:])
                      if g is not None and need]
        else:
            wanted = [(w, g) for w, g in zip(ctx.held.weights, grads)
                      if g is not None and w.requires_grad]

        def weight_grads(gathering=None):
            # Under SP the input's sequence shards are gathered again, here or in the W pass.
            if gathering is None and ctx.sp:
                gathering = _gather_seq(x, "tp_regather", async_op=True)
            xg = gathering.wait() if gathering is not None else x
            xg2 = xg.reshape(-1, xg.shape[-1]).to(dtype)
            for w, g in wanted:
                yield w, ctx.matmul.grad_weight(g.reshape(-1, g.shape[-1]), xg2).to(w.dtype)

        deferred = ctx.held is not None and bool(wanted) and ctx.matmul.defer_weight_grads(
            [w for w, _ in wanted], x, tuple(g for _, g in wanted), weight_grads)
        gathering = _gather_seq(x, "tp_regather", async_op=True) if ctx.sp and not deferred \
            else None
        grad_x = pending = None
        if ctx.needs_input_grad[0]:
            for g, w in zip(grads, weights):
                if g is not None:
                    part = ctx.matmul.grad_input(g, w)
                    grad_x = part if grad_x is None else grad_x.add_(part)
            # The partial input gradients of the tp ranks are summed; the weight-gradient matmuls
            # below run while that collective is in flight.
            reduce = _reduce_scatter_seq if ctx.sp else _all_reduce
            pending = reduce(grad_x, "tp_bwd", async_op=True)
            if not ctx.overlap:
                grad_x, pending = pending.wait(), None
        grad_ws = [None] * len(weights)
        if ctx.held is None:
            computed = {id(w): gw for w, gw in weight_grads(gathering)}
            grad_ws = [computed.get(id(w)) for w in weights]
        elif not deferred:  # a full backward (B): into the weights now, as W would
            for w, gw in weight_grads(gathering):
                torch.autograd.backward(w, gw)
        if pending is not None:
            grad_x = pending.wait()
        if grad_x is not None:
            grad_x = grad_x.to(x.dtype)
        return (grad_x, None, None, None, None, *grad_ws)


def column_parallel(x: torch.Tensor, weights: list[torch.Tensor], sequence_parallel: bool,
                    overlap: bool, matmul: LinearMatmul) -> tuple[torch.Tensor, ...]:
    """x @ w.T for each local weight shard (split along its output features), x entering the tensor
    parallel region once for all of them. `matmul`: the layers' (`Linear.matmul`: their
    precision's three matmuls; zero bubble's may take the weight gradients for its W pass)."""
    if matmul.may_defer:
        return _ColumnParallel.apply(x, sequence_parallel, overlap, matmul, _Weights(weights),
                                     *(w.detach() for w in weights))
    return _ColumnParallel.apply(x, sequence_parallel, overlap, matmul, None, *weights)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool,
                 matmul: LinearMatmul) -> torch.Tensor:
    """x (split along features) @ w.T (split along input features), partial sums reduced."""
    return exit_tp(matmul(x, weight), sequence_parallel)
