"""Whole matrices for Muon's orthogonalisation, from the pieces the ranks hold (optim/muon.py).

A matrix may be cut twice: ZeRO gives each rank of its shard view a flat range of the local
parameter (zero.py), and tensor parallel gives each tp rank a slice along one dim (tensor.py).
Matrices are dealt by size (`_deal`: the largest first, each to the least loaded of the N ranks of
its shard view), its tp owner rank (k div N) mod tp of the tp group at that coordinate (matrix k
of the owner's list); the work of Newton-Schulz is spread over N x tp ranks, and no rank's share
exceeds 1/N of the view's matrices by more than one matrix. Per step, four all-to-alls per group
(each matrix's pieces only travel between the ranks that hold them and the one that
orthogonalises it):

    1. shard view: every rank sends its flat range of matrix k to k's ZeRO owner, which assembles
       the local (tp-sliced) matrix
    2. tp:         the ZeRO owners send their slices to the tp owner, which concatenates them
                   along the split dim and runs Newton-Schulz on the whole matrix
    3. tp:         the orthogonalised matrix's slices go back (2 reversed)
    4. shard view: its flat ranges go back (1 reversed)

Without ZeRO every data-parallel replica holds the whole momentum: the matrices are dealt over
the replicas all the same (over the gradient's view, dp or dp x cp), step 1 is nothing (the owner
has it), and step 4 sends each owner's results to every other replica.

Bytes (fp32, counted by `comm.all_to_all` as the input each rank hands in): summed over a shard
view, steps 1 and 4 move each matrix's local size once (without ZeRO, step 4 moves it once to each
of the N replicas); summed over a tp group, steps 2 and 3 move each whole matrix once. A matrix
not split by tp (kv heads replicated over tp) is orthogonalised by each tp rank itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.optim.muon import orthogonalised_update

TP = "tp"


@dataclass
class MatrixSlot:
    """One matrix as this rank's optimizer sees it."""

    name: str
    local_shape: torch.Size  # the local parameter (tp slice, experts of this ep rank)
    value: torch.Tensor | None  # what the optimizer steps here (None: no piece on this rank)
    shard_dim: str | None = None  # ZeRO's shard view; None: the local parameter is whole here
    ranges: tuple[tuple[int, int], ...] = ()  # flat [lo, hi) of the local parameter per rank of
    # shard_dim
    split_dim: int | None = None  # the dim tensor parallel splits; None: not split
    replicated_over: str | None = None  # the view whose ranks all hold this whole local matrix
    # and its momentum (data parallel without ZeRO): dealt over it, results sent to every rank

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n


