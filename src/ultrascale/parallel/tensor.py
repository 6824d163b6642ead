"""Tensor parallel (Megatron-style), with optional sequence parallel.

`apply_tensor_parallel(model, ctx)` transforms a plain `Llama` (or a pipeline stage of one: embed,
norm or output may be None and only some layers kept) in place, through the model's seams:

- attention is rebased onto `TensorParallelAttention`, which overrides `project` (q/k/v
  column-parallel, whole heads per rank, a q/k/v bias sliced with its weight) and `out` (o_proj
  row-parallel); the matmuls are the layers' own (`Linear.matmul`: FP8 under that precision).
  With grouped-query attention, kv heads are split when tp divides them; otherwise every rank
  keeps all kv weights, uses the rows its query heads need, and their gradients are summed over
  tp. Per-head q/k norms (Qwen3) see only this rank's heads: their weight gradients are summed
  over tp;
- multi-head latent attention (models/mla.py) is rebased onto `TensorParallelLatentAttention`:
  its up-projections (q_b_proj or q_proj, kv_b_proj) split by heads, o_proj row-parallel, the
  down-projections and the latent norms replicated (the latents enter the tensor-parallel region
  once, gathered along the sequence under sequence parallel);
- every feed-forward is rebased onto `TensorParallelFeedForward`: its input projections
  column-parallel, its output projection row-parallel; every mixture of experts onto
  `TensorParallelMoE` (tensor_experts.py): each routed and shared expert split as a feed-forward
  is, the router replicated;
- the blocks of multi-token prediction's modules (models/mtp.py) are split as the layers are;
  their projection and norms are replicated (under sequence parallel they see this rank's tokens,
  and their weight gradients are summed over tp);
- the embedding and output head are split over the vocabulary (padded to a multiple of tp), and
  the model's `criterion` becomes the vocabulary-parallel cross-entropy;
- sequence parallel: the residual stream and the norms hold 1/tp of the sequence; norm weights get
  partial gradients, summed over tp.

Weights are sliced from the full model (initialised from seed and name), so any layout starts from
the same weights; each split is recorded in the mesh's placements and in the returned plan, whose
`gather_full` turns shards back into plain-model tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Attention, FeedForward, Linear, Llama, RMSNorm
from ultrascale.models.mla import LatentAttention
from ultrascale.models.moe import MoE
from ultrascale.parallel.runtime import RuntimePart
from ultrascale.parallel.seams import rebase
from ultrascale.parallel.tensor_experts import TensorParallelMoE
from ultrascale.parallel.tensor_layers import (
    TP, column_parallel, copy_to_tp, enter_tp, row_parallel,
)
from ultrascale.parallel.vocab_parallel import VocabParallelEmbedding, VocabParallelLoss, VocabShard


@dataclass
class TensorParallelPlan(RuntimePart):
    """What the transformation did, for the runtime (one of its parts): how each parameter is
    split, to gather it back."""

    tp: int
    rank: int
    sequence_parallel: bool
    overlap: bool
    vocab: VocabShard | None
    # plain-model name -> (dim split over tp, true size along it to unpad to, or None)
    split: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    def split_dims(self, name: str) -> dict[str, int]:
        return {TP: self.split[name][0]} if name in self.split else {}

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full plain-model tensors (weights or gradients) from this rank's shards. Collective over
        tp: every rank of the tp group calls it with the same names."""
        out = {}
        for name, t in tensors.items():
            if name not in self.split:
                out[name] = t
                continue
            dim, true_size = self.split[name]
            local = t.detach().transpose(0, dim).contiguous()
            full = local.new_empty((self.tp * local.shape[0],) + tuple(local.shape[1:]))
            comm.all_gather(full, local, TP, tag="tp_state")
            full = full.transpose(0, dim)
            if true_size is not None:
                full = full.narrow(dim, 0, true_size)
            out[name] = full.contiguous()
        return out


# -- subclasses the plain modules are rebased onto (same parameters and names) ---------------------


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard: its weight gradient is partial on each rank, summed over tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, copy_to_tp(self.weight, "tp_param_grad"), self.eps)


class HeadSplitRMSNorm(SequenceParallelRMSNorm):
    """A q/k norm (one weight shared by every head) over this rank's heads only, or MLA's latent
    norm whose output feeds only this rank's heads: its weight gradient, partial on each rank,
    is summed over tp, as a sequence-parallel norm's is."""


