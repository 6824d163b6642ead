"""Blockwise attention over the cp ranks: the ring and the all-gather, as autograd functions.

Each cp rank holds the queries, keys and values of its own positions. Attention of its queries
over the whole sequence is cut into one block per cp rank's keys; `plan_blocks` decides, from the
absolute positions of the queries and of the keys alone, which slices of a block are wholly
visible, causal on their diagonal, masked (positions that are neither), or skipped (no query sees
any key: that work is never done). Each piece returns its output and log-sum-exp
(`ops.attention_with_lse`), and `ops.merge_attention_` folds them into the running result, so no
rank ever holds a score matrix of the whole sequence.

- ring (`ring_attention`): K and V go round the ring of `cp`; at each step the next shift is
  posted before the current block is computed. The backward passes K and V round again and sends
  each block's dK/dV accumulator along behind it, so that it comes home to its owner after cp - 1
  shifts, having collected every rank's share (`ops.attention_with_lse_backward` with the merged
  output and lse).
- all-gather (`all_gather_attention`): K and V all-gathered once (the own block is computed while
  the gather is in flight); the backward gathers them again rather than keep cp blocks alive, and
  reduce-scatters dK/dV.

Both save only the local q, k, v, output and lse, as a flash attention does: the saved bytes of a
rank fall as 1/cp. dK/dV are accumulated and sent in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ultrascale.distributed import comm
from ultrascale.models import ops

CP = "cp"


# -- the plan: which pieces of a block are computed, from positions alone -------------------------


@dataclass(frozen=True)
class Piece:
    """Queries q of this rank against keys k of one block: "full", "causal" (the same positions on
    both sides, in increasing order) or "mask" (`mask` [q, k], True = attend)."""

    q: slice
    k: slice
    kind: str
    mask: torch.Tensor | None = None

    def work(self) -> int:
        """Query-key pairs it computes that causality keeps (the causal work)."""
        nq, nk = self.q.stop - self.q.start, self.k.stop - self.k.start
        if self.kind == "full":
            return nq * nk
        if self.kind == "causal":
            return nq * (nq + 1) // 2
        return int(self.mask.sum())


def _runs(pos: list[int]) -> list[slice]:
    """Maximal slices of consecutive increasing positions."""
    out, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            out.append(slice(start, i))
            start = i
    return out


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


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[Piece, ...]:
    """The pieces that attention of queries at `q_pos` over keys at `k_pos` needs (causal by
    position: a query sees the keys at its position or before), as few as possible."""
    qp, kp = q_pos.tolist(), k_pos.tolist()
    if qp == kp and all(b > a for a, b in zip(qp, qp[1:])):
        return (Piece(slice(0, len(qp)), slice(0, len(kp)), "causal"),)
    pieces: list[Piece] = []
    k_runs = _runs(kp)
    for qs in _runs(qp):
        mine = [p for ks in k_runs
                for p in _pieces_of_runs(qs, qp[qs.start], ks, kp[ks.start], q_pos, k_pos)]
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
def block_plan(shards, local_len: int, rank: int) -> BlockPlan:
    """`shards` (context.SequenceShards) says which positions each cp rank holds."""
    seq_len = local_len * shards.cp
    mine = shards.positions(seq_len, rank)
    return BlockPlan(rank, tuple(plan_blocks(mine, shards.positions(seq_len, j))
                                 for j in range(shards.cp)))


# -- the blocks' math, shared by the two transports ---------------------------------------------


def _mask_on(p: Piece, device) -> torch.Tensor | None:
    return None if p.mask is None else p.mask.to(device)


def _forward_block(pieces, q, k, v, acc_out, acc_lse, first: bool = False) -> None:
    """Merge the block's pieces into the running output. `first`: nothing is written yet, and a
    first piece over every query (the own block's causal diagonal) is copied in, not merged."""
    for p in pieces:
        o, lse = ops.attention_with_lse(q[:, p.q], k[:, p.k], v[:, p.k], p.kind == "causal",
                                        _mask_on(p, q.device))
        if first and p.q == slice(0, q.shape[1]):
            acc_out.copy_(o)
            acc_lse.copy_(lse)
        else:
            ops.merge_attention_(acc_out[:, p.q], acc_lse[:, :, p.q], o, lse)
        first = False


def _backward_block(pieces, grad_out, q, k, v, out, lse, dq) -> list:
    """Add the block's dq into `dq`; return its dK and dV pieces [(key slice, dk, dv)]."""
    parts = []
    for p in pieces:
        gq, gk, gv = ops.attention_with_lse_backward(
            grad_out[:, p.q], q[:, p.q], k[:, p.k], v[:, p.k], out[:, p.q], lse[:, :, p.q],
            p.kind == "causal", _mask_on(p, q.device))
        dq[:, p.q] += gq
        parts.append((p.k, gk, gv))
    return parts


def _add_dkv(dkv: torch.Tensor, parts: list) -> torch.Tensor:
    """Add dK/dV pieces into `dkv` [2, b, s, hk, d] (fp32)."""
    for ks, gk, gv in parts:
        dkv[0][:, ks] += gk
        dkv[1][:, ks] += gv
    return dkv


def _start(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output and lse, fp32 (as the blocks' lse)."""
    b, s, h, _ = q.shape
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device))


def _save_for_backward(ctx, q, k, v, acc_out, acc_lse, plan: BlockPlan, cp: int) -> torch.Tensor:
    """Both transports keep only the local q, k, v, the merged output and its lse (a flash
    attention's saved set); returns the output in q's dtype."""
    out = acc_out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, acc_lse)
    ctx.plan, ctx.cp = plan, cp
    return out