class MatrixExchange:
    """`__call__(updates)`: the scaled orthogonalised update of each slot's piece (the callable
    `MuonAdamW` takes). Collective over the slots' shard views and tp: every rank of them calls
    it with the same slots in the same order."""

    def __init__(self, ctx: ParallelContext, slots: list[MatrixSlot], ns_steps: int):
        self.ctx, self.slots, self.ns_steps = ctx, slots, ns_steps
        self.tp = ctx.size(TP) if TP in ctx.views else 1
        # The ZeRO owner and the tp owner of each slot (by its position k).
        self.zero_owner = self._deal()
        self.tp_owner = [(k // (self._shard_size(s) * self._replicas(s))) % self.tp
                         for k, s in enumerate(slots)]

    def _deal(self) -> list[int]:
        """Each slot's owner among the N ranks that share it: the largest matrices first, each to
        the rank with the fewest elements so far (ties to the lower rank; every rank deals the
        same slots alike). Round-robin by position gave one of 8 ranks 22% of a 4-layer
        llama3-8b's matrix elements (13.5% so): its Newton-Schulz work, and without ZeRO the
        results it copies to every replica (tests/test_muon.py)."""
        owner = [0] * len(self.slots)
        loads: dict[tuple, list[int]] = {}
        for k in sorted(range(len(self.slots)), key=lambda k: -self.slots[k].local_numel):
            s = self.slots[k]
            n = self._shard_size(s) * self._replicas(s)
            load = loads.setdefault((s.shard_dim, s.replicated_over, n), [0] * n)
            owner[k] = min(range(n), key=load.__getitem__)
            load[owner[k]] += s.local_numel
        return owner

    def _shard_size(self, s: MatrixSlot) -> int:
        return self.ctx.size(s.shard_dim) if s.shard_dim is not None else 1

    def _replicas(self, s: MatrixSlot) -> int:
        return self.ctx.size(s.replicated_over) if s.replicated_over is not None else 1

    def _replicated_views(self) -> dict[str, list[int]]:
        views: dict[str, list[int]] = {}
        for k, s in enumerate(self.slots):
            if self._replicas(s) > 1:
                views.setdefault(s.replicated_over, []).append(k)
        return views

    def _whole(self, s: MatrixSlot) -> bool:
        """Held whole here and by no other rank that could take its work."""
        return self._shard_size(s) == 1 and self._replicas(s) == 1

    def _tp_split(self, s: MatrixSlot) -> bool:
        return s.split_dim is not None and self.tp > 1

    def __call__(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Consumes `updates` (the list is emptied): what is not this rank's to orthogonalise is
        freed before the results arrive."""
        if not self.slots:
            return []
        like = updates[0].new_empty(0)
        local = self._gather_shards(updates)  # k -> flat local matrix, where this rank owns k
        updates.clear()
        full = self._gather_tp(local)  # k -> whole matrix, where this rank orthogonalises k
        done = {k: orthogonalised_update(m, self.ns_steps) for k, m in full.items()}
        del full
        local = self._scatter_tp(done, local)
        del done
        return self._scatter_shards(local, like)

    # -- 1 and 4: flat ranges over each shard view ---------------------------------------------
    def _views(self) -> dict[str, list[int]]:
        views: dict[str, list[int]] = {}
        for k, s in enumerate(self.slots):
            if s.shard_dim is not None and self._shard_size(s) > 1:
                views.setdefault(s.shard_dim, []).append(k)
        return views

    def _gather_shards(self, updates: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        local = {k: u.reshape(-1) for k, (s, u) in enumerate(zip(self.slots, updates))
                 if self._whole(s)}
        for view, ks in self._replicated_views().items():  # the owner holds it already
            me = self.ctx.coord(view)
            local.update({k: updates[k].reshape(-1) for k in ks if self.zero_owner[k] == me})
        for view, ks in self._views().items():
            n, me = self.ctx.size(view), self.ctx.coord(view)
            send = [[k for k in ks if self.zero_owner[k] == j] for j in range(n)]
            mine = send[me]
            inp = torch.cat([updates[k].reshape(-1) for j in range(n) for k in send[j]])
            in_split = [sum(_len(self.slots[k].ranges[me]) for k in send[j]) for j in range(n)]
            out_split = [sum(_len(self.slots[k].ranges[i]) for k in mine) for i in range(n)]
            out = inp.new_empty(sum(out_split))
            comm.all_to_all(out, inp, view, out_split, in_split, tag="muon")
            for k in mine:
                local[k] = inp.new_empty(self.slots[k].local_numel)
            offset = 0
            for i in range(n):
                for k in mine:
                    lo, hi = self.slots[k].ranges[i]
                    local[k][lo:hi] = out[offset:offset + hi - lo]
                    offset += hi - lo
        return local

    def _scatter_shards(self, local: dict[int, torch.Tensor],
                        like: torch.Tensor) -> list[torch.Tensor]:
        result = [local[k] if self._whole(s) else None for k, s in enumerate(self.slots)]
        for view, ks in self._replicated_views().items():
            n, me = self.ctx.size(view), self.ctx.coord(view)
            mine = [k for k in ks if self.zero_owner[k] == me]
            for k in mine:
                result[k] = local[k]
            # Every replica gets each owner's results (its own copy stays home).
            inp = torch.cat([local[k] for k in mine] * n or [like])
            own = sum(self.slots[k].local_numel for k in mine)
            recv = [[k for k in ks if self.zero_owner[k] == i] for i in range(n)]
            out_split = [sum(self.slots[k].local_numel for k in recv[i]) for i in range(n)]
            out = inp.new_empty(sum(out_split))
            comm.all_to_all(out, inp, view, out_split, [own] * n, tag="muon")
            offset = 0
            for i in range(n):
                for k in recv[i]:
                    size = self.slots[k].local_numel
                    if i != me:
                        result[k] = out[offset:offset + size]
                    offset += size
        for view, ks in self._views().items():
            n, me = self.ctx.size(view), self.ctx.coord(view)
            mine = [k for k in ks if self.zero_owner[k] == me]
            inp = torch.cat([local[k][slice(*self.slots[k].ranges[j])]
                             for j in range(n) for k in mine]
                            or [like])
            in_split = [sum(_len(self.slots[k].ranges[j]) for k in mine) for j in range(n)]
            recv = [[k for k in ks if self.zero_owner[k] == i] for i in range(n)]
            out_split = [sum(_len(self.slots[k].ranges[me]) for k in recv[i]) for i in range(n)]
            out = inp.new_empty(sum(out_split))
            comm.all_to_all(out, inp, view, out_split, in_split, tag="muon")
            offset = 0
            for i in range(n):
                for k in recv[i]:
                    size = _len(self.slots[k].ranges[me])
                    result[k] = out[offset:offset + size]
                    offset += size
        return result

    # -- 2 and 3: slices over tp ----------------------------------------------------------------
    def _tp_slots(self, local: dict[int, torch.Tensor]) -> list[int]:
        """The tp-split matrices this rank holds whole over its shard view (the same positions on
        every rank of its tp group: they share its ZeRO coordinates)."""
        return [k for k in sorted(local) if self._tp_split(self.slots[k])]

    def _gather_tp(self, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        full = {k: m.view(self.slots[k].local_shape) for k, m in local.items()
                if not self._tp_split(self.slots[k])}
        ks = self._tp_slots(local)
        if not ks:
            return full
        tp, me = self.tp, self.ctx.coord(TP)
        send = [[k for k in ks if self.tp_owner[k] == j] for j in range(tp)]
        inp = torch.cat([local[k] for j in range(tp) for k in send[j]])
        in_split = [sum(local[k].numel() for k in send[j]) for j in range(tp)]
        mine = send[me]
        out_split = [sum(local[k].numel() for k in mine)] * tp  # equal slices on every tp rank
        out = inp.new_empty(sum(out_split))
        comm.all_to_all(out, inp, TP, out_split, in_split, tag="muon")
        offset = 0
        slices: dict[int, list[torch.Tensor]] = {k: [] for k in mine}
        for _ in range(tp):
            for k in mine:
                n = local[k].numel()
                slices[k].append(out[offset:offset + n].view(self.slots[k].local_shape))
                offset += n
        for k in mine:
            full[k] = torch.cat(slices[k], dim=self.slots[k].split_dim)
        return full

    def _scatter_tp(self, done: dict[int, torch.Tensor],
                    local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        back = {k: m.reshape(-1) for k, m in done.items() if not self._tp_split(self.slots[k])}
        ks = self._tp_slots(local)
        if not ks:
            return back
        tp, me = self.tp, self.ctx.coord(TP)
        mine = [k for k in ks if self.tp_owner[k] == me]
        pieces = {k: done[k].chunk(tp, dim=self.slots[k].split_dim) for k in mine}
        inp = torch.cat([pieces[k][j].reshape(-1) for j in range(tp) for k in mine]
                        or [next(iter(local.values())).new_empty(0)])
        in_split = [sum(local[k].numel() for k in mine)] * tp
        recv = [[k for k in ks if self.tp_owner[k] == i] for i in range(tp)]
        out_split = [sum(local[k].numel() for k in recv[i]) for i in range(tp)]
        out = inp.new_empty(sum(out_split))
        comm.all_to_all(out, inp, TP, out_split, in_split, tag="muon")
        offset = 0
        for i in range(tp):
            for k in recv[i]:
                n = local[k].numel()
                back[k] = out[offset:offset + n]
                offset += n
        return back


def _len(r: tuple[int, int]) -> int:
    return r[1] - r[0]
