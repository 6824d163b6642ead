"""Activation bytes of one transformer layer, one micro-batch, on one rank: tensor by tensor.

Two conventions:

- `playbook`: the Ultra-Scale Playbook's (after Korthikanti et al. 2022) closed form,
  s*b*h*(34 + 5*a*s/h) bytes per layer in mixed precision, divided by tp where tensor/sequence
  parallel splits it. It describes a GPT block (GeLU MLP of 4h, dropout, eager attention), so it is
  the reference for the worked examples, not a description of a Llama block.
- `tensors`: the tensors a Llama block (RMSNorm, rotary, SDPA/flash attention, SwiGLU, residuals)
  leaves saved for backward, named one by one so that a measurement can be compared per part.
  Which tensors exist depends on the implementation; `Runtime` (estimator.py) carries the few
  choices that differ between ours and e.g. nanotron's.

Everything here is plain arithmetic on ints: the planner calls it for every layout it ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes an activation count needs (already divided by tp / cp / ep)."""

    b: int  # micro-batch size
    s: int  # tokens per sequence held by this rank (seq_len / cp)
    s_kv: int  # keys each query attends to at most (the full seq_len)
    h: int  # hidden size
    heads: int  # query heads on this rank (num_heads / tp)
    kv: int  # key/value width on this rank (num_kv_heads * head_dim / tp)
    head_dim: int
    f: int  # MLP width on this rank (ffn_hidden_size / tp)
    tp: int
    sp: bool  # sequence parallel: norms and residuals split over tp
    act: int  # bytes per activation element (compute dtype)
    # Mixture of experts: routed copies of each token (top_k) and experts on this rank (f is then
    # each expert's width).
    top_k: int = 0
    experts: int = 0
    shared_experts: int = 0
    shared_gate: bool = False  # the shared experts' output scaled by a per-token sigmoid gate
    vocab: int = 0  # vocabulary on this rank (vocab_size / tp)
    ep: int = 1  # expert-parallel ranks (the router scores all experts_on_rank x ep)
    # Key/value width the attention core keeps, when it differs from `kv` (Ulysses replicates kv
    # heads up to a multiple of cp; 0: kv).
    attn_kv: int = 0
    # The attention's output reaches the output projection as a copy (Ulysses sends it back to the
    # sequence split), whatever the implementation's rule.
    output_copy: bool = False