# -- ring ---------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, cp: int):
        with torch.autocast(q.device.type, enabled=False):
            acc_out, acc_lse = _start(q)
            kv = torch.stack([k, v])  # one message per shift
            r = plan.rank
            for i in range(cp):
                spare = torch.empty_like(kv)
                work = comm.ring_shift(kv, spare, CP, tag="cp_kv") if i < cp - 1 else None
                _forward_block(plan.blocks[(r - i) % cp], q, kv[0], kv[1], acc_out, acc_lse,
                               first=i == 0)
                if work is not None:
                    work.wait()
                    kv = spare
        return _save_for_backward(ctx, q, k, v, acc_out, acc_lse, plan, cp)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, cp, r = ctx.plan, ctx.cp, ctx.plan.rank
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        incoming = None  # the dK/dV accumulator of the block in hand, sent by the previous rank
        for i in range(cp):
            spare = torch.empty_like(kv)
            kv_work = comm.ring_shift(kv, spare, CP, tag="cp_kv") if i < cp - 1 else None
            parts = _backward_block(plan.blocks[(r - i) % cp], grad_out, q, kv[0], kv[1], out,
                                    lse, dq)
            if i == 0:  # our own block: its share stays here until the accumulator comes home
                _add_dkv(own, parts)
            else:
                # The accumulator of the block in hand, from the previous rank (a fresh one at
                # the first step), takes our share and goes on.
                if incoming is None:
                    acc = _add_dkv(torch.zeros_like(own), parts)
                else:
                    work, acc, _ = incoming
                    work.wait()
                    _add_dkv(acc, parts)
                buf = torch.empty_like(acc)
                # `acc` stays referenced until its send is waited for.
                incoming = (comm.ring_shift(acc, buf, CP, tag="cp_dkv"), buf, acc)
            if kv_work is not None:
                kv_work.wait()
                kv = spare
        if incoming is not None:  # after cp - 1 shifts: every other rank's share of our block
            work, buf, _ = incoming
            work.wait()
            own += buf
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                   cp: int) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V round the cp ring.
    q [b, s, h, d], k/v [b, s, hk, d]: this rank's positions (`plan`)."""
    return _RingAttention.apply(q, k, v, plan, cp)


# -- all-gather ---------------------------------------------------------------------------------


def _gather_kv(k: torch.Tensor, v: torch.Tensor, cp: int, tag: str):
    """All-gather [k; v] over cp, launched: (work, buffer [cp, 2, b, s, hk, d])."""
    kv = torch.stack([k, v])
    out = kv.new_empty((cp,) + tuple(kv.shape))
    work = comm.all_gather(out.view((cp * 2,) + tuple(k.shape)), kv, CP, async_op=True, tag=tag)
    return work, out


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, cp: int):
        with torch.autocast(q.device.type, enabled=False):
            acc_out, acc_lse = _start(q)
            work, kv = _gather_kv(k, v, cp, "cp_kv")
            r = plan.rank
            # The own block while the gather is in flight.
            _forward_block(plan.blocks[r], q, k, v, acc_out, acc_lse, first=True)
            work.wait()
            for j in range(cp):
                if j != r:
                    _forward_block(plan.blocks[j], q, kv[j, 0], kv[j, 1], acc_out, acc_lse)
        return _save_for_backward(ctx, q, k, v, acc_out, acc_lse, plan, cp)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, cp, r = ctx.plan, ctx.cp, ctx.plan.rank
        grad_out = grad_out.contiguous()
        work, kv = _gather_kv(k, v, cp, "cp_kv_regather")
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((cp, 2) + tuple(k.shape), dtype=torch.float32, device=q.device)
        _add_dkv(dkv[r], _backward_block(plan.blocks[r], grad_out, q, k, v, out, lse, dq))
        work.wait()
        for j in range(cp):
            if j != r:
                _add_dkv(dkv[j], _backward_block(plan.blocks[j], grad_out, q, kv[j, 0],
                                                 kv[j, 1], out, lse, dq))
        own = dkv.new_empty((2,) + tuple(k.shape))
        comm.reduce_scatter(own, dkv.view((cp * 2,) + tuple(k.shape)), CP, tag="cp_dkv")
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                         cp: int) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V all-gathered over cp."""
    return _AllGatherAttention.apply(q, k, v, plan, cp)
