"""A mixture-of-experts feed-forward in plain PyTorch: no parallel code lives here.

    x -> gate (router: scores, top-k experts per token and their weights)
      -> routed: dispatcher.dispatch (rows grouped by expert, each with its routing weight)
                 -> experts (grouped GEMM, SwiGLU times the row's weight, grouped GEMM)
                 -> dispatcher.combine (rows summed back per token)
      -> + shared_experts(x), a dense feed-forward every token goes through (optional),
           scaled per token by sigmoid(shared_expert_gate . x) where the model has that gate
           (Qwen2-MoE)

- Routers: "softmax" (Mixtral, Qwen-MoE: softmax over the experts, the top-k weights renormalised
  when k > 1) or "sigmoid" (DeepSeek-V3: sigmoid scores, the top-k weights normalised to sum 1);
  `router_renormalize` overrides whether the top-k weights are renormalised (Mixtral always,
  Qwen-MoE as its `norm_topk_prob` says). Group-limited routing (DeepSeek-V3, `router_groups`,
  `router_topk_groups`): a token chooses among the experts of its best groups only, a group
  scored by the sum of its two best scores; `routed_scaling_factor` scales the chosen weights.
- Routed experts are stacked weights [E, out, in] (`experts.gate_proj`, `up_proj`, `down_proj`,
  E linear weights of Mixtral's or Qwen's experts stacked), run by `grouped_gemm.grouped_mm`: one
  grouped GEMM per projection, or (impl "loop") one matmul per expert, the reference.
- Dropless by default; `capacity_factor` keeps at most ceil(cf x tokens x k / E) tokens per expert
  and micro-batch (first come, first served in token order) and counts the others as dropped.
- Load balancing (`LoadBalance`): the auxiliary loss in DeepSeek-V3's sequence-wise form (switch /
  GShard's f_i x P_i per sequence), the auxiliary-loss-free expert bias (a buffer of the router
  that shifts which experts are chosen, never their weights; the runtime moves it after each
  optimizer step from the measured load), and the router z-loss.

Seams a strategy uses without touching this file:
- `MoE.dispatcher`, parameterless: `LocalDispatcher` permutes the rows by expert and back; expert
  parallel swaps in an all-to-all one (parallel/expert.py).
- `LoadBalance.sequence_counts`: the per-sequence expert counts of the auxiliary loss; context
  parallel (a sequence split over cp ranks) overrides it to sum them over cp.
- `MoE.over_capacity`: which choices the capacity drops, first come, first served in the
  micro-batch's token order; context parallel overrides it to decide over the whole sequences.
- `MoE.routed`: the data-dependent part (sorting, exchanges, grouped GEMM of uneven groups), which
  regional compilation keeps out of the compiled graph (parallel/compile.py).
- `GroupedExperts.act`: the SwiGLU product, times each row's routing weight (selective
  recomputation, fused kernels, FP8). The weight applied there rather than to the expert's
  output (down(w silu(g) u) = w down(silu(g) u), by linearity) lets the combine keep nothing but
  its index: the weight's gradient, the row's sum of dy * silu(g) * u over the expert's width,
  needs only what the SwiGLU keeps anyway, where a weighted combine keeps every output row.
- `GroupedExperts.matmul`: the grouped GEMM (a precision's: FP8 experts, parallel/precision.py).
Parameter names follow Hugging Face's Mixtral / Qwen-MoE (`gate`, experts' gate/up/down) so that
an import maps them one to one (the experts stacked).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.config import ModelConfig
from ultrascale.models import ops
from ultrascale.models.grouped_gemm import GroupedMatmul


@dataclass
class Routing:
    """What the router decided for T tokens."""

    ids: torch.Tensor  # [T, k] the chosen experts
    weights: torch.Tensor  # [T, k] fp32, their weights in the output (the router's gradient)
    probs: torch.Tensor  # [T, E] fp32 scores normalised over the experts (the auxiliary loss)
    logits: torch.Tensor  # [T, E] fp32 (the z-loss)


class Router(nn.Module):
    """`weight` [E, hidden] scores each token against each expert. With the auxiliary-loss-free
    balance it also holds `expert_bias` [E], a persistent buffer added to the scores only to
    choose the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, score: str, bias: bool,
                 renormalize: bool | None = None, groups: int = 1, topk_groups: int | None = None,
                 scaling: float = 1.0):
        super().__init__()
        self.top_k, self.score = top_k, score
        # Renormalise over the chosen experts by default for sigmoid scores, and for a softmax
        # when k > 1 (a softmax top-1 keeps its probability, so that the router still learns
        # from the output: Switch); Mixtral and Qwen-MoE's norm_topk_prob choose for themselves.
        self.renormalize = (score == "sigmoid" or top_k > 1) if renormalize is None \
            else renormalize
        self.groups, self.topk_groups = groups, topk_groups or groups
        self.scaling = scaling  # routed_scaling_factor: the chosen weights times this
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        # Scores in fp32 whatever the compute dtype (DeepSeek-V3's and Megatron's choice): with
        # bf16 logits, near-ties between experts are decided by rounding, and the tiny-moe
        # preset ended 2.7% above fp32 after 60 steps on one process, within 1% of it with these.
        logits = ops.linear_fp32(x, self.weight)  # keeps x, not an fp32 copy
        if self.score == "softmax":
            scores = probs = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        choose = scores if self.expert_bias is None else scores + self.expert_bias
        if self.topk_groups < self.groups:
            choose = self.limit_groups(choose)
        ids = choose.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return Routing(ids, weights, probs, logits)

    def limit_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3): the experts in `groups` equal consecutive groups,
        each group scored by the sum of its two best scores (bias included, as the choice is);
        the experts outside the `topk_groups` best groups can no longer be chosen (-inf)."""
        tokens, experts = choose.shape
        per_group = experts // self.groups
        grouped = choose.view(tokens, self.groups, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, groups]
        kept = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(tokens, experts)


class SharedExpertGate(nn.Module):
    """`weight` [1, hidden]: sigmoid(weight . x) per token, the share of the shared experts'
    output that token takes (Qwen2-MoE's shared_expert_gate)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight).sigmoid()


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights, run on rows grouped by expert (`counts` rows each)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, act: nn.Module):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.act = act
        self.impl = "grouped"  # or "loop": the per-expert reference (grouped_gemm.grouped_mm)
        self.matmul = GroupedMatmul()  # the three GEMMs (FP8: parallel/precision.py swaps it)

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, h] grouped by expert -> [N, h]; `weight` [N] fp32 scales each row's output (the
        routing weight, applied in the act: see the module docstring)."""
        gate = self.matmul(x, self.gate_proj, counts, self.impl)
        up = self.matmul(x, self.up_proj, counts, self.impl)
        return self.matmul(self.act(gate, up, weight), self.down_proj, counts, self.impl)


@dataclass
class Permutation:
    """How routed rows map back to tokens."""

    token: torch.Tensor  # [N] the token of each routed row, rows grouped by expert
    tokens: int  # T, the tokens of the micro-batch


class LocalDispatcher(nn.Module):
    """Parameterless: groups the (token, choice) rows by expert and puts them back. Expert ids
    equal to E mark choices dropped by the capacity: they are left out."""

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 num_experts: int, dropped: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        """x [T, h], ids and weights [T, k] (`dropped` of them marked E) -> (rows [N, h] grouped
        by expert, rows per expert held here [E], each row's routing weight [N] fp32, what
        combine needs)."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        kept = order[:flat.numel() - dropped]  # the dropped sort last
        token = kept // ids.shape[1]
        return x[token], counts, weights.reshape(-1)[kept], Permutation(token, x.shape[0])

    def combine(self, rows: torch.Tensor, plan: Permutation) -> torch.Tensor:
        """rows [N, h] as dispatched (already weighted by the experts) -> [T, h]: each token's
        rows summed."""
        return _SumRows.apply(rows, plan.token, plan.tokens)


