"""The transformer block: what its layers save for backward and what one of them costs.

A block is a norm, the model's attention (`attention.py`, or the theory `terms.ATTENTIONS`
picks for the model), a norm and the feed-forward: a SwiGLU MLP, or in an MoE layer the routed
and shared experts (`expert.py`). Two conventions for the saved bytes:

- `tensors`: the tensors a Llama block (RMSNorm, rotary, SDPA/flash attention, SwiGLU, residuals)
  leaves saved for backward, named one by one so that a measurement can be compared per part;
  which exist depends on the implementation (`implementation.TensorRules`);
- `playbook`: the Ultra-Scale Playbook's (after Korthikanti et al. 2022) closed form,
  s*b*h*(34 + 5*a*s/h) bytes per layer in mixed precision, divided by tp where tensor/sequence
  parallel splits it. It describes a GPT block (GeLU MLP of 4h, dropout, eager attention), so it
  is the reference for the worked examples, not a description of a Llama block.

The term: a stage's layers' saved bytes per micro-batch (and what a deferred weight-gradient pass
keeps of them); per layer its GEMMs, attention and elementwise work, and the host's work.
Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.layout import DTYPE_BYTES, Layout
from ultrascale.theory import expert, precision, recompute
from ultrascale.theory.implementation import Implementation, TensorRules
from ultrascale.theory.rates import block_working_set, gemm_time, memory_time
from ultrascale.theory.shape import ModelShape, Shape
from ultrascale.theory.term import Bytes, Carried, LayerKind, Pass, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware
    from ultrascale.theory.attention import Attention


# ------------------------------------------------------------------------------------------------
# Bytes


def playbook_layer(x: Shape, recompute_mode: str) -> dict[str, int]:
    """Korthikanti's count. none: 34 s b h + 5 a s^2 b; selective drops the 5 a s^2 b (softmax,
    its dropout mask and attention-score inputs); full keeps only the layer input (2 s b h).
    With tp, everything inside the tensor-parallel regions divides by tp; the 10 s b h of the
    norms and residual dropouts too when sequence parallel is on, otherwise it stays whole."""
    sbh = x.s * x.b * x.h
    tp = x.tp
    if recompute_mode == "full":
        return {"layer input": 2 * sbh // (tp if x.sp else 1)}
    split = 24 * sbh // tp  # attention projections, MLP, their inputs (inside the tp region)
    outside = 10 * sbh // (tp if x.sp else 1)  # two norms' inputs and two dropout masks
    out = {"linear and MLP inputs": split, "norms and dropout": outside}
    if recompute_mode == "none":
        # 5 a s^2 b: softmax output (2), its dropout mask (1) and dropout output (2) per score.
        out["attention scores"] = 5 * x.heads * x.s * x.s_kv * x.b
    return out


def norm_bytes(x: Shape, rules: TensorRules, output_kept: bool = True) -> int:
    """What one RMSNorm and the linear after it keep: its input (the residual), unfused the
    normalized x, an fp32 rms per token; the linear keeps the norm output (the shard under
    sequence parallel unless the implementation saves the gathered copy) when `output_kept`."""
    a = x.act
    tok = x.b * x.s
    res = tok * x.h // (x.tp if x.sp else 1)  # elements of a residual-stream tensor on this rank
    gathered = tok * x.h if (x.sp and rules.sp_saves_gathered) or not x.sp else res
    norm = res * (4 if rules.norm_upcast and a < 4 else a) + tok * 4 // (x.tp if x.sp else 1)
    if rules.norm_saves_normalized:
        norm += res * a
    return norm + (gathered * a if output_kept else 0)


def tensors_layer(x: Shape, recompute_mode: str, rules: TensorRules,
                  attention: "Attention") -> dict[str, int]:
    """Bytes saved for backward by one Llama block, by part, under a recompute policy
    (`recompute.POLICIES`): whole layer (full), only the block input stays; attention core
    (selective), the core is recomputed (`attention.py` leaves it out) and, if the rules say
    so, the SwiGLU product, so silu(gate) is not kept; norm outputs, each norm keeps its input
    only."""
    policy = recompute.POLICIES[recompute_mode]
    if policy.whole_layer:
        return recompute.full_layer_saved(x)
    norm = recompute.norm_input_only(x, rules.sp_saves_gathered) if policy.norm_outputs \
        else norm_bytes(x, rules)
    out: dict[str, int] = {"attention norm": norm}
    out.update(attention.saved(x, recompute_mode, rules))
    # Kept by the MLP's linears, or in an MoE layer by the router (its fp32 matmul keeps the norm
    # output as it came, `ops.linear_fp32`), whose dispatch keeps only the rows' indices.
    out["MLP norm"] = norm
    # In an MoE layer the routing weight is applied in the SwiGLU too, and kept
    # (`expert.routing_saved`).
    kept = swiglu_kept(policy, rules)
    out["MLP (SwiGLU)"] = expert.mlp_rows(x) * x.f * x.act * kept
    out.update(expert.routing_saved(x))
    # The activation's own tensors (all but the product, the down projection's input) are what
    # FP8's cached SwiGLU replaces.
    out.update(precision.cache_parts(x, recompute_mode, attention, rules, swiglu_own=kept - 1))
    return out


def swiglu_kept(policy: recompute.Policy, rules: TensorRules) -> int:
    """Tensors of rows x ffn a SwiGLU MLP keeps in the compute dtype: gate and up outputs,
    silu(gate), and silu(gate)*up (the down projection's input); a fused kernel (ours:
    `ops.swiglu`, one autograd function), or selective recompute of the product, does without
    silu(gate)."""
    lean = rules.swiglu_fused or (policy.attention_core and rules.selective_swiglu)
    return 3 if lean else 4


def layer_parts(shape: Shape, recompute_mode: str, impl: Implementation,
                attention: "Attention") -> dict[str, int]:
    if impl.activations == "playbook":
        return playbook_layer(shape, recompute_mode)
    return tensors_layer(shape, recompute_mode, impl.rules, attention)


def layer_kinds(m: ModelShape, lay: Layout, impl: Implementation,
                attention: "Attention") -> dict[str, LayerKind]:
    """The model's kinds of layer (dense; and MoE for a mixture of experts) under the layout."""
    kinds = {}
    for kind in ("dense", "moe") if m.num_experts else ("dense",):
        shape = Shape.of(m, lay, moe=kind == "moe")
        parts = layer_parts(shape, lay.recompute, impl, attention)
        whole = parts if lay.recompute == "none" else layer_parts(shape, "none", impl, attention)
        kinds[kind] = LayerKind(shape, parts, sum(whole.values()), whole)
    return kinds