class SequenceParallelLinear(Linear):
    """A linear layer tp replicates, on this rank's share of the sequence (MLA's
    down-projections, MTP's eh_proj under sequence parallel): its weight gradient is partial on
    each rank, summed over tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, copy_to_tp(self.weight, "tp_param_grad"))


class TensorParallelLatentAttention(LatentAttention):
    """Multi-head latent attention over this rank's heads: the down-projections run replicated
    (on this rank's tokens under sequence parallel) and their latents enter the tensor-parallel
    region (gathered along the sequence under sequence parallel: the latents are narrower than
    the hidden state); the up-projections hold this rank's heads, the output projection is
    row-parallel."""

    sp: bool

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_in, kv = super().compress(x)
        return enter_tp(q_in, self.sp), enter_tp(kv, self.sp)

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return row_parallel(attended.flatten(2), self.o_proj.weight, self.sp, self.o_proj.matmul)


class TensorParallelAttention(Attention):
    """Attention over this rank's heads. `kv_rows` selects, when kv heads are replicated, the kv
    heads its query heads use; `kv_index` maps local query heads to those kv heads when they do not
    form equal groups (then k/v are expanded to one head per query head)."""

    sp: bool
    overlap: bool
    kv_rows: slice | None
    kv_index: torch.Tensor | None

    def _kv_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.kv_rows is None:
            return w
        return copy_to_tp(w, "tp_param_grad")[self.kv_rows]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        outs = column_parallel(x, [self.q_proj.weight, self._kv_weight(self.k_proj.weight),
                                   self._kv_weight(self.v_proj.weight)], self.sp, self.overlap,
                               self.q_proj.matmul)
        if self.q_proj.bias is not None:  # the biases' rows are those of their weights
            biases = (self.q_proj.bias, self._kv_weight(self.k_proj.bias),
                      self._kv_weight(self.v_proj.bias))
            outs = tuple(o + b for o, b in zip(outs, biases))
        q, k, v = (self._heads(t) for t in outs)
        if self.kv_index is not None:
            k, v = k[:, :, self.kv_index], v[:, :, self.kv_index]
        return q, k, v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return row_parallel(attended.flatten(2), self.o_proj.weight, self.sp, self.o_proj.matmul)


class TensorParallelFeedForward(FeedForward):
    sp: bool
    overlap: bool

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return column_parallel(x, [getattr(self, n).weight for n in self.in_projections],
                               self.sp, self.overlap, getattr(self, self.in_projections[0]).matmul)

    def out(self, h: torch.Tensor) -> torch.Tensor:
        out = getattr(self, self.out_projection)
        return row_parallel(h, out.weight, self.sp, out.matmul)


# -- the transformation ---------------------------------------------------------------------------


def _shard(module: nn.Module, attr: str, dim: int, plan: TensorParallelPlan, ctx: ParallelContext,
           name: str, vocab: VocabShard | None = None) -> None:
    """Replace module.<attr> by this rank's slice along `dim`, recorded as split over tp."""
    full = getattr(module, attr).detach()
    if vocab is not None:
        local = vocab.slice_rows(full)
        plan.split[name] = (0, vocab.vocab_size)
    else:
        n = full.shape[dim] // plan.tp
        local = full.narrow(dim, plan.rank * n, n).clone()
        plan.split[name] = (dim, None)
    setattr(module, attr, nn.Parameter(local, requires_grad=getattr(module, attr).requires_grad))
    ctx.place(name, sharded=(TP,))


def _kv_layout(num_heads: int, num_kv: int, tp: int, rank: int):
    """(rows of k/v weight to use, expansion index or None) when kv heads are replicated."""
    local_q = num_heads // tp
    group = num_heads // num_kv
    kv_of = torch.arange(rank * local_q, (rank + 1) * local_q) // group
    lo, hi = int(kv_of[0]), int(kv_of[-1]) + 1
    local_kv = kv_of - lo
    equal_groups = local_q % (hi - lo) == 0 and torch.equal(
        local_kv, torch.arange(hi - lo).repeat_interleave(local_q // (hi - lo)))
    return (lo, hi), (None if equal_groups else local_kv)


def apply_tensor_parallel(model: Llama, ctx: ParallelContext, sequence_parallel: bool = False,
                          overlap: bool = True) -> TensorParallelPlan:
    """Split `model` (in place) over the "tp" dimension of `ctx`; returns the plan."""
    cfg, tp, rank = model.cfg, ctx.size(TP), ctx.coord(TP)
    if cfg.num_heads % tp or cfg.ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} must divide num_heads={cfg.num_heads} and ffn_hidden_size="
                         f"{cfg.ffn_hidden_size}")
    vocab = VocabShard.of(cfg.vocab_size, tp, rank)
    plan = TensorParallelPlan(tp, rank, sequence_parallel, overlap, vocab)
    sp = sequence_parallel
    for prefix, holder, attr in model.block_slots():
        block = getattr(holder, attr)
        pre = prefix + "."
        if isinstance(block.attn, LatentAttention):
            block.attn = _split_latent_attention(block.attn, pre, plan, ctx)
        else:
            block.attn = _split_attention(block.attn, pre, plan, ctx)
        if isinstance(block.mlp, MoE):
            block.mlp = _split_experts(block.mlp, pre + "mlp.", plan, ctx)
        else:
            block.mlp = _split_feed_forward(block.mlp, pre + "mlp.", plan, ctx)
        if sp:
            block.attn_norm = rebase(block.attn_norm, SequenceParallelRMSNorm)
            block.mlp_norm = rebase(block.mlp_norm, SequenceParallelRMSNorm)
    if sp and model.mtp is not None:  # its projection and norms see this rank's tokens
        for layer in model.mtp.values():
            for name in ("enorm", "hnorm", "norm"):
                setattr(layer, name, rebase(getattr(layer, name), SequenceParallelRMSNorm))
            layer.eh_proj = rebase(layer.eh_proj, SequenceParallelLinear)
    if model.embed is not None:
        _shard(model.embed, "weight", 0, plan, ctx, "embed.weight", vocab)
        model.embed = rebase(model.embed, VocabParallelEmbedding, shard=vocab,
                             sequence_parallel=sp)
    if model.output is not None:
        _shard(model.output, "weight", 0, plan, ctx, "output.weight", vocab)
    if model.norm is not None:
        if sp:
            model.norm = rebase(model.norm, SequenceParallelRMSNorm)
        model.criterion = VocabParallelLoss(vocab, sp)
    return plan


def _split_attention(a: Attention, pre: str, plan: TensorParallelPlan,
                     ctx: ParallelContext) -> Attention:
    """Multi-head attention: whole heads per rank, kv heads split or replicated."""
    heads, kv_heads = (a.q_proj.weight.shape[0] // a.head_dim,
                       a.k_proj.weight.shape[0] // a.head_dim)
    biased = ("weight", "bias") if a.q_proj.bias is not None else ("weight",)
    for attr in biased:
        _shard(a.q_proj, attr, 0, plan, ctx, f"{pre}attn.q_proj.{attr}")
    kv_rows = kv_index = None
    if kv_heads % plan.tp == 0:
        for proj in ("k_proj", "v_proj"):
            for attr in biased:
                _shard(getattr(a, proj), attr, 0, plan, ctx, f"{pre}attn.{proj}.{attr}")
    else:
        (lo, hi), kv_index = _kv_layout(heads, kv_heads, plan.tp, plan.rank)
        kv_rows = slice(lo * a.head_dim, hi * a.head_dim)
    _shard(a.o_proj, "weight", 1, plan, ctx, pre + "attn.o_proj.weight")
    if a.q_norm is not None:
        a.q_norm = rebase(a.q_norm, HeadSplitRMSNorm)
        a.k_norm = rebase(a.k_norm, HeadSplitRMSNorm)
    return rebase(a, TensorParallelAttention, sp=plan.sequence_parallel, overlap=plan.overlap,
                  kv_rows=kv_rows, kv_index=kv_index)


def _split_latent_attention(a: LatentAttention, pre: str, plan: TensorParallelPlan,
                            ctx: ParallelContext) -> LatentAttention:
    """MLA: the up-projections split by heads (rows), the output projection by its inputs; the
    down-projections and the latent norms replicated."""
    up = "q_proj" if a.q_proj is not None else "q_b_proj"
    for proj in (up, "kv_b_proj"):
        _shard(getattr(a, proj), "weight", 0, plan, ctx, f"{pre}attn.{proj}.weight")
    _shard(a.o_proj, "weight", 1, plan, ctx, pre + "attn.o_proj.weight")
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        if getattr(a, norm, None) is not None:
            setattr(a, norm, rebase(getattr(a, norm), HeadSplitRMSNorm))
    if plan.sequence_parallel:
        for proj in ("q_a_proj", "kv_a_proj_with_mqa"):
            if getattr(a, proj, None) is not None:
                setattr(a, proj, rebase(getattr(a, proj), SequenceParallelLinear))
    return rebase(a, TensorParallelLatentAttention, sp=plan.sequence_parallel)


def _split_feed_forward(m: FeedForward, pre: str, plan: TensorParallelPlan,
                        ctx: ParallelContext) -> FeedForward:
    """Input projections column-parallel, the output projection row-parallel."""
    for proj in m.in_projections:
        _shard(getattr(m, proj), "weight", 0, plan, ctx, f"{pre}{proj}.weight")
    _shard(getattr(m, m.out_projection), "weight", 1, plan, ctx, f"{pre}{m.out_projection}.weight")
    return rebase(m, TensorParallelFeedForward, sp=plan.sequence_parallel, overlap=plan.overlap)


def _split_experts(moe: MoE, pre: str, plan: TensorParallelPlan, ctx: ParallelContext) -> MoE:
    """Each routed and shared expert's width split (tensor_experts.py); the router replicated."""
    for proj, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):  # [E, out, in]
        _shard(moe.experts, proj, dim, plan, ctx, f"{pre}experts.{proj}")
    shared = moe.shared_experts
    if shared is not None:  # a plain feed-forward on its weight slices: partial outputs
        for proj in shared.in_projections:
            _shard(getattr(shared, proj), "weight", 0, plan, ctx,
                   f"{pre}shared_experts.{proj}.weight")
        _shard(getattr(shared, shared.out_projection), "weight", 1, plan, ctx,
               f"{pre}shared_experts.{shared.out_projection}.weight")
    return rebase(moe, TensorParallelMoE, sp=plan.sequence_parallel)
