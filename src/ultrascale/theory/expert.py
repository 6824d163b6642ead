"""Mixture of experts and expert parallelism: an MoE layer's tensors and GEMMs, and the token
all-to-all over ep (models/moe.py, parallel/expert.py).

Bytes: what an MoE layer saves beyond a dense one (the router's probabilities, the routed rows,
their indices and weights; `block.py` asks), and the dispatch/combine buffers. Seconds: the experts'
grouped GEMMs and the router (`block.py` asks), and per MoE layer the dispatch and combine
all-to-alls (the dispatch's with the rows' routing weights beside it). (The experts' parameters are
the model's, `params.py`; ZeRO shards them over dp / ep: `data.py`.) Torch-free.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ultrascale.layout import DTYPE_BYTES, Layout, storage_bytes
from ultrascale.theory.rates import collective_time, gemm_time
from ultrascale.theory.shape import ModelShape, Shape
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware

WEIGHT_BYTES = 4  # a routed row's routing weight travels with it in fp32 (parallel/expert.py)


# ------------------------------------------------------------------------------------------------
# Bytes


def mlp_rows(x: Shape) -> int:
    """Rows through the layer's SwiGLU: its tokens, or in an MoE layer every routed copy and the
    shared experts' rows."""
    tok = x.b * x.s
    return tok * (x.top_k + x.shared_experts) if x.experts else tok


def routing_saved(x: Shape) -> dict[str, int]:
    """What an MoE layer keeps for backward beside its experts' SwiGLU, as models/moe.py and
    parallel/expert.py run it, by the op that keeps it:

    - the router's probabilities over all experts (fp32, kept by softmax or sigmoid); the router
      multiplies in fp32 but keeps its input and weight as they came (`ops.linear_fp32`): the
      MLP norm's output, counted with the norm (`block.tensors_layer`);
    - per routed row, in the compute dtype: the row going into the experts (the norm output
      copied in expert order, kept by the gate and up GEMMs); not the row coming out of them:
      the experts' SwiGLU applies the routing weight, so the combine is a plain sum that keeps
      only its index (models/moe.py `_SumRows`);
    - per routed row three int64 indices (the chosen expert, the sorted order, the token) and two
      fp32 weights (the chosen ones, kept by the renormalisation; the row's, in expert order,
      kept by the SwiGLU); under expert parallel one more int64, the regrouping of received rows
      by local expert (kept by dispatch's gathers of the rows and of their weights; the combine's
      gather back through its inverse, `_Permute`, keeps the same index), the rows received
      taken as balanced;
    - with a shared-expert gate, sigmoid(gate . x) * shared keeps the shared experts' output and
      the gate (which the sigmoid keeps too), both in the compute dtype.

    A z-loss would add the logits (fp32) again. Nothing for a dense layer."""
    if not x.experts:
        return {}
    a, tok = x.act, x.b * x.s
    routed = tok * x.top_k
    experts = x.experts * x.ep  # the router scores them all
    out = {"MoE routing": (tok * experts * 4 + routed * x.h * a
                           + routed * (3 * 8 + 2 * 4 + (8 if x.ep > 1 else 0)))}
    if x.shared_experts and x.shared_gate:
        out["shared expert gate"] = tok * (x.h + 1) * a
    return out


def stage_bytes(stage: Stage) -> Bytes | None:
    """The dispatch and combine buffers of the all-to-all, and the routing weights received
    with the rows (fp32, one per row)."""
    if stage.layout.ep == 1:
        return None
    x = stage.shape
    routed = x.b * x.s * x.top_k
    return Bytes(comm={"expert all-to-all": 2 * routed * x.h * x.act + routed * 4})


# ------------------------------------------------------------------------------------------------
# Seconds


