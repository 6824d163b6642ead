"""The optimizer (optim/, docs/muon.md): its state per parameter and its update.

Bytes per parameter: Adam's m and v (8, fp32); Muon keeps one momentum buffer for the matrices it
steps (4 fewer per element; AdamW steps the rest). Seconds, after the last micro-batch: the
update's memory traffic over the rank's shard, and Muon's Newton-Schulz on the busiest stage's
matrices with the all-to-alls that gather and scatter them. (ZeRO's sharding: `data.py`.)
Torch-free.
"""

from __future__ import annotations

from ultrascale.params import NS_STEPS, layer_matrix_shapes, stage_matrix_params
from ultrascale.theory.rates import (
    cast_time, collective_time, gemm_time, measured_piecewise, memory_time,
)
from ultrascale.theory.term import ParamBytes, Stage, Step, Term

ADAM_STATE_BYTES = 8  # m and v, fp32
MUON_SAVES_PER_MATRIX_ELEMENT = 4  # one fp32 momentum buffer where Adam holds two
# Fused Adam: read fp32 param, grad, m, v (16); write param, m, v (12); write bf16 copy (2). The
# default of `Hardware.optimizer_bytes_per_param`.
ADAM_BYTES_PER_PARAM = 30


def param_bytes(stage: Stage) -> ParamBytes:
    muon = stage.layout.optimizer == "muon"
    return ParamBytes(optimizer=ADAM_STATE_BYTES,
                      matrix_optimizer=-MUON_SAVES_PER_MATRIX_ELEMENT if muon else 0)


def update_time(step: Step) -> float:
    """The optimizer update: its memory traffic over the rank's shard of the parameters; in a
    low-precision run, the fp32 master weights' cast into the module's copies (`rates.cast_time`;
    the gradients' into their fp32 accumulators is `data.grad_accum_time`)."""
    lay = step.lay
    shard = (lay.dp_shard or lay.dp) * lay.cp if lay.zero >= 1 else 1
    return (memory_time(step.hw, step.params / shard * step.hw.optimizer_bytes_per_param)
            + cast_time(step.hw, step.params / shard, step.sh.store, ways=1))


def muon_time(step: Step) -> float:
    """Muon (optim/muon.py): Newton-Schulz on the busiest stage's matrices, in fp32, dealt over
    the ranks that share them (ZeRO's shard group, or without ZeRO the data-parallel replicas, x
    tp), and the all-to-alls that gather each matrix and scatter it back
    (parallel/muon_exchange.py: a rank's share of its matrices, there and back; without ZeRO
    only back, to every replica)."""
    lay, hw, model = step.lay, step.hw, step.model
    if lay.optimizer != "muon":
        return 0.0
    shard = ((lay.dp_shard or lay.dp) if lay.zero >= 1 else lay.dp) * lay.cp
    dense = model.num_layers if not model.num_experts else min(model.first_k_dense,
                                                                model.num_layers)
    total = 0.0
    for moe, share in ((False, dense / model.num_layers), (True, 1 - dense / model.num_layers)):
        if share <= 0 or (moe and not model.num_experts):
            continue
        for count, rows, cols in layer_matrix_shapes(model, moe):
            a, b = min(rows, cols), max(rows, cols)
            one = sum(gemm_time(hw, *dims, "fp32") for dims in ((a, a, b), (a, a, a), (a, b, a)))
            total += share * count * NS_STEPS * one
    compute = total * step.layers / (shard * lay.tp)
    local = stage_matrix_params(model, lay, step.layers, 0)
    elements = local[0] / shard + local[1] / max(shard // lay.ep, 1)
    if lay.zero >= 1:
        comm = 2 * collective_time(hw, "all_to_all", 4 * elements, shard, lay.tp)
    else:  # each replica's results to all the others: an all-gather's traffic
        comm = collective_time(hw, "all_gather", 4 * elements * shard, shard, lay.tp)
    comm += 2 * collective_time(hw, "all_to_all", 4 * elements, lay.tp)
    return compute + comm


def step_sync_time(step: Step) -> float:
    """The step's two all-reduces over every rank (parallel/runtime.py): the gradient norm's
    squared sum before the clip, and the summed loss. A few bytes each: their latencies (and on a
    CPU each one's wait for the other ranks' time slices), counted on CPU profiles, which
    `ultrascale calibrate` measures collective by collective; the GPU profiles' constants were
    fitted on whole steps of runs that make the same two all-reduces, so they hold them already."""
    world = step.lay.world_size
    if world == 1 or not measured_piecewise(step.hw):
        return 0.0
    return 2 * collective_time(step.hw, "all_reduce", 16, world)


def after_step(step: Step, backward_matmul: float) -> dict[str, float]:
    return {"optimizer": update_time(step) + muon_time(step), "step_sync": step_sync_time(step)}


TERM = Term("optimizer", param_bytes=param_bytes, after_step=after_step)
