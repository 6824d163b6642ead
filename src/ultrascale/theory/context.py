"""Context parallelism (parallel/context.py, ring_attention.py): ring, all-gather or Ulysses
attention over cp ranks that each hold chunks r and 2cp-1-r of every sequence.

Bytes: what its attention holds while one layer's backward runs (K/V blocks in flight, fp32
dq and dK/dV accumulators, or Ulysses' all-to-all buffers), and Ulysses' token order. Seconds:
its transfers per layer, hidden under the attention where they can be, and what an MoE layer
adds (its per-sequence balance statistics summed over cp). (That each rank holds seq_len / cp of
the tokens, the shapes already say: `shape.Shape`.) Torch-free.
"""

from __future__ import annotations

from math import gcd
from typing import TYPE_CHECKING

from ultrascale.layout import Layout
from ultrascale.theory.expert import moe_share
from ultrascale.theory.rates import collective_time
from ultrascale.theory.recompute import POLICIES
from ultrascale.theory.shape import Shape
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware
    from ultrascale.theory.attention import Attention


# ------------------------------------------------------------------------------------------------
# Bytes


CP_ATTENTION_BACKWARD = "context-parallel attention's backward buffers"


def context_parallel_buffers(lay: Layout, x: Shape, attention: "Attention") -> dict[str, float]:
    """What context-parallel attention holds while one layer's backward runs (its peak), beside
    the saved activations: dq, dK/dV are accumulated in fp32."""
    a, tok = x.act, x.b * x.s
    kv = 2 * tok * attention.kv_elements(x)  # this rank's K and V
    q = tok * attention.q_elements(x)
    dq = q * 4
    if lay.cp_mode == "ring":
        # The block in hand and the next one arriving; our own dK/dV, the accumulator being sent
        # on and the one arriving.
        return {"context-parallel k/v blocks": 2 * kv * a,
                "context-parallel dq, dk/dv (fp32)": dq + 3 * kv * 4}
    if lay.cp_mode == "all_gather":
        # The gathered K and V, every block's dK/dV before the reduce-scatter, our share after.
        return {"context-parallel gathered k/v": lay.cp * kv * a,
                "context-parallel dq, dk/dv (fp32)": dq + (lay.cp + 1) * kv * 4}
    # Ulysses: the contiguous copy sent and the buffer received of q, k and v (and of their
    # gradients in backward), each at its own width (MLA's values narrower than its keys); a
    # GQA's kv heads as Ulysses replicates them up to cp (`shape.ulysses_kv`).
    k, v = attention.k_elements(x), attention.v_elements(x)
    if x.attn_kv and k == v == x.kv:
        k = v = x.attn_kv
    return {"context-parallel all-to-all buffers": 2 * (q + tok * (k + v)) * a}


def stage_bytes(stage: Stage) -> Bytes | None:
    lay = stage.layout
    if lay.cp == 1:
        return None
    # They live while a layer's attention runs its backward: a transient of the layer backward,
    # which its norm's and SwiGLU's workspaces do not meet (on fake tensors, tiny-moe cp2
    # all-gather under full recompute peaked in a norm's backward without them: +12% counted).
    buffers = context_parallel_buffers(lay, stage.shape, stage.attention)
    out = Bytes(transient={CP_ATTENTION_BACKWARD: sum(buffers.values())})
    if (lay.cp_mode == "ulysses" and lay.recompute == "none" and stage.layers
            and stage.impl.activations == "tensors"):
        # Where each token of the gathered sequence comes from and goes back to (int64, three of
        # seq_len, made once and shared by every layer and micro-batch).
        out.once["Ulysses token order"] = 3 * lay.seq_len * 8
    return out


# ------------------------------------------------------------------------------------------------
# Seconds


# (kind, tag) -> (calls, bytes of each), as distributed/comm.py records them.
Transfers = dict[tuple[str, str], tuple[int, int]]


def core_forwards(lay: Layout) -> int:
    """How many times each layer's attention core runs forward per micro-batch: twice where the
    recompute policy reruns it in backward (full: the whole layer; selective: the core, inside
    whose checkpoint context parallel's transfers sit), else once."""
    policy = POLICIES[lay.recompute]
    return 2 if policy.whole_layer or policy.attention_core else 1


