"""Mixed precision (parallel/precision.py, docs/precision.md): the bytes of each kind of tensor.

Bytes per parameter: the parameters in the storage dtype (bf16 under fp8), the gradients in the
accumulation dtype (plus a parameter-dtype `.grad` beside an fp32 buffer where the implementation
keeps both), and an fp32 master copy when the compute dtype is narrower; under ZeRO-3 with an
implementation whose shard is the master copy (ours), the parameters are that shard. Seconds:
what FP8 adds to a block's elementwise work, quantising its matmuls' inputs (`block.py` asks).
(The optimizer's state: `optimizer.py`.) Torch-free.
"""

from __future__ import annotations

from ultrascale.layout import DTYPE_BYTES, storage_bytes
from ultrascale.theory.term import ParamBytes, Stage, Term


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


TERM = Term("precision", param_bytes=param_bytes)
