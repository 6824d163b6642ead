"""The one door for communication: every collective and point-to-point transfer goes through here.

Each call is counted per (kind, mesh dimension): number of calls, payload bytes, the bytes each rank
puts on the wire under the standard ring algorithms, and time. Tests use the counters to check that
DP moves 2(N-1)/N x the gradients, ZeRO-3 about 3 psi, and so on; the planner calibrates with them.

Conventions (N = ranks in the group, B = bytes of the full, unsharded buffer):
    all_reduce       payload B     wire 2(N-1)/N B
    all_gather       payload B     wire (N-1)/N B      (B = bytes of the gathered output)
    reduce_scatter   payload B     wire (N-1)/N B      (B = bytes of the full input)
    all_to_all       payload B     wire (N-1)/N B, or with split sizes exactly the rows sent to
                                   other ranks (B less this rank's own split)
    broadcast        payload B     wire B (root), 0 (others)
    send / recv      payload B     wire B (send), 0 (recv)
    ring_shift       payload B     wire B              (B = bytes this rank sends to the next one
                                                        of the ring, receiving as much from the
                                                        previous one)
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ultrascale.distributed.mesh import ParallelContext
from ultrascale.distributed.recorder import Recorder

# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter (the old names warn); older
# torch, which a GPU user may have, only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_ctx: ParallelContext | None = None
_recorder: Recorder | None = None  # each transfer noted as it enters and returns (recorder.py)


def set_context(ctx: ParallelContext) -> None:
    global _ctx
    _ctx = ctx


def record_collectives(log_dir, rank: int) -> None:
    """Keep this rank's last transfers in `log_dir` (recorder.py), from now until the next call
    or `stop_recording`; the ranks of each mesh view go beside them."""
    global _recorder
    stop_recording()
    ctx = context()
    peers = {view: ctx.peers(view) for view, n in ctx.sizes.items() if n > 1}
    _recorder = Recorder(log_dir, rank, peers)


def stop_recording() -> None:
    global _recorder
    if _recorder is not None:
        _recorder.close()
    _recorder = None


def _enter(kind: str, dim: str, nbytes: int, peer: int = -1) -> int | None:
    return _recorder.enter(kind, dim, nbytes, peer) if _recorder is not None else None


def _returned(slot: int | None) -> None:
    if slot is not None and _recorder is not None:
        _recorder.returned(slot)


def context() -> ParallelContext:
    if _ctx is None:
        raise RuntimeError("comm.set_context(ctx) must be called before communicating")
    return _ctx


@dataclass
class Counter:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    time_s: float = 0.0


@dataclass
class CommEvent:
    """One launched collective, for tests that check ordering (e.g. overlap with backward)."""

    t: float
    kind: str
    dim: str
    bytes: int
    tag: str = ""
    wire: float = 0.0


@dataclass
class CommStats:
    counters: dict[tuple[str, str], Counter] = field(default_factory=lambda: defaultdict(Counter))
    record_events: bool = False
    events: list[CommEvent] = field(default_factory=list)

    def add(self, kind: str, dim: str, nbytes: int, wire: float, seconds: float, tag: str) -> None:
        c = self.counters[(kind, dim)]
        c.calls += 1
        c.bytes += nbytes
        c.wire_bytes += wire
        c.time_s += seconds
        if self.record_events:
            self.events.append(CommEvent(time.perf_counter(), kind, dim, nbytes, tag, wire))

    def reset(self) -> None:
        self.counters.clear()
        self.events.clear()

    def snapshot(self) -> dict[tuple[str, str], Counter]:
        return {k: Counter(v.calls, v.bytes, v.wire_bytes, v.time_s) for k, v in self.counters.items()}

    def total(self, kind: str | None = None, dim: str | None = None, what: str = "bytes") -> float:
        return sum(getattr(c, what) for (k, d), c in self.counters.items()
                   if (kind is None or k == kind) and (dim is None or d == dim))

    def summary(self) -> dict:
        """Flat dict for the metrics file: {"all_reduce/dp": {...}, ...}."""
        return {f"{k}/{d}": {"calls": c.calls, "bytes": c.bytes, "wire_bytes": int(c.wire_bytes),
                             "time_s": round(c.time_s, 6)}
                for (k, d), c in sorted(self.counters.items())}


stats = CommStats()


@contextmanager
def counting():
    """Yield a CommStats that, when the block ends, holds the traffic of that block only."""
    before = stats.snapshot()
    n_events = len(stats.events)
    delta = CommStats()
    try:
        yield delta
    finally:
        for key, c in stats.counters.items():
            b = before.get(key, Counter())
            if c.calls != b.calls or c.time_s != b.time_s:
                delta.counters[key] = Counter(c.calls - b.calls, c.bytes - b.bytes,
                                              c.wire_bytes - b.wire_bytes, c.time_s - b.time_s)
        delta.events = stats.events[n_events:]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedWork:
    """Wraps an async work handle so the time spent waiting for it is counted."""

    def __init__(self, work, kind: str, dim: str, slot: int | None = None):
        self.work, self.kind, self.dim, self.slot = work, kind, dim, slot

    def wait(self) -> None:
        if self.work is None:
            return
        t0 = time.perf_counter()
        self.work.wait()
        stats.counters[(self.kind, self.dim)].time_s += time.perf_counter() - t0
        self.work = None
        _returned(self.slot)

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


def _group_and_size(dim: str):
    ctx = context()
    size = ctx.size(dim) if dim in ctx.sizes else None
    group = ctx.group(dim)
    if size is None:  # a named group that is not a mesh dim (e.g. "world")
        size = dist.get_world_size(group)
    return group, size


def _run(kind: str, dim: str, nbytes: int, wire: float, launch, async_op: bool, tag: str):
    slot = _enter(kind, dim, nbytes)
    t0 = time.perf_counter()
    work = launch()
    if async_op:
        stats.add(kind, dim, nbytes, wire, time.perf_counter() - t0, tag)
        return CountedWork(work, kind, dim, slot)
    stats.add(kind, dim, nbytes, wire, time.perf_counter() - t0, tag)
    _returned(slot)
    return None


def all_reduce(tensor: torch.Tensor, dim: str, op=dist.ReduceOp.SUM, async_op: bool = False,
               tag: str = ""):
    group, n = _group_and_size(dim)
    if n == 1:
        return CountedWork(None, "all_reduce", dim) if async_op else None
    b = _nbytes(tensor)
    return _run("all_reduce", dim, b, 2 * (n - 1) / n * b,
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                async_op, tag)


def all_gather(output: torch.Tensor, input: torch.Tensor, dim: str, async_op: bool = False,
               tag: str = ""):
    """Gather `input` from every rank of `dim` into `output` (concatenated along dim 0)."""
    group, n = _group_and_size(dim)
    if n == 1:
        output.copy_(input)
        return CountedWork(None, "all_gather", dim) if async_op else None
    b = _nbytes(output)
    return _run("all_gather", dim, b, (n - 1) / n * b,
                lambda: _all_gather_single(output, input, group=group, async_op=async_op),
                async_op, tag)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, dim: str, op=dist.ReduceOp.SUM,
                   async_op: bool = False, tag: str = ""):
    """Reduce `input` over `dim` and keep this rank's 1/N slice (along dim 0) in `output`."""
    group, n = _group_and_size(dim)
    if n == 1:
        output.copy_(input)
        return CountedWork(None, "reduce_scatter", dim) if async_op else None
    b = _nbytes(input)
    return _run("reduce_scatter", dim, b, (n - 1) / n * b,
                lambda: _reduce_scatter_single(output, input, op=op, group=group,
                                                    async_op=async_op),
                async_op, tag)