def moe_gemms(m: ModelShape, lay: Layout, hw: "Hardware", sh: Shape) -> list[float]:
    """An MoE layer's forward GEMMs beside the attention's, added in this order: the routed
    experts, the router, the shared experts.

    Each rank runs its E/ep experts (of width moe_ffn_hidden_size) on the tokens routed to them,
    T * top_k rows in all: one grouped GEMM per projection, each expert's share as fast as a GEMM
    of its rows. The routed experts are not linear layers: under fp8 they stay in bf16 unless
    `precision.fp8_experts` runs them at the fp8 rate too (docs/precision.md); shared experts
    are, and run in fp8. The router multiplies in fp32."""
    T, h, tp, dt = sh.tokens, sh.h, sh.tp, sh.dtype
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    e_local = m.num_experts / lay.ep
    per_expert = T * m.experts_top_k / e_local
    routed = dt if lay.fp8_experts else sh.store
    out = [e_local * (gemm_time(hw, per_expert, 2 * f / tp, h, routed)
                      + gemm_time(hw, per_expert, h, f / tp, routed)),
           gemm_time(hw, T, m.num_experts, h, "fp32")]  # router
    if m.shared_experts:
        out.append(m.shared_experts * (gemm_time(hw, T, 2 * f / tp, h, dt)
                                       + gemm_time(hw, T, h, f / tp, dt)))
    return out


def moe_share(m: ModelShape) -> float:
    """The share of the model's layers that are MoE layers."""
    return 1 - min(m.first_k_dense, m.num_layers) / m.num_layers


def ep_layer_comm(m: ModelShape, lay: Layout, hw: "Hardware", sh: Shape) -> float:
    """Token dispatch and combine all-to-alls of the model's average block, forward plus
    backward: `expert_alltoall_bytes` (what parallel/expert.py sends) in each of the four
    exchanges, six under full recomputation (its forward replays them); and the routing weights'
    own exchange beside the dispatch (`routing_weight_bytes`), forward and backward (three
    times under full recomputation); dense layers none."""
    if not m.num_experts or lay.ep == 1:
        return 0.0
    full = lay.recompute == "full"
    # collective_time takes the buffer whose (ep - 1) / ep leaves the rank.
    routed = sh.tokens * m.experts_top_k / (lay.tp if lay.sequence_parallel else 1)
    exchange = partial(collective_time, hw, "all_to_all", n=lay.ep, stride=lay.tp * lay.cp)
    return moe_share(m) * ((6 if full else 4) * exchange(routed * sh.h * DTYPE_BYTES[sh.store])
                           + (3 if full else 2) * exchange(routed * WEIGHT_BYTES))


def expert_alltoall_bytes(model, lay: Layout) -> float:
    """Bytes one rank sends in one exchange of one MoE layer and micro-batch, routing balanced:
    the rows of its tokens routed to experts on other ep ranks (tokens x top_k x (ep - 1) / ep),
    hidden_size wide, in the activations' dtype (bf16 under fp8); counted by comm.all_to_all
    exactly so. The dispatch also sends those rows' routing weights: `routing_weight_bytes`."""
    return _rows_off_rank(model, lay) * model.hidden_size * storage_bytes(lay.dtype)


def routing_weight_bytes(model, lay: Layout) -> float:
    """Bytes one rank sends in the routing weights' exchange beside a dispatch (and their
    gradients in its backward): one fp32 per row `expert_alltoall_bytes` counts."""
    return _rows_off_rank(model, lay) * WEIGHT_BYTES


def _rows_off_rank(model, lay: Layout) -> float:
    tokens = lay.mbs * lay.seq_len / lay.cp
    return tokens * model.experts_top_k * (lay.ep - 1) / lay.ep


def seconds(step: Step) -> Seconds | None:
    """The all-to-alls of each layer, half in each pass."""
    if not step.model.num_experts or step.lay.ep == 1:
        return None
    comm = ep_layer_comm(step.model, step.lay, step.hw, step.sh)
    return Seconds(layer=Pass({"ep_comm": comm / 2}, {"ep_comm": comm / 2}),
                   carried={"layer": Carried(comm=comm)})


TERM = Term("expert", stage_bytes=stage_bytes, seconds=seconds)