def cp_layer_transfers(lay: Layout, x: Shape, attention: "Attention") -> Transfers:
    """Every transfer context-parallel attention makes over cp for one layer and one micro-batch
    on one rank, as parallel/context.py and ring_attention.py make them and distributed/comm.py
    counts them (a shift: the bytes sent; all-gather and reduce-scatter: the whole gathered
    buffer; an all-to-all: its input). The widths are the attention's (`attention.Attention`):
    keys, values and the output each at their own (MLA's values and output are narrower than
    its queries and keys). K, V, q and the output travel in the activations' dtype; dK/dV are
    accumulated and sent in fp32 whatever the dtype (ring_attention.py)."""
    cp = lay.cp
    if cp == 1:
        return {}
    tok, a, fwd = x.b * x.s, x.act, core_forwards(lay)
    kv = tok * (attention.k_elements(x) + attention.v_elements(x))  # packed in one message
    if lay.cp_mode == "ring":
        # cp-1 shifts of [K, V] per forward, cp-1 again backward, and cp-1 of the [dK, dV]
        # accumulators behind them (the receive posted ahead of the last one counts nothing).
        return {("ring_shift", "cp_kv"): ((fwd + 1) * (cp - 1), kv * a),
                ("ring_shift", "cp_dkv"): (cp - 1, kv * 4)}
    if lay.cp_mode == "all_gather":
        # [K, V] gathered per forward and again in backward (rather than kept), [dK, dV]
        # reduce-scattered.
        return {("all_gather", "cp_kv"): (fwd, cp * kv * a),
                ("all_gather", "cp_kv_regather"): (1, cp * kv * a),
                ("reduce_scatter", "cp_dkv"): (1, cp * kv * 4)}
    # Ulysses: q, k, v from the sequence split to the head split and the output back, per
    # forward; their gradients the other way in backward. Key/value heads that cp does not
    # divide are replicated up to a multiple of cp before they are sent.
    heads = attention.kv_heads(x)
    rep = 1 if heads % cp == 0 else cp // gcd(heads, cp)
    sizes = {"q": attention.q_elements(x), "k": attention.k_elements(x) * rep,
             "v": attention.v_elements(x) * rep, "out": attention.out_elements(x)}
    out: Transfers = {}
    for name, width in sizes.items():
        out[("all_to_all", f"cp_{name}")] = (fwd, tok * width * a)
        out[("all_to_all", f"cp_{name}_bwd")] = (1, tok * width * a)
    return out


def cp_layer_comm(lay: Layout, hw: "Hardware", sh: Shape, attention: "Attention",
                  attn_f: float, attn_b: float) -> float:
    """Context-parallel attention's transfers of one block, forward plus backward (and the
    forwards a recompute policy reruns), priced from `cp_layer_transfers`' bytes, so that the
    seconds and the engine's count cannot part:

    - ring: each forward shift of K and V hidden under the attention of the block in hand where
      it is long enough; backward, each shift of K and V and of the dK/dV accumulators (fp32)
      under the block's backward;
    - all_gather: K and V gathered per forward and again backward (the own block computed under
      each gather), dK/dV (fp32) reduce-scattered;
    - ulysses: the all-to-alls of q, k, v and the output per forward, of their gradients
      backward, in the critical path (attention waits for them); each pass's four priced as one
      message of their bytes (they go back to back)."""
    cp = lay.cp
    if cp == 1:
        return 0.0
    moved = cp_layer_transfers(lay, sh, attention)
    fwd = core_forwards(lay)
    if lay.cp_mode == "all_gather":
        gather = collective_time(hw, "all_gather", moved[("all_gather", "cp_kv")][1], cp,
                                 stride=lay.tp)
        scatter = collective_time(hw, "reduce_scatter", moved[("reduce_scatter", "cp_dkv")][1],
                                  cp, stride=lay.tp)
        return fwd * max(0.0, gather - attn_f / cp) + max(0.0, gather - attn_b / cp) + scatter
    if lay.cp_mode == "ulysses":
        forward = sum(b for (_, tag), (_, b) in moved.items() if not tag.endswith("_bwd"))
        backward = sum(b for (_, tag), (_, b) in moved.items() if tag.endswith("_bwd"))
        return (fwd * collective_time(hw, "all_to_all", forward, cp, stride=lay.tp)
                + collective_time(hw, "all_to_all", backward, cp, stride=lay.tp))
    step = collective_time(hw, "p2p", moved[("ring_shift", "cp_kv")][1], 2, stride=lay.tp)
    dkv_calls, dkv_bytes = moved[("ring_shift", "cp_dkv")]
    dkv = collective_time(hw, "p2p", dkv_bytes, 2, stride=lay.tp)
    return (fwd * (cp - 1) * max(0.0, step - attn_f / cp)
            + dkv_calls * max(0.0, step + dkv - attn_b / cp))


def moe_cp_layer_comm(model, lay: Layout, hw: "Hardware") -> float:
    """What an MoE layer adds to context parallel's transfers, per the model's average block,
    forward plus backward, as parallel/context.py runs it: the sequence-wise auxiliary loss
    all-reduces its per-sequence expert counts ([micro-batch, E] fp32) over cp, and a capacity
    factor all-gathers the choices (micro-batch x seq_len / cp x top_k int64 per rank), once per
    forward (twice under full recomputation, whose replay runs them again). Small and in the
    critical path: their latency, mostly."""
    if not model.num_experts or lay.cp == 1:
        return 0.0
    per_forward = 0.0
    if model.balance == "aux_loss" and model.aux_loss_coeff:
        per_forward += collective_time(hw, "all_reduce", lay.mbs * model.num_experts * 4, lay.cp,
                                       stride=lay.tp)
    if model.capacity_factor is not None:
        per_forward += collective_time(hw, "all_gather",
                                       lay.mbs * lay.seq_len * model.experts_top_k * 8, lay.cp,
                                       stride=lay.tp)
    return moe_share(model) * (2 if lay.recompute == "full" else 1) * per_forward


def seconds(step: Step) -> Seconds | None:
    """The transfers of each layer, half in each pass."""
    m, lay, hw = step.model, step.lay, step.hw
    if lay.cp == 1:
        return None
    comm = (cp_layer_comm(lay, hw, step.sh, step.attention, step.layer["attention_f"],
                          step.layer["attention_b"]) + moe_cp_layer_comm(m, lay, hw))
    return Seconds(layer=Pass({"cp_comm": comm / 2}, {"cp_comm": comm / 2}),
                   carried={"layer": Carried(comm=comm)})


TERM = Term("context", stage_bytes=stage_bytes, seconds=seconds)