class _SumRows(torch.autograd.Function):
    """out[index[i]] += rows[i] into `tokens` rows (in the rows' dtype). Backward is
    grad[index], which needs only the index (autograd's index_add keeps the rows too, torch
    2.13)."""

    @staticmethod
    def forward(ctx, rows, index, tokens):
        ctx.save_for_backward(index)
        return rows.new_zeros(tokens, rows.shape[1]).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _AttachLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward, `term` (a loss on the router's outputs) gets the
    gradient `scale`, as if it had been added to the loss that backward started from."""

    @staticmethod
    def forward(ctx, out, term, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def attach_loss(out: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:
    """`out` unchanged, with the gradient `scale` given to `term` in its backward (a loss on the
    side of the one backward starts from: the balancing losses, multi-token prediction's)."""
    return _AttachLoss.apply(out, term, scale)


class LoadBalance(nn.Module):
    """Parameterless: the balancing losses of one MoE layer, and its measured load.

    Losses are in the token loss's units (the loss a micro-batch returns is its *summed* token
    cross-entropy; the runtime scales it by 1 / tokens of the global batch): per sequence of S
    tokens the auxiliary loss is `aux_coeff` x sum_i f_i P_i (f_i = E / (k S) x tokens choosing
    expert i, P_i = mean score of expert i, DeepSeek-V3's sequence-wise form) counted S times,
    the z-loss `z_coeff` x logsumexp(logits)^2 per token. Both reach the router's gradient
    through `_AttachLoss` with the runtime's `loss_scale`, so every layout that sees the same
    sequences gets the same gradient, however they are split into micro-batches and ranks.

    Measured per step (reset by the runtime): `load` [E] tokens choosing each expert, `dropped`
    choices over capacity, and the two losses' sums (detached), all summed over micro-batches;
    kept as tensors, so that recording waits for no device."""

    def __init__(self, num_experts: int, top_k: int, aux_coeff: float, z_coeff: float):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coeff, self.z_coeff = aux_coeff, z_coeff
        self.loss_scale = 1.0  # the runtime's per step; 1: the summed token loss's own scale
        self.recording = True  # off while full recomputation replays the forward
        self.reset()

    def reset(self) -> None:
        self.load: torch.Tensor | None = None
        self.dropped = 0
        self.aux_sum: torch.Tensor | float = 0.0
        self.z_sum: torch.Tensor | float = 0.0

    def sequence_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[sequences, E] expert counts of the tokens held here -> of the whole sequences (the
        seam context parallel overrides: its ranks hold parts of each sequence)."""
        return counts

    def forward(self, routing: Routing, sequences: int, dropped: int) -> torch.Tensor | None:
        """Record the load; return the balancing losses of these tokens (None when off)."""
        tokens, experts = routing.probs.shape
        chosen = torch.zeros_like(routing.probs).scatter_(1, routing.ids, 1.0)  # [T, E]
        terms = []
        if self.aux_coeff:
            counts = self.sequence_counts(chosen.view(sequences, -1, experts).sum(1))
            seq_tokens = counts.sum(1, keepdim=True) / self.top_k
            f = counts * (experts / self.top_k) / seq_tokens
            # The scores of the tokens held here: under context parallel a partial sum, whose
            # terms the cp ranks' losses (and gradients) add up to the whole sequence's.
            score_sums = routing.probs.view(sequences, -1, experts).sum(1)
            terms.append(self.aux_coeff * (f * score_sums).sum())  # S x sum_i f_i (sums_i / S)
        if self.z_coeff:
            terms.append(self.z_coeff * torch.logsumexp(routing.logits, -1).pow(2).sum())
        if self.recording:
            load = chosen.sum(0).detach().double()
            self.load = load if self.load is None else self.load + load
            self.dropped += dropped
            if self.aux_coeff:
                self.aux_sum = self.aux_sum + terms[0].detach().double()
            if self.z_coeff:
                self.z_sum = self.z_sum + terms[-1].detach().double()
        return sum(terms) if terms else None


class MoE(nn.Module):
    """The routed feed-forward of a block (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, act: nn.Module, shared_experts: nn.Module | None = None):
        super().__init__()
        e, k, h = cfg.num_experts, cfg.experts_top_k, cfg.hidden_size
        self.num_experts, self.top_k = e, k
        self.capacity_factor = cfg.capacity_factor
        self.gate = Router(h, e, k, cfg.router, bias=cfg.balance.startswith("aux_free"),
                           renormalize=cfg.router_renormalize, groups=cfg.router_groups,
                           topk_groups=cfg.router_topk_groups,
                           scaling=cfg.routed_scaling_factor)
        self.experts = GroupedExperts(e, h, cfg.expert_ffn_hidden_size, act)
        self.shared_experts = shared_experts
        self.shared_expert_gate = SharedExpertGate(h) if cfg.shared_expert_gate else None
        self.dispatcher = LocalDispatcher()
        aux = cfg.balance in ("aux_loss", "aux_free_and_aux_loss")
        self.balance = LoadBalance(e, k, cfg.aux_loss_coeff if aux else 0.0, cfg.z_loss_coeff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequences, seq, h = x.shape
        flat = x.reshape(-1, h)
        y = self.routed(flat, self.gate(flat), sequences)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = self.shared_expert_gate(flat) * shared
            y = y + shared
        return y.view(sequences, seq, h)

    def routed(self, x: torch.Tensor, routing: Routing, sequences: int) -> torch.Tensor:
        """The routed experts' output [T, h] for tokens x [T, h], balancing losses attached."""
        device = x.device.type
        if torch.is_autocast_enabled(device):  # rows travel and are kept in the compute dtype
            x = x.to(torch.get_autocast_dtype(device))
        ids, dropped = self.over_capacity(routing.ids, sequences)
        rows, counts, weights, plan = self.dispatcher.dispatch(x, ids, routing.weights,
                                                               self.num_experts, dropped)
        y = self.dispatcher.combine(self.experts(rows, counts, weights), plan)
        term = self.balance(routing, sequences, dropped)
        if term is None or not torch.is_grad_enabled():
            return y
        return attach_loss(y, term, self.balance.loss_scale)

    def over_capacity(self, ids: torch.Tensor, sequences: int = 1) -> tuple[torch.Tensor, int]:
        """Mark choices beyond each expert's capacity as dropped (expert id E); dropless: none.
        `ids` [T, k] are the choices of `sequences` sequences' tokens, in token order."""
        if self.capacity_factor is None:
            return ids, 0
        tokens, k = ids.shape
        capacity = math.ceil(self.capacity_factor * tokens * k / self.num_experts)
        flat = ids.reshape(-1)
        onehot = torch.nn.functional.one_hot(flat, self.num_experts)
        place = (onehot.cumsum(0) * onehot).sum(1) - 1  # the choice's place in its expert's queue
        drop = place >= capacity
        return torch.where(drop, self.num_experts, flat).view(tokens, k), int(drop.sum())


@contextmanager
def replaying(module: nn.Module):
    """Within this block the MoE layers under `module` record no load: full recomputation runs
    their forward a second time in backward, and the step's figures must count it once."""
    balances = [m for m in module.modules() if isinstance(m, LoadBalance)]
    before = [b.recording for b in balances]
    for b in balances:
        b.recording = False
    try:
        yield
    finally:
        for b, was in zip(balances, before):
            b.recording = was
