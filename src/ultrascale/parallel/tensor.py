"""Tensor parallel (Megatron-style), with optional sequence parallel.

`apply_tensor_parallel(model, ctx)` transforms a plain `Llama` (or a pipeline stage of one: embed,
norm or output may be None and only some layers kept) in place, module by module:

- attention: q/k/v column-parallel (whole heads per rank), o_proj row-parallel. With grouped-query
  attention, kv heads are split when tp divides them; otherwise every rank keeps all kv weights,
  uses the rows its query heads need, and their gradients are summed over tp;
- MLP: gate/up column-parallel, down row-parallel;
- embedding and output head split over the vocabulary (padded to a multiple of tp), with a
  vocabulary-parallel cross-entropy as the runtime's loss;
- sequence parallel: the residual stream and the norms hold 1/tp of the sequence; norm weights get
  partial gradients, summed over tp.

Weights are sliced from the full model (initialised from seed and name), so any layout starts from
the same weights. `attach_tensor_parallel(runtime, plan)` sets the loss and makes
`full_state_dict()` gather the shards back into plain-model tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Attention, Llama, RMSNorm, SwiGLU, apply_rotary, rotary_cos_sin
from ultrascale.parallel.runtime import Runtime, mark_sharded
from ultrascale.parallel.tensor_layers import (TP, column_parallel, copy_to_tp, enter_tp,
                                               row_parallel)
from ultrascale.parallel.vocab_parallel import (VocabParallelEmbedding, VocabShard,
                                                vocab_parallel_cross_entropy)

PLAN_ATTR = "_ultrascale_tp_plan"


@dataclass
class TensorParallelPlan:
    """What the transformation did, for the runtime: how each parameter is split."""

    tp: int
    rank: int
    sequence_parallel: bool
    overlap: bool
    vocab: VocabShard | None
    # plain-model name -> (dim split over tp, true size along it to unpad to, or None)
    split: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.vocab)

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


# -- modules that replace the plain ones (same parameter names) -----------------------------------


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard: its weight gradient is partial on each rank and summed over tp.
    `gather_output` (the final norm) then gathers the sequence for the vocabulary-parallel head."""

    def __init__(self, norm: RMSNorm, gather_output: bool = False):
        nn.Module.__init__(self)
        self.eps, self.weight, self.gather_output = norm.eps, norm.weight, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = xf.type_as(x) * copy_to_tp(self.weight, "tp_param_grad")
        return enter_tp(y, True) if self.gather_output else y


