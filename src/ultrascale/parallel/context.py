"""Context parallel: each sequence split over the `cp` ranks, so that activations per rank fall as
1/cp and a sequence too long for one device trains on several.

`apply_context_parallel(model, ctx, mode, balanced)` changes two things, both outside the model's
own code:

- what a micro-batch is on this rank (the runtime's `prepare`): the tokens, targets and absolute
  positions of this rank's part of every sequence. Balanced (`parallel.cp_load_balance`), the
  sequence is cut into 2 cp chunks and cp rank r keeps chunks r and 2cp-1-r, so that every rank
  does the same causal attention work (an early chunk sees few keys, a late one many); otherwise
  rank r keeps the r-th contiguous 1/cp. Everything but attention is per token, and the rotary
  tables come from these positions: nothing else needs to know.
- each attention's core (`Attention.inner`, behind any selective-recompute checkpoint) becomes
  the `parallel.cp_mode` one:
  - `ring`: K/V blocks round the ring, partial outputs merged by log-sum-exp (ring_attention.py);
  - `all_gather`: K/V all-gathered, local queries against them (ring_attention.py);
  - `ulysses`: all-to-all from a sequence split to a head split, whole-sequence attention over
    cp-th of the heads, and back (DeepSpeed-Ulysses); cp divides each tp rank's query heads, kv
    heads that cp does not divide are replicated up to a multiple of cp.
  Values of a head width of their own (multi-head latent attention) keep it in every mode: ring
  and all-gather send them packed beside the keys (ring_attention.py), Ulysses exchanges them as
  they are.
  Each masks by the absolute positions of queries and keys, never by their index, and with packed
  documents (models/documents.py, whole on every rank: they come with the batch) keeps each
  query inside its document.

A mixture of experts routes token by token too, but two of its decisions look at whole
sequences: each MoE is rebased onto `SequenceSplitMoE`, whose
- balance (`SequenceSplitBalance`) sums the per-sequence expert counts of the auxiliary loss over
  cp (a counted all-reduce of [sequences, E] per layer and micro-batch; counts carry no gradient)
  and keeps the differentiable score sums this rank's partial ones, so that the cp ranks' terms
  add up to the whole sequence's loss and gradient;
- capacity (`capacity_factor`) drops choices first come, first served in the whole micro-batch's
  token order: the choices are all-gathered over cp, decided as one process would, and this
  rank's kept.
The load behind the auxiliary-loss-free bias is summed over every rank already (expert.py), and
expert gradients sum over `edp_cp` (the mesh's `grad_dim`).

Under tensor parallel, attention sees this rank's heads (and, with sequence parallel, the tp
ranks share the cp rank's tokens): cp sits outside tp on the mesh. Each cp rank's loss is the sum
over its own tokens, and gradients are summed over `dp_cp` (ZeRO shards over it too), so the
runtime and the data-parallel owners need no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models import ops
from ultrascale.models.documents import Documents
from ultrascale.models.llama import ATTENTION_TYPES, CausalAttention
from ultrascale.models.moe import LoadBalance, MoE
from ultrascale.parallel.ring_attention import all_gather_attention, block_plan, ring_attention
from ultrascale.parallel.runtime import MicroBatch, RuntimePart
from ultrascale.parallel.seams import rebase, replace_inner

CP = "cp"


@lru_cache(maxsize=256)
def _positions(cp: int, balanced: bool, seq_len: int, rank: int) -> torch.Tensor:
    if balanced:
        n = seq_len // (2 * cp)
        chunks = (rank, 2 * cp - 1 - rank)
    else:
        n = seq_len // cp
        chunks = (rank,)
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])


@dataclass(frozen=True)
class SequenceShards:
    """Which positions of a sequence each cp rank holds."""

    cp: int
    balanced: bool = True

    def positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """The absolute positions cp rank `rank` keeps of a `seq_len`-token sequence (CPU, int64,
        in the order it holds them)."""
        parts = 2 * self.cp if self.balanced else self.cp
        if seq_len % parts:
            raise ValueError(f"a sequence of {seq_len} tokens does not split into {parts} chunks "
                             f"(cp={self.cp}, balanced={self.balanced})")
        return _positions(self.cp, self.balanced, seq_len, rank)


class ContextParallelPrepare(RuntimePart):
    """The runtime's part that makes this rank's tokens, targets and positions of a micro-batch."""

    def __init__(self, shards: SequenceShards, rank: int):
        self.shards, self.rank = shards, rank

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """The documents stay whole: every rank tells from them which keys its queries see;
        multi-token prediction's targets are split as the targets are."""
        tokens, targets, documents = batch.tokens, batch.targets, batch.documents
        idx = self.shards.positions(tokens.shape[1], self.rank).to(tokens.device)
        future = None if batch.future is None else batch.future.index_select(2, idx)
        return MicroBatch(tokens.index_select(1, idx), targets.index_select(1, idx), idx,
                          documents, future)


