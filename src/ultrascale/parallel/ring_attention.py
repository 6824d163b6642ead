"""Blockwise attention over the cp ranks: the ring and the all-gather, as autograd functions.

Each cp rank holds the queries, keys and values of its own positions. Attention of its queries
over the whole sequence is cut into one block per cp rank's keys; `plan_blocks` decides, from the
absolute positions of the queries and of the keys (and, with document masking, from where each
query's document starts; with a sliding window, from its width), which slices of a block are
wholly visible, causal on their diagonal, masked (positions that are neither), or skipped (no
query sees any key: their documents do not meet, or the keys lie outside every query's window;
that work is never done). Each piece returns its output and log-sum-exp
(`attention_blocks.attention_with_lse`), and `merge_attention_` folds them into the running
result, so no rank ever holds a score matrix of the whole sequence.

- ring (`ring_attention`): K and V go round the ring of `cp`; at each step the next shift is
  posted before the current block is computed. The backward passes K and V round again and sends
  each block's dK/dV accumulator along behind it, so that it comes home to its owner after cp - 1
  shifts, having collected every rank's share (`attention_with_lse_backward` with the merged
  output and lse).
- all-gather (`all_gather_attention`): K and V all-gathered once (the own block is computed while
  the gather is in flight); the backward gathers them again rather than keep cp blocks alive, and
  reduce-scatters dK/dV.

Both save only the local q, k, v, output and lse, as a flash attention does: the saved bytes of a
rank fall as 1/cp. dK/dV are accumulated and sent in fp32.

Layout: the blocks compute heads first ([b, h, s, d], attention_blocks.py). K and V, which
every block of queries reads again, are stacked heads first and contiguous once per call (the
message the transports send anyway; values of a head width of their own, multi-head latent
attention's, packed beside the keys: `_stack_kv`); the queries, the output, the upstream gradient and the
gradients stay in the model's sequence-first memory, seen through transposed views, so nothing
is copied back for the output projection and the gradients return contiguous. (Measured on the
CPU kernel, `benchmarks/bench_ring_breakdown.py`: contiguous K/V rows make it ~5% faster forward
and backward; the queries' layout moves it by 3% at most.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from ultrascale.distributed import comm
from ultrascale.models.documents import Documents
from ultrascale.parallel.attention_blocks import (
    attention_with_lse, attention_with_lse_backward, merge_attention_,
)

CP = "cp"


# -- the plan: which pieces of a block are computed, from positions alone -------------------------


@dataclass(frozen=True)
class Piece:
    """Queries q of this rank against keys k of one block: "full", "causal" (the same positions on
    both sides, in increasing order) or "mask" (`mask` [q, k], True = attend); of the sequences
    `b` of the micro-batch (all of them, unless documents make each sequence's plan its own)."""

    q: slice
    k: slice
    kind: str
    mask: torch.Tensor | None = None
    b: slice = field(default_factory=lambda: slice(None))

    def work(self) -> int:
        """Query-key pairs it computes that causality keeps (the causal work), per sequence."""
        nq, nk = self.q.stop - self.q.start, self.k.stop - self.k.start
        if self.kind == "full":
            return nq * nk
        if self.kind == "causal":
            return nq * (nq + 1) // 2
        return int(self.mask.sum())

    def covers(self, t: torch.Tensor, keys: bool = False) -> bool:
        """Whether it spans every sequence and every query (or key) of t [b, h, s, d]."""
        return self.b == slice(None) and (self.k if keys else self.q) == slice(0, t.shape[2])


def _runs(pos: np.ndarray, starts: np.ndarray | None = None) -> list[slice]:
    """Maximal slices of consecutive increasing positions (within one document, given the
    starts of each position's document)."""
    breaks = np.diff(pos) != 1
    if starts is not None:
        breaks |= np.diff(starts) != 0
    edges = [0, *(np.flatnonzero(breaks) + 1).tolist(), len(pos)]
    return [slice(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _pieces_of_runs(qs: slice, q0: int, ks: slice, k0: int, q_pos, k_pos) -> list[Piece]:
    """Queries at positions q0.. (slice qs) against keys at k0.. (slice ks), both consecutive:
    the keys before the first query are seen by all (full), the keys at the queries' own
    positions form a causal diagonal (or, when they cover only part of it, a mask), the keys
    after the last query are seen by none (skipped)."""
    nq, nk = qs.stop - qs.start, ks.stop - ks.start
    lo = min(max(q0 - k0, 0), nk)  # keys k0 .. q0-1
    hi = min(max(q0 + nq - k0, 0), nk)  # keys up to the last query's position
    out = []
    if lo > 0:
        out.append(Piece(qs, slice(ks.start, ks.start + lo), "full"))
    if hi > lo:
        diag = slice(ks.start + lo, ks.start + hi)
        if hi - lo == nq and k0 + lo == q0:
            out.append(Piece(qs, diag, "causal"))
        else:
            out.append(Piece(qs, diag, "mask", q_pos[qs, None] >= k_pos[None, diag]))
    return out


def _in_document(ks: slice, k0: int, first: int | None) -> tuple[slice, int]:
    """The keys of a run (slice ks, positions from k0) at or after a document's first position."""
    if first is None or first <= k0:
        return ks, k0
    skip = min(first - k0, ks.stop - ks.start)
    return slice(ks.start + skip, ks.stop), k0 + skip


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor,
                q_starts: torch.Tensor | None = None, window: int | None = None
                ) -> tuple[Piece, ...]:
    """The pieces that attention of queries at `q_pos` over keys at `k_pos` needs (causal by
    position: a query sees the keys at its position or before), as few as possible. With
    `q_starts` (the first position of each query's document, documents.py) a query sees only
    the keys of its own document: the queries are cut at document boundaries and each part's
    keys begin at its document's start, so that every piece stays full or causal. With a
    sliding `window`, a query sees only the window - 1 keys before its own (`_within_window`)."""
    pieces = _causal_pieces(q_pos, k_pos, q_starts, whole=window is None)
    if window is None:
        return pieces
    return tuple(w for p in pieces if (w := _within_window(p, q_pos, k_pos, window)) is not None)


def _within_window(p: Piece, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int
                   ) -> Piece | None:
    """A piece cut to a sliding window: as it is when every key it holds lies within every
    query's window, None when none does (never computed), else trimmed to the queries and keys
    that meet in it and masked by the window too (full where they all meet). Decided on the
    host copies of the positions (a fake step knows those, not a long sequence's masks)."""
    qn, kn = q_pos.numpy()[p.q], k_pos.numpy()[p.k]
    if kn.min() > qn.max() - window:
        return p
    # Every piece's pairs are causal by position (documents only cut which pieces exist).
    seen = (kn[None, :] > qn[:, None] - window) & (qn[:, None] >= kn[None, :])
    rows, cols = np.flatnonzero(seen.any(1)), np.flatnonzero(seen.any(0))
    if rows.size == 0:
        return None
    qs = slice(p.q.start + int(rows[0]), p.q.start + int(rows[-1]) + 1)
    ks = slice(p.k.start + int(cols[0]), p.k.start + int(cols[-1]) + 1)
    if seen[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].all():
        return replace(p, q=qs, k=ks, kind="full", mask=None)
    qt, kt = q_pos[qs, None], k_pos[None, ks]
    return replace(p, q=qs, k=ks, kind="mask", mask=(kt > qt - window) & (qt >= kt))


def _causal_pieces(q_pos: torch.Tensor, k_pos: torch.Tensor, q_starts: torch.Tensor | None,
                   whole: bool = True) -> tuple[Piece, ...]:
    """`plan_blocks` without a window; `whole`: one causal piece where the queries and keys are
    the same increasing positions (else a piece per run of consecutive positions, which a
    window then cuts finer)."""
    qp, kp = q_pos.numpy(), k_pos.numpy()
    qd = None if q_starts is None else q_starts.numpy()
    if whole and qd is None and np.array_equal(qp, kp) and bool((np.diff(qp) > 0).all()):
        return (Piece(slice(0, len(qp)), slice(0, len(kp)), "causal"),)
    pieces: list[Piece] = []
    k_runs = _runs(kp)
    for qs in _runs(qp, qd):
        first = None if qd is None else int(qd[qs.start])
        mine = []
        for ks in k_runs:
            ks, k0 = _in_document(ks, int(kp[ks.start]), first)
            if ks.stop > ks.start:
                mine += _pieces_of_runs(qs, int(qp[qs.start]), ks, k0, q_pos, k_pos)
        # Every key wholly visible, in the order held: one piece.
        if mine and all(p.kind == "full" for p in mine) and \
                sum(p.k.stop - p.k.start for p in mine) == len(kp):
            mine = [Piece(qs, slice(0, len(kp)), "full")]
        pieces += mine
    # Consecutive query slices against the same wholly visible keys: one piece.
    merged: list[Piece] = []
    for p in pieces:
        last = merged[-1] if merged else None
        if (last and p.kind == last.kind == "full" and p.k == last.k
                and p.q.start == last.q.stop):
            merged[-1] = Piece(slice(last.q.start, p.q.stop), p.k, "full")
        else:
            merged.append(p)
    return tuple(merged)


@dataclass(frozen=True)
class BlockPlan:
    """The pieces of every cp rank's block for this rank's queries: `blocks[j]` is against the keys
    of cp rank j."""

    rank: int
    blocks: tuple[tuple[Piece, ...], ...]

    def work(self) -> int:
        return sum(p.work() for pieces in self.blocks for p in pieces)


@lru_cache(maxsize=64)
def _plan_by_position(shards, local_len: int, rank: int, window: int | None) -> BlockPlan:
    seq_len = local_len * shards.cp
    mine = shards.positions(seq_len, rank)
    return BlockPlan(rank, tuple(plan_blocks(mine, shards.positions(seq_len, j), window=window)
                                 for j in range(shards.cp)))


def block_plan(shards, local_len: int, rank: int, documents: Documents | None = None,
               window: int | None = None) -> BlockPlan:
    """`shards` (context.SequenceShards) says which positions each cp rank holds. With
    `documents`, each sequence of the micro-batch gets its own pieces (made once per
    micro-batch, from the documents' CPU copy): a block whose documents do not meet this rank's
    queries has none, and is never computed. With a sliding `window` (`model.sliding_window`)
    shorter than the sequence, so are the blocks wholly outside every query's window."""
    if window is not None and window >= local_len * shards.cp:
        window = None  # the whole causal past: the plain plan, shared
    if documents is None:
        return _plan_by_position(shards, local_len, rank, window)
    key = ("blocks", shards, local_len, rank, window)
    if key not in documents.cache:
        seq_len = local_len * shards.cp
        mine = shards.positions(seq_len, rank)
        blocks = []
        for j in range(shards.cp):
            theirs = shards.positions(seq_len, j)
            blocks.append(tuple(
                replace(p, b=slice(b, b + 1))
                for b, row in enumerate(documents.host)
                for p in plan_blocks(mine, theirs, row[mine], window)))
        documents.cache[key] = BlockPlan(rank, tuple(blocks))
    return documents.cache[key]


# -- the blocks' math, shared by the two transports ---------------------------------------------


# A masked piece's mask on each device it ran on, made once per plan (plans are cached: by
# position, or per micro-batch with documents), not one host-to-device copy per layer; by the
# host mask's id, dropped with it.
_ON_DEVICE: dict[int, dict] = {}


def _mask_on(p: Piece, device) -> torch.Tensor | None:
    if p.mask is None or p.mask.device == device:
        return p.mask
    copies = _ON_DEVICE.get(id(p.mask))
    if copies is None:
        copies = _ON_DEVICE[id(p.mask)] = {}
        weakref.finalize(p.mask, _ON_DEVICE.pop, id(p.mask), None)
    if device not in copies:
        copies[device] = p.mask.to(device)
    return copies[device]


def _stack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V [b, s, hk, d] heads first in one contiguous tensor [2, b, hk, s, d]: one message
    per transfer, and the rows every block of queries reads are contiguous. Values of a width of
    their own (multi-head latent attention's) are packed beside the keys instead, [b, hk, s, dk +
    dv]: one message still, nothing padded (`_kv` tells the two apart)."""
    if k.shape[-1] == v.shape[-1]:
        return torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).contiguous()
    return torch.cat([k, v], dim=-1).transpose(1, 2).contiguous()


def _kv(t, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of a `_stack_kv` tensor, or of an accumulator or gathered slot of its shape:
    stacked [2, ..., hk, s, d] (5 dims), or packed [b, hk, s, dk + dv] (4 dims) split at the keys'
    width `dk`; a pair [dk, dv] as it is."""
    if isinstance(t, (list, tuple)):
        return t[0], t[1]
    if t.dim() == 5:
        return t[0], t[1]
    return t[..., :dk], t[..., dk:]


def _sequence_first(shape, device, fill: float | None = None) -> torch.Tensor:
    """An fp32 tensor of heads-first `shape` [..., h, s, d] over sequence-first memory."""
    *lead, h, s, d = shape
    t = torch.empty((*lead, s, h, d), dtype=torch.float32, device=device).transpose(-3, -2)
    return t if fill is None else t.fill_(fill)


def _base(t: torch.Tensor) -> torch.Tensor:
    """The contiguous sequence-first memory under a `_sequence_first` view (what a transfer
    sends)."""
    return t.transpose(-3, -2)


def _adopt(t: torch.Tensor) -> torch.Tensor | None:
    """A block's fresh fp32 result [.., h, s, d] taken as an accumulator as it is, when it lies in
    sequence-first memory (the CPU kernel's own output), else None."""
    return t if t.dtype == torch.float32 and t.transpose(-3, -2).is_contiguous() else None


def _nothing_seen(q: torch.Tensor, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (output [b, h, s, v_dim], lse) of queries q [b, h, s, d] before any key:
    zeros and -inf."""
    return (_sequence_first((*q.shape[:3], v_dim), q.device, 0.0),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))


def _forward_block(pieces, q, k, v, acc):
    """Merge the block's pieces into the running (output, lse) `acc` and return it. None: nothing
    yet; a first piece over every query then becomes the accumulator (no fill, no copy)."""
    for p in pieces:
        o, lse = attention_with_lse(q[p.b, :, p.q], k[p.b, :, p.k], v[p.b, :, p.k],
                                    p.kind == "causal", _mask_on(p, q.device))
        if acc is None and p.covers(q) and _adopt(o) is not None:
            # The lse made contiguous: the merges' exp and logaddexp then run the same
            # vectorised path whatever the kernel's lse layout (a strided one rounds differently).
            acc = (o, lse.float().contiguous())
            continue
        if acc is None:
            acc = _nothing_seen(q, v.shape[-1])
        merge_attention_(acc[0][p.b, :, p.q], acc[1][p.b, :, p.q], o, lse)
    return acc


def _backward_block(pieces, grad_out, q, k, v, out, lse, dq):
    """Add the block's dq into `dq` (None: none yet; a first piece over every query then becomes
    it); return dq and the block's dK and dV pieces [(sequences, key slice, dk, dv)]."""
    parts = []
    for p in pieces:
        gq, gk, gv = attention_with_lse_backward(
            grad_out[p.b, :, p.q], q[p.b, :, p.q], k[p.b, :, p.k], v[p.b, :, p.k],
            out[p.b, :, p.q], lse[p.b, :, p.q], p.kind == "causal", _mask_on(p, q.device))
        if dq is None and p.covers(q) and _adopt(gq) is not None:
            dq = gq
        else:
            if dq is None:
                dq = _sequence_first(q.shape, q.device, 0.0)
            dq[p.b, :, p.q] += gq
        parts.append((p.b, p.k, gk, gv))
    return dq, parts


def _covers_keys(part, keys: int) -> bool:
    return part[0] == slice(None) and part[1] == slice(0, keys)


def _sum_dkv(dkv: torch.Tensor, parts: list) -> torch.Tensor:
    """Write the sum of dK/dV pieces into `dkv` [2, b, hk, s, d] (fp32, uninitialised): a first
    piece over every key is copied in (no zero fill), the others added."""
    if parts and _covers_keys(parts[0], dkv.shape[-2]):
        _, _, gk, gv = parts[0]
        dk, dv = _kv(dkv, gk.shape[-1])
        dk.copy_(gk)
        dv.copy_(gv)
        parts = parts[1:]
    else:
        dkv.zero_()
    return _add_dkv(dkv, parts)


def _own_dkv(parts: list, shape, device) -> list | torch.Tensor:
    """The ring's own-block dK/dV [dk, dv] (it is never sent): a first piece over every key is
    taken as it is when the kernel left it in sequence-first fp32 memory (no copy), the other
    pieces added; else a `_sum_dkv` accumulator."""
    if parts and _covers_keys(parts[0], shape[-2]):
        _, _, gk, gv = parts[0]
        if _adopt(gk) is not None and _adopt(gv) is not None:
            return _add_dkv([gk, gv], parts[1:])
    return _sum_dkv(_sequence_first(shape, device), parts)


def _add_dkv(dkv, parts: list):
    """Add dK/dV pieces into `dkv` (fp32: `_stack_kv`'s shape, or a pair [dk, dv])."""
    for b, ks, gk, gv in parts:
        dk, dv = _kv(dkv, gk.shape[-1])
        dk[b, :, ks] += gk
        dv[b, :, ks] += gv
    return dkv


def _save_for_backward(ctx, q, kv, acc, plan: BlockPlan, cp: int) -> torch.Tensor:
    """Both transports keep only the local q, k, v, the merged output and its lse (a flash
    attention's saved set); returns the output in q's dtype, [b, s, h, d]."""
    if acc is None:  # no piece at all (no query sees a key: not in causal attention)
        acc = _nothing_seen(q, _kv(kv, q.shape[-1])[1].shape[-1])
    out = acc[0].to(q.dtype)
    ctx.save_for_backward(q, kv, out, acc[1])
    ctx.plan, ctx.cp = plan, cp
    return out.transpose(1, 2)


def _gradients(dq, dkv, q: torch.Tensor) -> tuple:
    """dq [b, h, s, d] and dK/dV (fp32: `_stack_kv`'s shape, or a pair [dk, dv]) as the inputs'
    gradients, [b, s, h, d]."""
    if dq is None:  # no piece at all
        dq = _sequence_first(q.shape, q.device, 0.0)
    dk, dv = _kv(dkv, q.shape[-1])
    return (dq.to(q.dtype).transpose(1, 2), dk.to(q.dtype).transpose(1, 2),
            dv.to(q.dtype).transpose(1, 2), None, None)


# -- ring ---------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, cp: int):
        with torch.autocast(q.device.type, enabled=False):
            q = q.transpose(1, 2)
            own_kv = kv = _stack_kv(k, v)
            r, acc = plan.rank, None
            for i in range(cp):
                spare = torch.empty_like(kv)
                work = comm.ring_shift(kv, spare, CP, tag="cp_kv") if i < cp - 1 else None
                acc = _forward_block(plan.blocks[(r - i) % cp], q, *_kv(kv, q.shape[-1]), acc)
                if work is not None:
                    work.wait()
                    kv = spare
        return _save_for_backward(ctx, q, own_kv, acc, plan, cp)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        plan, cp, r = ctx.plan, ctx.cp, ctx.plan.rank
        grad_out = grad_out.contiguous().transpose(1, 2)
        dq = own = None
        incoming = None  # the dK/dV accumulator of the block in hand, sent by the previous rank
        home = sent = None  # the last shift: our block's accumulator coming home; our last send
        for i in range(cp):
            spare = torch.empty_like(kv)
            kv_work = comm.ring_shift(kv, spare, CP, tag="cp_kv") if i < cp - 1 else None
            if i == cp - 1 and cp > 1:
                # Its receive is posted before the last block is computed: the previous rank,
                # often done first, delivers while we compute instead of after.
                home_buf = _sequence_first(kv.shape, q.device)
                home = (comm.ring_shift(None, _base(home_buf), CP), home_buf)
            dq, parts = _backward_block(plan.blocks[(r - i) % cp], grad_out, q,
                                        *_kv(kv, q.shape[-1]), out, lse, dq)
            if i == 0:  # our own block: its share stays here until the accumulator comes home
                own = _own_dkv(parts, kv.shape, q.device)
            else:
                # The accumulator of the block in hand, from the previous rank (a fresh one at
                # the first step), takes our share and goes on.
                if incoming is None:
                    acc = _sum_dkv(_sequence_first(kv.shape, q.device), parts)
                else:
                    work, acc, _ = incoming
                    work.wait()
                    _add_dkv(acc, parts)
                # Sent as its contiguous memory; `acc` stays referenced until the send is waited
                # for.
                if i < cp - 1:
                    buf = _sequence_first(kv.shape, q.device)
                    incoming = (comm.ring_shift(_base(acc), _base(buf), CP, tag="cp_dkv"), buf,
                                acc)
                else:
                    sent = (comm.ring_shift(_base(acc), None, CP, tag="cp_dkv"), acc)
            if kv_work is not None:
                kv_work.wait()
                kv = spare
        if home is not None:  # after cp - 1 shifts: every other rank's share of our block
            work, buf = home
            work.wait()
            for mine, theirs in zip(_kv(own, q.shape[-1]), _kv(buf, q.shape[-1])):
                mine.add_(theirs)
            sent[0].wait()
        return _gradients(dq, own, q)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                   cp: int) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V round the cp ring.
    q [b, s, h, d], k/v [b, s, hk, d]: this rank's positions (`plan`)."""
    return _RingAttention.apply(q, k, v, plan, cp)


# -- all-gather ---------------------------------------------------------------------------------


def _gather_kv(kv: torch.Tensor, cp: int, tag: str):
    """All-gather kv (`_stack_kv`'s) over cp, launched: (work, buffer [cp, *kv.shape])."""
    out = kv.new_empty((cp,) + tuple(kv.shape))
    work = comm.all_gather(out.view((cp * kv.shape[0],) + tuple(kv.shape[1:])), kv, CP,
                           async_op=True, tag=tag)
    return work, out


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, cp: int):
        with torch.autocast(q.device.type, enabled=False):
            q = q.transpose(1, 2)
            own_kv = _stack_kv(k, v)
            work, kv = _gather_kv(own_kv, cp, "cp_kv")
            r = plan.rank
            # The own block while the gather is in flight.
            acc = _forward_block(plan.blocks[r], q, *_kv(own_kv, q.shape[-1]), None)
            work.wait()
            for j in range(cp):
                if j != r:
                    acc = _forward_block(plan.blocks[j], q, *_kv(kv[j], q.shape[-1]), acc)
        return _save_for_backward(ctx, q, own_kv, acc, plan, cp)

    @staticmethod
    def backward(ctx, grad_out):
        q, own_kv, out, lse = ctx.saved_tensors
        plan, cp, r = ctx.plan, ctx.cp, ctx.plan.rank
        grad_out = grad_out.contiguous().transpose(1, 2)
        work, kv = _gather_kv(own_kv, cp, "cp_kv_regather")
        dkv = _sequence_first((cp,) + tuple(own_kv.shape), q.device)
        dq, parts = _backward_block(plan.blocks[r], grad_out, q, *_kv(own_kv, q.shape[-1]), out,
                                    lse, None)
        _sum_dkv(dkv[r], parts)
        work.wait()
        for j in range(cp):
            if j != r:
                dq, parts = _backward_block(plan.blocks[j], grad_out, q,
                                            *_kv(kv[j], q.shape[-1]), out, lse, dq)
                _sum_dkv(dkv[j], parts)
        own = _sequence_first(own_kv.shape, q.device)
        flat = (cp * own.shape[0],) + tuple(_base(own).shape[1:])
        comm.reduce_scatter(_base(own), _base(dkv).reshape(flat), CP, tag="cp_dkv")
        return _gradients(dq, own, q)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                         cp: int) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V all-gathered over cp."""
    return _AllGatherAttention.apply(q, k, v, plan, cp)