class HeadInputNorm(RMSNorm):
    """Final norm without sequence parallel: its output feeds the vocabulary-parallel head, whose
    input gradient is partial on each rank (Megatron's f)."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.eps, self.weight = norm.eps, norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_tp(super().forward(x), False)


def _keep_replaced_methods(old: nn.Module, new: nn.Module) -> None:
    """Carry over methods replaced on the plain module instance (recomputation checkpoints
    `Attention.core` and `SwiGLU.activation`, which use no weights); `forward` is ours."""
    for name, fn in vars(old).items():
        if name != "forward" and callable(fn) and not isinstance(fn, nn.Module) \
                and hasattr(type(old), name):
            setattr(new, name, fn)


class TensorParallelAttention(Attention):
    """Attention over this rank's heads. `kv_rows` selects, when kv heads are replicated, the kv
    heads its query heads use; `kv_index` maps local query heads to those kv heads when they do not
    form equal groups (then k/v are expanded to one head per query head)."""

    def __init__(self, attn: Attention, sp: bool, overlap: bool, kv_rows: slice | None,
                 kv_index: torch.Tensor | None):
        nn.Module.__init__(self)
        self.head_dim, self.rope_theta = attn.head_dim, attn.rope_theta
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (attn.q_proj, attn.k_proj,
                                                              attn.v_proj, attn.o_proj)
        self.sp, self.overlap, self.kv_rows, self.kv_index = sp, overlap, kv_rows, kv_index
        _keep_replaced_methods(attn, self)

    def _kv_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.kv_rows is None:
            return w
        return copy_to_tp(w, "tp_param_grad")[self.kv_rows]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = column_parallel(x, [self.q_proj.weight, self._kv_weight(self.k_proj.weight),
                                      self._kv_weight(self.v_proj.weight)], self.sp, self.overlap)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_index is not None:
            k, v = k[:, :, self.kv_index], v[:, :, self.kv_index]
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return row_parallel(out.transpose(1, 2).reshape(b, s, -1), self.o_proj.weight, self.sp)


class TensorParallelSwiGLU(SwiGLU):
    def __init__(self, mlp: SwiGLU, sp: bool, overlap: bool):
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.sp, self.overlap = sp, overlap
        _keep_replaced_methods(mlp, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel(x, [self.gate_proj.weight, self.up_proj.weight], self.sp,
                                   self.overlap)
        return row_parallel(self.activation(gate, up), self.down_proj.weight, self.sp)


# -- the transformation ---------------------------------------------------------------------------


def _shard(module: nn.Module, attr: str, dim: int, plan: TensorParallelPlan, name: str,
           vocab: VocabShard | None = None) -> None:
    """Replace module.<attr> by this rank's slice along `dim` (marked as split over tp)."""
    full = getattr(module, attr).detach()
    if vocab is not None:
        local = vocab.slice_rows(full)
        plan.split[name] = (0, vocab.vocab_size)
    else:
        n = full.shape[dim] // plan.tp
        local = full.narrow(dim, plan.rank * n, n).clone()
        plan.split[name] = (dim, None)
    p = nn.Parameter(local, requires_grad=getattr(module, attr).requires_grad)
    mark_sharded(p, TP)
    setattr(module, attr, p)


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
    """Split `model` (in place) over the "tp" dimension of `ctx`; returns the plan, also kept on
    the model as `_ultrascale_tp_plan`."""
    cfg, tp, rank = model.cfg, ctx.size(TP), ctx.coord(TP)
    if cfg.num_heads % tp or cfg.ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} must divide num_heads={cfg.num_heads} and ffn_hidden_size="
                         f"{cfg.ffn_hidden_size}")
    vocab = VocabShard.of(cfg.vocab_size, tp, rank)
    plan = TensorParallelPlan(tp, rank, sequence_parallel, overlap, vocab)
    hd = cfg.head_dim
    kv_split = cfg.num_kv_heads % tp == 0
    for idx, block in model.layers.items():
        pre = f"layers.{idx}."
        a = block.attn
        _shard(a.q_proj, "weight", 0, plan, pre + "attn.q_proj.weight")
        kv_rows = kv_index = None
        if kv_split:
            _shard(a.k_proj, "weight", 0, plan, pre + "attn.k_proj.weight")
            _shard(a.v_proj, "weight", 0, plan, pre + "attn.v_proj.weight")
        else:
            (lo, hi), kv_index = _kv_layout(cfg.num_heads, cfg.num_kv_heads, tp, rank)
            kv_rows = slice(lo * hd, hi * hd)
        _shard(a.o_proj, "weight", 1, plan, pre + "attn.o_proj.weight")
        block.attn = TensorParallelAttention(a, sequence_parallel, overlap, kv_rows, kv_index)
        m = block.mlp
        _shard(m.gate_proj, "weight", 0, plan, pre + "mlp.gate_proj.weight")
        _shard(m.up_proj, "weight", 0, plan, pre + "mlp.up_proj.weight")
        _shard(m.down_proj, "weight", 1, plan, pre + "mlp.down_proj.weight")
        block.mlp = TensorParallelSwiGLU(m, sequence_parallel, overlap)
        if sequence_parallel:
            block.attn_norm = SequenceParallelRMSNorm(block.attn_norm)
            block.mlp_norm = SequenceParallelRMSNorm(block.mlp_norm)
    if model.embed is not None:
        _shard(model.embed, "weight", 0, plan, "embed.weight", vocab)
        model.embed = VocabParallelEmbedding(model.embed.weight, vocab, sequence_parallel)
    if model.output is not None:
        _shard(model.output, "weight", 0, plan, "output.weight", vocab)
    if model.norm is not None:
        model.norm = (SequenceParallelRMSNorm(model.norm, gather_output=True)
                      if sequence_parallel else HeadInputNorm(model.norm))
    if sequence_parallel:
        model.register_forward_pre_hook(_full_positions(tp), with_kwargs=True)
    setattr(model, PLAN_ATTR, plan)
    return plan


def _full_positions(tp: int):
    """Under sequence parallel the residual stream holds 1/tp of the sequence, but attention sees
    the whole gathered sequence: give the blocks the positions of the full sequence."""

    def hook(model: Llama, args, kwargs):
        if len(args) > 1 or kwargs.get("positions") is not None:
            return None
        x = args[0] if args else kwargs["tokens"]
        # Token ids hold the full sequence; hidden states from a previous stage hold a shard.
        seq = x.shape[1] if model.embed is not None else x.shape[1] * tp
        return args, {**kwargs, "positions": torch.arange(seq, device=x.device)}

    return hook


def attach_tensor_parallel(rt: Runtime, plan: TensorParallelPlan) -> Runtime:
    """Give a runtime (of any kind: data parallel, ZeRO, ...) the vocabulary-parallel loss and a
    `full_state_dict` that gathers the tp shards after the runtime's own gathering."""
    rt.loss_fn = plan.loss_fn
    rt.tp_plan = plan
    if not getattr(rt, "gathers_tensor_parallel", False):  # a pipeline runtime does it per stage
        inner = rt.full_state_dict
        rt.full_state_dict = lambda: plan.gather_full(inner())
    return rt