class ContextParallelAttention(CausalAttention):
    """An attention core over the cp ranks (parameterless, like the one it replaces)."""

    def __init__(self, shards: SequenceShards, rank: int):
        super().__init__()
        self.shards, self.rank = shards, rank

    # Under `training.compile` the block around it is compiled and this runs eagerly: its
    # transfers and its plans (Python, cached) are nothing for dynamo to trace.
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        self._check(positions)
        return self.attend(q, k, v, positions, documents)

    def attend(self, q, k, v, positions, documents) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, positions: torch.Tensor) -> int:
        """The whole sequence's length; the positions must be the ones this rank holds (they
        decide the masks). Checked where it costs no device synchronisation."""
        seq_len = positions.shape[0] * self.shards.cp
        if positions.device.type == "cpu" and not torch.equal(
                positions, self.shards.positions(seq_len, self.rank)):
            raise ValueError("context-parallel attention got positions other than its rank's "
                             "share of the sequence: prepare micro-batches with "
                             "ContextParallelPrepare")
        return seq_len


class RingAttention(ContextParallelAttention):
    def attend(self, q, k, v, positions, documents):
        plan = block_plan(self.shards, positions.shape[0], self.rank, documents, self.window)
        return ring_attention(q, k, v, plan, self.shards.cp)


class AllGatherAttention(ContextParallelAttention):
    def attend(self, q, k, v, positions, documents):
        plan = block_plan(self.shards, positions.shape[0], self.rank, documents, self.window)
        return all_gather_attention(q, k, v, plan, self.shards.cp)


class _AllToAll(torch.autograd.Function):
    """x [cp, ...]: slice j goes to cp rank j, slot j of the output comes from rank j. Its own
    inverse, so the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, CP, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all(out, grad, CP, tag=ctx.tag + "_bwd")
        return out, None


@lru_cache(maxsize=64)
def _ulysses_order(shards: SequenceShards, local_len: int, device: torch.device):
    """Sorting the gathered sequence by position: (cp rank, index) of each sorted token, where
    each (cp rank, index) lands in sorted order, and a mask when the sorted positions are not
    0..S-1 (None: causal by index is causal by position)."""
    cp = shards.cp
    gathered = torch.stack([shards.positions(local_len * cp, j) for j in range(cp)])
    order = gathered.flatten().argsort()
    where = order.argsort().view(cp, local_len)
    pos = gathered.flatten()[order]
    mask = None if torch.equal(pos, torch.arange(pos.numel())) else \
        (pos[:, None] >= pos[None, :]).to(device)
    return (order // local_len).to(device), (order % local_len).to(device), where.to(device), mask


class UlyssesAttention(ContextParallelAttention):
    def attend(self, q, k, v, positions, documents):
        cp = self.shards.cp
        b, s = q.shape[:2]
        src_rank, src_index, where, mask = _ulysses_order(self.shards, s, q.device)
        kv_heads = k.shape[2]
        if kv_heads % cp:  # replicate kv heads up to a multiple of cp (the grouping is kept)
            r = cp // gcd(kv_heads, cp)
            k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)

        def to_heads(x: torch.Tensor, tag: str) -> torch.Tensor:
            # [b, s, H, d] -> slice j = head group j -> [b, S, H/cp, d] in position order
            hc = x.shape[2] // cp
            parts = x.unflatten(2, (cp, hc)).permute(2, 0, 1, 3, 4)
            got = _AllToAll.apply(parts, tag)  # slot j: rank j's tokens, our head group
            return got.permute(1, 0, 2, 3, 4)[:, src_rank, src_index]

        qh, kh, vh = to_heads(q, "cp_q"), to_heads(k, "cp_k"), to_heads(v, "cp_v")
        # The gathered sequence in position order is the whole sequence: documents (whole too)
        # apply as in one process.
        out = ops.attention(qh, kh, vh, mask=mask, causal=mask is None, documents=documents,
                            kernels=self.kernels, window=self.window)
        parts = out[:, where].permute(1, 0, 2, 3, 4)  # slot j: rank j's tokens
        mine = _AllToAll.apply(parts, "cp_out")  # slot j: our tokens, head group j
        return mine.permute(1, 2, 0, 3, 4).flatten(2, 3)


MODES = {"ring": RingAttention, "all_gather": AllGatherAttention, "ulysses": UlyssesAttention}


class SequenceSplitBalance(LoadBalance):
    """The balancing losses of an MoE layer whose sequences are split over the cp ranks."""

    def sequence_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # Counts of chosen experts, made from the router's top-k indices: no gradient to carry.
        comm.all_reduce(counts, CP, tag="moe_sequence_counts")
        return counts


@lru_cache(maxsize=64)
def _gathered_positions(shards: SequenceShards, seq_len: int, device: torch.device):
    """The positions every cp rank holds, in all-gather order [cp x local], and this rank's."""
    return torch.cat([shards.positions(seq_len, j) for j in range(shards.cp)]).to(device)