def playbook_layer(x: Shape, recompute: str) -> dict[str, int]:
    """Korthikanti's count. none: 34 s b h + 5 a s^2 b; selective drops the 5 a s^2 b (softmax,
    its dropout mask and attention-score inputs); full keeps only the layer input (2 s b h).
    With tp, everything inside the tensor-parallel regions divides by tp; the 10 s b h of the
    norms and residual dropouts too when sequence parallel is on, otherwise it stays whole."""
    sbh = x.s * x.b * x.h
    tp = x.tp
    if recompute == "full":
        return {"layer input": 2 * sbh // (tp if x.sp else 1)}
    split = 24 * sbh // tp  # attention projections, MLP, their inputs (inside the tp region)
    outside = 10 * sbh // (tp if x.sp else 1)  # two norms' inputs and two dropout masks
    out = {"linear and MLP inputs": split, "norms and dropout": outside}
    if recompute == "none":
        # 5 a s^2 b: softmax output (2), its dropout mask (1) and dropout output (2) per score.
        out["attention scores"] = 5 * x.heads * x.s * x.s_kv * x.b
    return out


@dataclass(frozen=True)
class TensorRules:
    """Implementation details that decide which tensors a Llama block saves."""

    norm_saves_normalized: bool  # RMSNorm keeps x/rms beside its output (unfused, as ours)
    norm_upcast: bool  # RMSNorm keeps an fp32 copy of a half-precision input (ours under autocast)
    rotary_saves_input: bool  # the rotary kernel keeps q, k before rotation
    attention: str  # "flash": output + logsumexp; "eager": also the a*s*s_kv probabilities
    attention_output_copy: bool  # the attention output is copied before the output projection
    swiglu_fused: bool  # silu(gate)*up as one kernel saving only gate and up
    sp_saves_gathered: bool  # sequence parallel keeps the all-gathered norm output (else the shard)
    # Selective recompute also reruns silu(gate) * up, keeping gate and up but not silu(gate).
    selective_swiglu: bool = False
    # Under sequence parallel the final norm's output is gathered whole before the output head,
    # which keeps that full copy (ours) rather than the shard.
    sp_head_gathered: bool = False
    # The rotary tables are made once per forward and shared by the layers (ours), not per layer.
    rotary_tables_shared: bool = False


def rotary_tables(x: Shape) -> int:
    """Bytes of the rotary cos and sin tables of one forward, in the compute dtype."""
    return 2 * x.s * x.head_dim * x.act


def tensors_layer(x: Shape, recompute: str, rules: TensorRules) -> dict[str, int]:
    """Bytes saved for backward by one Llama block, by part, for recompute none/selective/full.

    full: only the block input stays; the whole block is recomputed in backward (the estimator adds
    one layer's worth of `none` as a transient). selective: the attention core (SDPA) is
    recomputed, so its output and logsumexp (and eager probabilities) are not kept, and, if the
    rules say so, the SwiGLU product, so silu(gate) is not kept.
    """
    a = x.act
    tok = x.b * x.s
    res = tok * x.h // (x.tp if x.sp else 1)  # elements of a residual-stream tensor on this rank
    if recompute == "full":
        return {"layer input": res * a}
    # Norm: keeps its input (the residual) and, unfused, the normalized x; fp32 rms per token.
    # The linear after it keeps the norm output: the shard under sequence parallel unless the
    # implementation saves the gathered copy.
    gathered = tok * x.h if (x.sp and rules.sp_saves_gathered) or not x.sp else res
    norm = res * (4 if rules.norm_upcast and a < 4 else a) + tok * 4 // (x.tp if x.sp else 1)
    if rules.norm_saves_normalized:
        norm += res * a
    norm += gathered * a
    q, kv = tok * x.heads * x.head_dim, tok * x.kv
    out: dict[str, int] = {"attention norm": norm}
    # Rotary keeps cos/sin (s x head_dim each; counted per forward when the layers share them)
    # and, for some kernels, the unrotated q and k.
    rot = 0 if rules.rotary_tables_shared else rotary_tables(x)
    if rules.rotary_saves_input:
        rot += (q + kv) * a
    if rot:
        out["rotary"] = rot
    # SDPA's inputs q, k, v are kept by the attention (or, with selective recompute, by the
    # checkpoint that reruns it). Context parallel keeps this rank's share: its tokens (ring,
    # all-gather) or, for Ulysses, the whole sequence's for 1/cp of the heads, as many bytes.
    attn_kv = tok * x.attn_kv if x.attn_kv and recompute != "selective" else kv
    out["q, k, v"] = (q + 2 * attn_kv) * a
    if recompute == "none":
        core = q * a + x.b * x.heads * x.s * 4  # output and fp32 logsumexp
        if rules.attention == "eager":
            core += x.b * x.heads * x.s * x.s_kv * a  # softmax probabilities
        out["attention core"] = core
    # The output projection keeps its input; without recompute it is the attention output itself
    # unless the implementation copies it (a transpose that is not a view).
    if recompute != "none" or rules.attention_output_copy or x.output_copy:
        out["output projection input"] = q * a
    out["MLP norm"] = norm
    mlp_tok = tok * (x.top_k + x.shared_experts) if x.experts else tok
    ff = mlp_tok * x.f
    # gate and up outputs, silu(gate), and silu(gate)*up (the down projection's input); a fused
    # kernel, or selective recompute of the product, does without silu(gate).
    lean = rules.swiglu_fused or (recompute == "selective" and rules.selective_swiglu)
    out["MLP (SwiGLU)"] = ff * a * (3 if lean else 4)
    if x.experts:
        # As models/moe.py runs it: the router's probabilities over all experts (fp32, kept by
        # softmax or sigmoid), each routed row going into the experts (the norm output copied in
        # expert order, compute dtype) and coming out of them in fp32 (kept by the weighted
        # sum); per routed row three int64 indices (the chosen expert, the sorted order, the
        # token) and two fp32 weights (chosen, renormalised), and under expert parallel the
        # regrouping of received rows (int64; the rows received are taken as balanced). A z-loss
        # would add the logits (fp32) again. The router multiplies in fp32: in a lower precision
        # it keeps an fp32 copy of its input.
        routed = tok * x.top_k
        out["MoE routing"] = (tok * x.experts * x.ep * 4 + routed * x.h * (a + 4)
                              + routed * (3 * 8 + 2 * 4 + (8 if x.ep > 1 else 0))
                              + (tok * x.h * 4 if a != 4 else 0))
        if x.shared_experts and x.shared_gate:
            # sigmoid(gate . x) * shared: the product keeps the shared experts' output and the
            # gate (which the sigmoid keeps too), both in the compute dtype.
            out["shared expert gate"] = tok * (x.h + 1) * a
    return out


def deferred_weight_grad_layer(x: Shape) -> int:
    """Bytes one Llama block keeps for a deferred weight-gradient (W) pass after its input-gradient
    (I) pass, one micro-batch (zero-bubble pipeline): each linear's input and output gradient.

    Inputs: the attention norm output (one tensor shared by q, k and v), the attention output,
    the MLP norm output (shared by gate and up) and silu(gate)*up; output gradients: q, k, v, the
    attention output projection, gate, up and down. Under sequence parallel the inputs are the
    gathered ones."""
    tok = x.b * x.s
    q, kv = tok * x.heads * x.head_dim, tok * x.kv
    # Of an MoE layer only the shared experts are linears (the routed experts' stacked weights
    # get their gradients in the I pass).
    mlp_tok = tok * x.shared_experts if x.experts else tok
    ff = mlp_tok * x.f
    inputs = tok * x.h + q + tok * x.h + ff
    grads = q + 2 * kv + tok * x.h + 2 * ff + mlp_tok * x.h
    return (inputs + grads) * x.act