def deferred_weight_grad_layer(x: Shape, attention: "Attention") -> int:
    """Bytes one Llama block keeps for a deferred weight-gradient (W) pass after its input-gradient
    (I) pass, one micro-batch (zero-bubble pipeline): each linear's input and output gradient.

    Inputs: the attention's (`Attention.deferred`), the MLP norm output (shared by gate and up)
    and silu(gate)*up; output gradients: the attention's, gate, up and down. Under sequence
    parallel the inputs are the gathered ones. Of an MoE layer only the shared experts are
    linears (the routed experts' stacked weights get their gradients in the I pass)."""
    tok = x.b * x.s
    attn_in, attn_grads = attention.deferred(x)
    mlp_tok = tok * x.shared_experts if x.experts else tok
    ff = mlp_tok * x.f
    inputs = attn_in + tok * x.h + ff
    grads = attn_grads + 2 * ff + mlp_tok * x.h
    return (inputs + grads) * x.act


# Elements of the fp32 products the SwiGLU's backward sums a chunk at a time for the routing
# weight's gradient (models/swiglu.py ROW_DOT_CHUNK; tests/test_estimator.py checks they agree).
ROW_DOT_CHUNK = 1 << 22


def swiglu_backward_workspace(x: Shape) -> int:
    """Bytes ours' SwiGLU backward makes beside what the layer saved (models/swiglu.py): the
    incoming gradient, silu(gate) rebuilt and one more row-wide tensor in the compute dtype; in
    an MoE layer, for the routing weight's gradient, fp32 copies of two operands and their
    product, a chunk of rows at a time. A stage without the loss peaks in a layer's backward,
    every held activation beside it; it matters for small models."""
    width = expert.mlp_rows(x) * x.f
    out = 3 * width * x.act
    if x.experts:
        out += (3 if x.act < 4 else 1) * min(width, ROW_DOT_CHUNK) * 4
    return out


def stage_bytes(stage: Stage) -> Bytes:
    """The stage's layers' saved bytes for one micro-batch, what a deferred weight-gradient pass
    keeps of them, and the workspace of ours' layer backward (its SwiGLU's or norm's)."""
    layers: dict[str, float] = {}
    for k in stage.present:
        for part, v in stage.kinds[k].parts.items():
            layers[part] = layers.get(part, 0) + v * stage.count[k]
    deferred = 0
    if (stage.schedule.defers_weight_gradients and stage.layout.pp > 1
            and stage.impl.activations == "tensors"):
        mode, rules = stage.layout.recompute, stage.impl.rules
        deferred = sum((deferred_weight_grad_layer(stage.kinds[k].shape, stage.attention)
                        - precision.deferred_cache_saving(stage.kinds[k].shape, mode,
                                                          stage.attention, rules))
                       * stage.count[k] for k in stage.present)
    out = Bytes(layers=layers, deferred=deferred)
    # On the stage with the loss, a layer's backward comes after the loss's tensors are freed:
    # the fold counts the larger of the two (`_meeting_transients`).
    if stage.impl.activations == "tensors" and stage.impl.rules.swiglu_fused and stage.present:
        out.transient["layer backward workspace"] = max(
            max(swiglu_backward_workspace(stage.kinds[k].shape),
                norm_backward_workspace(stage.kinds[k].shape),
                attention_backward_workspace(stage.kinds[k], stage.attention))
            for k in stage.present)
    return out