class SequenceSplitMoE(MoE):
    """An MoE layer whose sequences are split over the cp ranks (see the module docstring);
    `shards` and `rank` are set by `rebase`."""

    shards: SequenceShards
    rank: int

    def over_capacity(self, ids: torch.Tensor, sequences: int = 1) -> tuple[torch.Tensor, int]:
        if self.capacity_factor is None:
            return ids, 0
        cp, k = self.shards.cp, ids.shape[1]
        local = ids.shape[0] // sequences
        seq_len = local * cp
        gathered = ids.new_empty((cp * ids.shape[0], k))
        comm.all_gather(gathered, ids.contiguous(), CP, tag="moe_capacity_ids")
        # Back into the micro-batch's token order: [sequences, seq_len, k] by position.
        whole = ids.new_empty((sequences, seq_len, k))
        whole[:, _gathered_positions(self.shards, seq_len, ids.device)] = \
            gathered.view(cp, sequences, local, k).transpose(0, 1).reshape(sequences, seq_len, k)
        marked, _ = super().over_capacity(whole.view(-1, k), sequences)
        mine = self.shards.positions(seq_len, self.rank).to(ids.device)
        kept = marked.view(sequences, seq_len, k)[:, mine].reshape(-1, k)
        return kept, int((kept == self.num_experts).sum())


@lru_cache(maxsize=None)
def sequence_split_class(cls: type) -> type:
    """`SequenceSplitMoE` over an MoE class another strategy made (tensor parallel's): a
    subclass of both, whose capacity decisions are SequenceSplitMoE's and whose forward is the
    other's."""
    if issubclass(cls, SequenceSplitMoE):
        return cls
    if cls is MoE:
        return SequenceSplitMoE
    return type(f"SequenceSplit{cls.__name__}", (SequenceSplitMoE, cls), {
        "__module__": __name__, "__doc__": f"{cls.__name__} with its sequences split over cp."})


def apply_context_parallel(model: nn.Module, ctx: ParallelContext, mode: str = "ring",
                           balanced: bool = True) -> ContextParallelPrepare:
    """Swap every attention core of `model` for the cp `mode` one and rebase every MoE onto
    `SequenceSplitMoE`; return the runtime's part that splits each micro-batch."""
    shards = SequenceShards(ctx.size(CP), balanced)
    rank = ctx.coord(CP)
    for module in list(model.modules()):
        if isinstance(module, ATTENTION_TYPES):
            replace_inner(module, "inner", MODES[mode](shards, rank))
        for name, child in list(module.named_children()):
            if isinstance(child, MoE):
                moe = rebase(child, sequence_split_class(type(child)), shards=shards, rank=rank)
                moe.balance = rebase(child.balance, SequenceSplitBalance)
                setattr(module, name, moe)
    return ContextParallelPrepare(shards, rank)
