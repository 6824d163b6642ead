"""Mixed precision (parallel/precision.py, docs/precision.md): the bytes of each kind of tensor.

Bytes per parameter: the parameters in the storage dtype (bf16 under fp8), the gradients in the
accumulation dtype (plus a parameter-dtype `.grad` beside an fp32 buffer where the implementation
keeps both), and an fp32 master copy when the compute dtype is narrower; under ZeRO-3 with an
implementation whose shard is the master copy (ours), the parameters are that shard. Seconds:
what FP8 adds to a block's elementwise work, quantising its matmuls' inputs (`block.py` asks).
Saved bytes: what keeping those quantised inputs, and the SwiGLUs' gate and up, for backward
saves (`cache_parts`, `block.py` asks).
(The optimizer's state: `optimizer.py`.) Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.layout import DTYPE_BYTES, storage_bytes
from ultrascale.theory.expert import mlp_rows
from ultrascale.theory.implementation import TensorRules
from ultrascale.theory.recompute import POLICIES
from ultrascale.theory.shape import Shape
from ultrascale.theory.term import ParamBytes, Stage, Term

if TYPE_CHECKING:
    from ultrascale.theory.attention import Attention


def param_bytes(stage: Stage) -> ParamBytes:
    lay, impl = stage.layout, stage.impl
    p_b = storage_bytes(lay.dtype)  # fp8 keeps its parameters in bf16
    acc_b = DTYPE_BYTES[lay.grad_accum_dtype]
    master_b = DTYPE_BYTES[lay.master_dtype] if lay.master_dtype != lay.dtype else 0
    reduced = lay.dp * lay.cp > 1  # gradients are summed over dp x cp
    # Gradients: one buffer in the accumulation dtype, plus a parameter-dtype .grad beside it when
    # the two differ and the implementation keeps both.
    half = 0
    if acc_b != p_b and (impl.half_grads == "always" or (impl.half_grads == "dp" and reduced)
                         or (impl.half_grads == "dp_zero0" and reduced and lay.zero == 0)):
        half = p_b
    if lay.zero >= 3 and impl.zero3_shard_is_master:
        # ZeRO-3's fp32 shard is the parameters' storage and the master copy at once.
        return ParamBytes(params=DTYPE_BYTES[lay.master_dtype], grads=acc_b + half)
    return ParamBytes(params=p_b, grads=acc_b + half, optimizer=master_b)


def quantisation_bytes(act_bytes: int, tokens: float, width: float) -> float:
    """Memory traffic of quantising a block's matmul inputs to FP8 (models/ops.py), forward: a pass
    for the scales and one for the 8-bit copy, reading the bf16 input twice and writing one byte,
    of `width` elements per token (the two norm outputs, whole sequences under sequence parallel,
    the attention output, the SwiGLU product); the backward quantises the gradients and
    transposed copies, about twice that (elementwise_b). The weights, a small share at these
    token counts, are left out."""
    return (2 * act_bytes + 1) * tokens * width


# An input an FP8 linear keeps under `precision.fp8_cache_activations`: 1 byte an element (e4m3)
# and one fp32 scale per 1 x 128 tile (block-wise, DeepSeek-V3's, the finest of the recipes:
# row-wise keeps one scale per row, tensor-wise one per tensor).
CACHED_BYTES = 1 + 4 / 128


def _linear_inputs(x: Shape, recompute: str, attention: "Attention",
                   rules: TensorRules) -> tuple[int, int]:
    """(kept by linears alone, kept anyway by another op), elements: the inputs of one layer's
    FP8 linears that parallel/fp8.py keeps as 8-bit copies, one per tensor however many linears
    read it. The attention's (`Attention.fp8_inputs`); the MLP's (or shared experts') norm
    output, unless tensor parallel's column matmul (which keeps its own bf16 input) or a
    recomputation policy (a recipe: nothing kept) takes it, kept anyway in an MoE layer (by the
    router); its SwiGLU product, unless that policy keeps it as its recipe too (parallel/
    recipes.py: rebuilt from the cached SwiGLU's 8-bit gate and up)."""
    norm_rebuilt = POLICIES[recompute].norm_outputs
    own, anyway = attention.fp8_inputs(x, recompute, rules, norm_rebuilt)
    tok = x.b * x.s
    mlp_tok = tok * x.shared_experts if x.experts else tok
    if mlp_tok:
        norm_out = 0 if x.tp > 1 or norm_rebuilt else tok * x.h
        if x.experts:  # the router keeps the norm output as it came (`ops.linear_fp32`)
            anyway += norm_out
        else:
            own += norm_out
        own += 0 if norm_rebuilt else mlp_tok * x.f
    return own, anyway


def _caching(x: Shape, recompute: str) -> bool:
    lay = x.layout
    return (x.dtype == "fp8" and lay is not None and lay.fp8_cache
            and not POLICIES[recompute].whole_layer)


def cache_parts(x: Shape, recompute: str, attention: "Attention", rules: TensorRules,
                swiglu_own: int = 0) -> dict[str, int]:
    """What `precision.fp8_cache_activations` changes in one layer's saved bytes (a negative
    part: bytes saved), as parallel/fp8.py keeps them: each input of its FP8 linears
    (`_linear_inputs`) in CACHED_BYTES instead of the compute dtype where linears alone kept it,
    and CACHED_BYTES more where another op keeps it anyway; under `precision.fp8_experts` the
    routed experts' rows and SwiGLU product too; and every SwiGLU (dense, shared and routed
    experts) keeping its gate and up in CACHED_BYTES in place of the `swiglu_own` tensors of
    rows x ffn its plain activation keeps in the compute dtype (`block.swiglu_kept` less the
    product: gate, up and silu(gate), or without silu(gate) under selective recomputation).
    Full recomputation keeps none."""
    if not _caching(x, recompute):
        return {}
    own, anyway = _linear_inputs(x, recompute, attention, rules)
    # DeepSeek-V3's policy keeps each SwiGLU's product as its recipe (parallel/recipes.py): the
    # down projections keep nothing of it, neither an 8-bit copy nor the routed experts' bf16 rows.
    product_rebuilt = POLICIES[recompute].norm_outputs
    if x.experts and x.layout.fp8_experts:
        own += x.b * x.s * x.top_k * (x.h + (0 if product_rebuilt else x.f))
    swiglu = mlp_rows(x) * x.f * (swiglu_own * x.act - 2 * CACHED_BYTES) if swiglu_own else 0
    if swiglu_own and product_rebuilt:
        swiglu += mlp_rows(x) * x.f * x.act
    saved = own * (x.act - CACHED_BYTES) - anyway * CACHED_BYTES + swiglu
    return {"FP8 input cache": -round(saved)} if saved else {}


def deferred_cache_saving(x: Shape, recompute: str, attention: "Attention",
                          rules: TensorRules) -> float:
    """Bytes the cache saves of what one layer keeps for a deferred weight-gradient pass (zero
    bubble, DualPipeV: `block.deferred_weight_grad_layer` counts its linears' inputs in the
    compute dtype): the same inputs, each in CACHED_BYTES (after the I pass nothing else keeps
    them)."""
    if not _caching(x, recompute):
        return 0.0
    # (An input kept as its recipe is rebuilt in the I pass in the compute dtype and held so
    # until W: `_linear_inputs` leaves it out, no saving on it.)
    return sum(_linear_inputs(x, recompute, attention, rules)) * (x.act - CACHED_BYTES)


TERM = Term("precision", param_bytes=param_bytes)
