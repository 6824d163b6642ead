"""Expert parallel: each of the ep ranks holds E / ep experts of every MoE layer, and tokens travel
to their experts and back by all-to-all (`parallel.ep`, carved out of dp: dp = edp x ep).

`apply_expert_parallel(model, ctx, cfg)` changes the plain model through its seams:
- slices each MoE's stacked expert weights along dim 0 (this rank's E / ep experts, sliced from the
  full tensors that (seed, name) initialised, names kept) and places them as `expert=True`,
  sharded over ep: their gradients sum over edp (x cp), the dense ones over dp (x cp), and ZeRO
  shards each over its own view (`ctx.grad_dim`, `ctx.shard_dim`);
- swaps each MoE's parameterless dispatcher for `AllToAllDispatcher`: the rows grouped by expert
  (the local dispatcher's permutation) are counted per destination rank, the counts exchanged,
  then the rows sent with uneven splits (`comm.all_to_all`, which counts exactly the bytes that
  leave the rank), and their routing weights (fp32, one per row: the experts apply them, see
  models/moe.py) the same way, both regrouped by local expert; combine sends the weighted rows
  back the same way. The exchanges are autograd functions whose backward is the reverse exchange
  (the weights' gradients travel back as the rows' do).

It returns the runtime's `Experts` part (also for ep = 1, whenever the model has experts): the
per-step load statistics, the auxiliary-loss-free bias update after each optimizer step, the
figures for the metrics, and the full expert weights gathered over ep for `full_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.config import Config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.moe import LocalDispatcher, MoE, Permutation
from ultrascale.parallel import overlap
from ultrascale.parallel.runtime import RuntimePart

EP = "ep"


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], tag: str) -> torch.Tensor:
    """The all-to-all of the rows, waited for through `overlap.wait`: when a pipeline runs a
    forward and a backward together (dualpipev), the other one computes while these rows travel."""
    out = rows.new_empty((sum(recv), rows.shape[1]))
    overlap.wait(comm.all_to_all(out, rows.contiguous(), EP, recv, send, async_op=True, tag=tag))
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [N, h] exchanged over ep: `send[j]` rows to rank j, `recv[j]` rows from it. Backward
    sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, recv, send, tag):
        ctx.recv, ctx.send, ctx.tag = recv, send, tag
        return _exchange(rows, recv, send, tag)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.send, ctx.recv, ctx.tag + "_grad"), None, None, None


class _Permute(torch.autograd.Function):
    """rows[index] for a permutation `index` whose inverse is `inverse`: backward is
    grad[inverse], which needs only that index (autograd's would scatter through `index`)."""

    @staticmethod
    def forward(ctx, rows, index, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass
class Exchange:
    """What combine needs to send rows back: the local permutation, the split sizes and the
    regrouping of received rows by local expert."""

    local: Permutation
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    order: torch.Tensor  # received rows -> grouped by local expert


class AllToAllDispatcher(LocalDispatcher):
    """The local permutation, then the rows to the ranks that hold their experts (ep rank r holds
    experts r E/ep .. (r+1) E/ep - 1)."""

    def __init__(self, ep: int, local_experts: int):
        super().__init__()
        self.ep, self.local_experts = ep, local_experts

    def dispatch(self, x, ids, weights, num_experts, dropped=0):
        rows, counts, row_weights, local = super().dispatch(x, ids, weights, num_experts,
                                                            dropped)
        send_counts = counts.view(self.ep, self.local_experts)  # [destination, its expert]
        recv_counts = torch.empty_like(send_counts)  # [source, my expert]
        comm.all_to_all(recv_counts.view(-1), send_counts.reshape(-1).contiguous(), EP,
                        tag="expert_counts")
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = _AllToAll.apply(rows, recv, send, "expert_dispatch")
        got_weights = _AllToAll.apply(row_weights.unsqueeze(1), recv, send, "expert_weights")
        # Received rows come by (source, expert); the grouped GEMM wants them by expert.
        block = torch.repeat_interleave(torch.arange(recv_counts.numel(), device=x.device),
                                        recv_counts.reshape(-1))
        source, expert = block // self.local_experts, block % self.local_experts
        order = torch.argsort(expert * self.ep + source, stable=True)
        return (got[order], recv_counts.sum(0), got_weights.squeeze(1)[order],
                Exchange(local, send, recv, order))

    def combine(self, rows, plan):
        # Back to (source, expert) order: a gather through the inverse permutation, whose
        # backward gathers through `order` (kept by dispatch's gather already), so that no row
        # is kept (index_copy would keep them all).
        inverse = torch.empty_like(plan.order)
        inverse[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)
        back = _Permute.apply(rows, inverse, plan.order)
        returned = _AllToAll.apply(back, plan.send, plan.recv, "expert_combine")
        return super().combine(returned, plan.local)


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(global layer index, MoE) of the blocks this rank holds: the layers, then the MTP
    modules' blocks, which count on after the layers (num_layers + k)."""
    return [(_block_index(model, prefix), getattr(holder, attr).mlp)
            for prefix, holder, attr in model.block_slots()
            if isinstance(getattr(holder, attr).mlp, MoE)]


def _block_index(model: nn.Module, prefix: str) -> int:
    parts = prefix.split(".")
    return int(parts[1]) + (model.cfg.num_layers if parts[0] == "mtp" else 0)


def block_prefix(model: nn.Module, index: int) -> str:
    """The parameter prefix of block `index` (as `moe_layers` counts them)."""
    n = model.cfg.num_layers
    return f"layers.{index}" if index < n else f"mtp.{index - n}.block"


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext, cfg: Config) -> "Experts | None":
    """Split the experts over ep (when ep > 1); the runtime's part for a model with experts."""
    layers = moe_layers(model)
    if not layers:
        return None
    ep = ctx.size(EP)
    if ep > 1:
        rank = ctx.coord(EP)
        for index, moe in layers:
            local = moe.num_experts // ep
            for pname, p in list(moe.experts.named_parameters()):
                mine = p.detach()[rank * local:(rank + 1) * local].clone()
                setattr(moe.experts, pname, nn.Parameter(mine, requires_grad=p.requires_grad))
                ctx.place(f"{block_prefix(model, index)}.mlp.experts.{pname}", sharded=(EP,),
                          expert=True)
            moe.dispatcher = AllToAllDispatcher(ep, local)
    return Experts(model, ctx, cfg)


class Experts(RuntimePart):
    """The runtime's part for a mixture of experts (see the module docstring)."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, cfg: Config):
        self.model, self.ctx = model, ctx
        m = cfg.model
        # Rows of the step's figures: every block with experts, the MTP modules' after the layers.
        self.num_layers = m.num_layers + m.mtp_layers
        self.num_experts, self.top_k = m.num_experts, m.experts_top_k
        self.aux_free = m.balance.startswith("aux_free")
        self.bias_rate = m.bias_update_rate
        self.last: dict | None = None  # the figures of the last step

    def scale_loss(self, loss_scale: float) -> float:
        """Before a step's forwards: the balancing losses in the step's loss scale, the load
        counted from zero."""
        for _, moe in moe_layers(self.model):
            moe.balance.loss_scale = loss_scale
            moe.balance.reset()
        return loss_scale

    def after_step(self, skipped: bool = False) -> None:
        """After the optimizer step: the step's load of every layer summed over all ranks and
        micro-batches (one all-reduce), the expert bias moved towards balance (aux_free:
        b_i += rate x sign(mean load - load_i), DeepSeek-V3), the figures kept for the metrics.
        A step `skipped` for an fp16 overflow changes no state: its load is reported, the bias
        stays."""
        e = self.num_experts
        stats = torch.zeros(self.num_layers, e + 3, dtype=torch.float64, device=self.ctx.device)
        held = moe_layers(self.model)
        for index, moe in held:
            b = moe.balance
            if b.load is not None:
                stats[index, :e] = b.load
            stats[index, e:] = torch.tensor([b.dropped, float(b.aux_sum), float(b.z_sum)],
                                            dtype=torch.float64)
        if self.ctx.world_size > 1:
            # Each layer's row is filled by the ranks of its pipeline stage; tp ranks (when
            # experts run under tp) would each hold the same counts.
            comm.all_reduce(stats, "world", tag="expert_load")
            stats /= self.ctx.size("tp")
        if self.aux_free and not skipped:
            with torch.no_grad():
                for index, moe in held:
                    load = stats[index, :e]
                    step = torch.sign(load.mean() - load) * self.bias_rate
                    moe.gate.expert_bias.add_(step.to(moe.gate.expert_bias.dtype))
        self.last = self._figures(stats)

    def _figures(self, stats: torch.Tensor) -> dict:
        e = self.num_experts
        rows = [i for i in range(self.num_layers) if stats[i, :e].sum() > 0]
        if not rows:
            return {}
        load = stats[rows, :e]
        tokens = load.sum(1) / self.top_k  # tokens of the global batch, per layer
        mean = load.mean(1)
        imbalance = (load.max(1).values / mean).tolist()
        return {
            "aux_loss": float((stats[rows, e + 1] / tokens).sum()),
            "z_loss": float((stats[rows, e + 2] / tokens).sum()),
            "load_max": float(load.max()),  # tokens per expert, the busiest of any layer
            "load_mean": float(mean.mean()),  # tokens per expert if balanced: tokens x k / E
            "load_max_over_mean": max(imbalance),
            "load_max_over_mean_per_layer": {str(i): round(r, 4) for i, r in zip(rows, imbalance)},
            "dropped_tokens": int(stats[rows, e].sum()),
        }

    def metrics(self) -> dict:
        return {} if self.last is None else {"moe": self.last}

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full plain-model tensors from this rank's experts (collective over ep)."""
        out = {}
        for name, t in tensors.items():
            if EP not in self.ctx.placement(name).sharded:
                out[name] = t
                continue
            local = t.detach().contiguous()
            full = local.new_empty((self.ctx.size(EP) * local.shape[0],) + tuple(local.shape[1:]))
            comm.all_gather(full, local, EP, tag="ep_state")
            out[name] = full
        return out