def all_to_all(output: torch.Tensor, input: torch.Tensor, dim: str, output_split_sizes=None,
               input_split_sizes=None, async_op: bool = False, tag: str = ""):
    """Rank i's input split j goes to rank j's output split i (along dim 0); split sizes are
    rows, uneven where given (the expert dispatch), equal otherwise."""
    group, n = _group_and_size(dim)
    if n == 1:
        output.copy_(input)
        return CountedWork(None, "all_to_all", dim) if async_op else None
    b = _nbytes(input)
    wire = (n - 1) / n * b
    if input_split_sizes is not None:  # exactly what leaves this rank
        row = b // input.shape[0] if input.shape[0] else 0
        wire = b - input_split_sizes[context().coord(dim)] * row
    return _run("all_to_all", dim, b, wire,
                lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                               input_split_sizes, group=group, async_op=async_op),
                async_op, tag)


def broadcast(tensor: torch.Tensor, dim: str, src_local: int = 0, tag: str = "") -> None:
    """Broadcast from the rank with index `src_local` along `dim`."""
    group, n = _group_and_size(dim)
    if n == 1:
        return
    src = dist.get_global_rank(group, src_local) if group is not None else src_local
    b = _nbytes(tensor)
    is_src = dist.get_rank() == src
    _run("broadcast", dim, b, b if is_src else 0.0,
         lambda: dist.broadcast(tensor, src=src, group=group), False, tag)


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], dim: str = "pp", tag: str = ""):
    """Launch a batch of point-to-point transfers asynchronously.

    `ops` holds ("send" | "recv", tensor, peer global rank). Returns the list of work handles (call
    `wait()` on each). Sends and receives are counted separately.
    """
    if not ops:
        return []
    group = context().group(dim)
    p2p, slots = [], []
    for kind, tensor, peer in ops:
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, tensor, peer, group))
        b = _nbytes(tensor)
        stats.add(kind, dim, b, b if kind == "send" else 0.0, 0.0, tag)
        slots.append(_enter(kind, dim, b, peer))
    works = dist.batch_isend_irecv(p2p)
    if len(works) != len(ops):
        # NCCL coalesces the batch into one work: every op then completes with it (waiting on a
        # finished work again returns at once).
        works = works[:1] * len(ops)
    # Each handle counts the time spent waiting on it under its own kind.
    return [CountedWork(w, kind, dim, slot) for (kind, _, _), w, slot in zip(ops, works, slots)]


