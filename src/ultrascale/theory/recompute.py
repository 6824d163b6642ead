"""Activation recomputation (parallel/recompute.py): what a rebuilt layer keeps and costs.

none keeps every saved tensor; selective reruns the attention core (and, where the
implementation says so, the SwiGLU product) in backward (`block.py` and `attention.py` leave
those tensors out); full keeps only each layer's input and rebuilds one layer at a time in
backward. Bytes: the layer input under full, the layer being rebuilt (a transient), and the
positions or rotary tables a stage's checkpoints keep. Seconds: the forward work the backward
repeats. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.theory.attention import rotary_tables
from ultrascale.theory.shape import Shape
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term


@dataclass(frozen=True)
class Policy:
    """What a `training.recompute` policy rebuilds in backward, as the block's count asks it: a
    new policy is one entry of `POLICIES` (and its attention's hooks, where it reaches inside the
    attention: theory/mla.py for `norms_and_mla_up`), not a branch in `block.py`."""

    whole_layer: bool = False  # only each layer's input is kept (full)
    attention_core: bool = False  # the attention core reruns (selective)
    norm_outputs: bool = False  # each RMSNorm's output is rebuilt from its input


POLICIES = {
    "none": Policy(),
    "selective": Policy(attention_core=True),
    "full": Policy(whole_layer=True),
    # DeepSeek-V3's (parallel/recipes.py): the RMSNorms' and MLA's up-projections' outputs.
    "norms_and_mla_up": Policy(norm_outputs=True),
}


def norm_input_only(x: Shape, sp_saves_gathered: bool) -> int:
    """A norm whose output is rebuilt in backward keeps its input only (the residual stream's
    shard), and the linear after it the copy sequence parallel gathers where it saves it."""
    tok_h = x.b * x.s * x.h
    return (tok_h // x.sp_div + (tok_h if x.sp and sp_saves_gathered else 0)) * x.act


def full_layer_saved(x: Shape) -> dict[str, int]:
    """Under full recomputation a layer keeps only its input (the residual stream's shard)."""
    res = x.b * x.s * x.h // (x.tp if x.sp else 1)
    return {"layer input": res * x.act}


def stage_bytes(stage: Stage) -> Bytes | None:
    """Under full recomputation, the layer backward rebuilds (one at a time) and, per chunk's
    forward, the positions its checkpoints keep; otherwise the rotary tables shared by the
    layers (and the positions the checkpointed attention cores keep)."""
    lay, impl, shape = stage.layout, stage.impl, stage.shape
    v = lay.pp_virtual_stages
    shared_rope = impl.rules.rotary_tables_shared and stage.layers and impl.activations == "tensors"
    if lay.recompute != "full" and not shared_rope:
        return None
    out = Bytes()
    if lay.recompute == "full" and stage.layers and impl.count_extras:
        rebuilt = max((stage.kinds[k].full for k in stage.present), default=0)
        out.transient["recomputed layer"] = rebuilt
        if shared_rope:  # the layers' checkpoints keep only their hidden states; a rebuilt
            out.transient["recomputed layer"] += rotary_tables(shape)  # layer saves the tables
        else:
            # The checkpoint of each layer keeps its inputs: the hidden states (counted per
            # layer) and the positions, one int64 tensor shared by the layers of a chunk.
            out.chunk["positions"] = shape.s * 8 * v  # one per chunk's forward
    elif shared_rope:  # one pair of tables per chunk's forward, saved by every layer's rotary
        out.chunk["rotary tables"] = rotary_tables(shape) * v
        if lay.recompute == "selective":  # the checkpointed attention cores keep the positions
            out.chunk["positions"] = shape.s * 8 * v
    return out


def rebuild_time(mode: str, forward_gemms: float, attention_f: float,
                 elementwise_f: float) -> float:
    """What the backward of one layer repeats of its forward: all of it (full), the attention
    core (selective), nothing."""
    if mode == "full":
        return forward_gemms + attention_f + elementwise_f
    if mode == "selective":
        return attention_f
    return 0.0


def seconds(step: Step) -> Seconds | None:
    rebuilt = step.layer["recompute"]
    if step.lay.recompute == "none":
        return None
    return Seconds(layer=Pass(backward={"recompute": rebuilt}),
                   carried={"layer": Carried(backward=rebuilt)})


TERM = Term("recompute", stage_bytes=stage_bytes, seconds=seconds)