def attention_backward_workspace(kind: LayerKind, attention: "Attention") -> int:
    """The attention's backward workspace (`Attention.backward_workspace`) net of what the
    layer's MLP saved: the attention's backward runs after the MLP's, whose tensors are gone."""
    mlp = sum(v for part, v in kind.whole.items() if part.startswith("MLP"))
    return max(0, attention.backward_workspace(kind.shape) - mlp)


def norm_backward_workspace(x: Shape) -> int:
    """Bytes the backward of ours' RMSNorm (`ops.rms_norm`, an fp32 composition autograd
    differentiates) holds at once: five fp32 tensors of the rank's residual stream (the input's
    gradient through the scale, and through the mean square: its expanded gradient, x, 2x and
    their product), not split over tp without sequence parallel."""
    return 5 * 4 * x.b * x.s * x.h // (x.tp if x.sp else 1)


# ------------------------------------------------------------------------------------------------
# Seconds


def block_times(m: ModelShape, lay: Layout, hw: "Hardware", sh: Shape,
                attention: "Attention") -> dict[str, float]:
    """Forward and backward time of one transformer block for one micro-batch, by part:
    matmul_f/_b, attention_f/_b, elementwise_f/_b and recompute (seconds). For a mixture of
    experts whose first `first_k_dense` layers are dense, the model's average block."""
    if not m.num_experts:
        return _block_times(m, lay, hw, sh, attention, moe=False)
    moe = _block_times(m, lay, hw, sh, attention, moe=True)
    dense = min(m.first_k_dense, m.num_layers)
    if not dense:
        return moe
    plain = _block_times(m, lay, hw, sh, attention, moe=False)
    w = dense / m.num_layers
    return {k: w * plain[k] + (1 - w) * moe[k] for k in moe}


def _block_times(m: ModelShape, lay: Layout, hw: "Hardware", sh: Shape, attention: "Attention",
                 moe: bool) -> dict[str, float]:
    T, h, tp, dt = sh.tokens, sh.h, sh.tp, sh.dtype
    fwd_mm = attention.forward_gemms(hw, sh)
    if moe:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        for gemms in expert.moe_gemms(m, lay, hw, sh):
            fwd_mm += gemms
        act_f = m.experts_top_k + m.shared_experts
    else:
        f = m.ffn_hidden_size
        fwd_mm += gemm_time(hw, T, 2 * f / tp, h, dt) + gemm_time(hw, T, h, f / tp, dt)
        act_f = 1
    attn_f = attention.core_time(hw, sh)
    b = DTYPE_BYTES[sh.store]
    elem_bytes = b * T * (10 * h / sh.sp_div + attention.elementwise_width(sh)
                          + 3 * act_f * f / tp)
    if dt == "fp8":
        # FP8 routed experts also quantise their dispatched rows (top_k copies of each token).
        rows = m.experts_top_k * h if moe and lay.fp8_experts else 0
        # The cache's SwiGLUs also quantise their gate and up for backward.
        swiglu = 2 * act_f * f / tp if lay.fp8_cache else 0
        elem_bytes += precision.quantisation_bytes(
            b, T, 2 * h + attention.quantised_width(sh) + act_f * f / tp + rows + swiglu)
    elem_f = memory_time(hw, elem_bytes, block_working_set(T, h, f, b, tp, sh.sp_div),
                         sh.store)
    out = {"matmul_f": fwd_mm, "matmul_b": 2 * fwd_mm, "attention_f": attn_f,
           "attention_b": attention.core_backward_time(hw, sh), "elementwise_f": elem_f, "elementwise_b": 2 * elem_f}
    out["recompute"] = recompute.rebuild_time(lay.recompute, fwd_mm, attn_f, elem_f)
    return out


def column_gemms(m: ModelShape, hw: "Hardware", sh: Shape,
                 attention: "Attention") -> tuple[float, float]:
    """The block's column-parallel GEMMs (the attention's input projection, gate/up): a
    tensor-parallel collective beside one may hide under it (`tensor.py`)."""
    return (attention.column_gemm(hw, sh),
            gemm_time(hw, sh.tokens, 2 * m.ffn_hidden_size / sh.tp, sh.h, sh.dtype))


def seconds(step: Step) -> Seconds:
    """Per layer: its GEMMs, attention and elementwise work (the recomputation is
    `recompute.py`'s), and the host's work per layer for a block in the storage dtype (a wait,
    half in each pass)."""
    layer, overhead = step.layer, step.hw.layer_overhead(step.sh.store)
    return Seconds(
        layer=Pass(forward={"matmul": layer["matmul_f"], "attention": layer["attention_f"],
                            "elementwise": layer["elementwise_f"]},
                   backward={"matmul": layer["matmul_b"], "attention": layer["attention_b"],
                             "elementwise": layer["elementwise_b"]},
                   waits={"overhead": overhead / 2}),
        carried={"layer": Carried(
            forward=layer["matmul_f"] + layer["attention_f"] + layer["elementwise_f"],
            backward=layer["matmul_b"] + layer["attention_b"] + layer["elementwise_b"],
            waits=overhead)})


TERM = Term("block", stage_bytes=stage_bytes, seconds=seconds)