def ring_shift(send: torch.Tensor | None, recv: torch.Tensor | None, dim: str,
               tag: str = "") -> CountedWork:
    """Send `send` to the next rank around the ring of `dim` and receive `recv` from the previous
    one, asynchronously (context parallel's K/V and dK/dV blocks); `wait()` the handle before
    reading `recv` or reusing `send`. Counted once per shift as the bytes sent. Either may be
    None: a receive posted on its own, ahead of the send of the same shift (so that the previous
    rank's message lands while this rank computes), counts nothing; the send counts the shift."""
    ctx = context()
    prev, nxt = ctx.ring(dim)
    group = ctx.group(dim)
    t0 = time.perf_counter()
    ops = ([dist.P2POp(dist.isend, send, nxt, group)] if send is not None else []) + \
        ([dist.P2POp(dist.irecv, recv, prev, group)] if recv is not None else [])
    # Noted as a wait on the previous rank's message (or on the next rank, for a send alone).
    slot = _enter("ring_shift", dim, _nbytes(send if send is not None else recv),
                  prev if recv is not None else nxt)
    works = dist.batch_isend_irecv(ops)
    if send is not None:
        b = _nbytes(send)
        stats.add("ring_shift", dim, b, float(b), time.perf_counter() - t0, tag)
    return _AllWorks(works, "ring_shift", dim, slot)


class _AllWorks(CountedWork):
    """Several work handles waited for as one (a send and a receive posted together)."""

    def __init__(self, works, kind: str, dim: str, slot: int | None = None):
        super().__init__(list(works), kind, dim, slot)

    def wait(self) -> None:
        if self.work is None:
            return
        t0 = time.perf_counter()
        for w in self.work:
            w.wait()
        stats.counters[(self.kind, self.dim)].time_s += time.perf_counter() - t0
        self.work = None
        _returned(self.slot)

    def is_completed(self) -> bool:
        return self.work is None or all(w.is_completed() for w in self.work)


def barrier() -> None:
    if dist.is_initialized():
        slot = _enter("barrier", "world", 0)
        dist.barrier()
        _returned(slot)
