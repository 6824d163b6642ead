"""Tensor parallelism, with or without sequence parallelism (parallel/tensor.py): its buffers and
its collectives.

Bytes: the all-gathered input of a column-parallel linear under sequence parallel, and the
buffers an implementation keeps for it from step to step. Seconds: per block and on the ends,
the collectives that show beside the GEMMs they may hide under; their transfers are device time,
their latencies waits. (What tp divides, the weights and the activations, the shapes already
say: `shape.Shape`, `params.py`.) Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.layout import DTYPE_BYTES, Layout
from ultrascale.theory.block import column_gemms
from ultrascale.theory.rates import hidden_share, tp_collective_parts
from ultrascale.theory.shape import Shape
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware

PERSISTENT = "persistent all-gather buffers"


def stage_bytes(stage: Stage) -> Bytes | None:
    x = stage.shape
    if not x.sp:
        return None
    gathered = x.b * x.s * x.h * x.act
    out = Bytes(comm={"sequence-parallel all-gather": gathered})  # gathered input of a linear
    if stage.impl.sp_gather_buffers:
        # Kept from step to step: held in the optimizer step too.
        out.comm[PERSISTENT] = out.step_comm[PERSISTENT] = stage.impl.sp_gather_buffers * gathered
    return out


def tp_kinds(lay: Layout, hw: "Hardware", sh: Shape) -> list[tuple[float, float]]:
    """(wait, transfer) of one tp collective of the micro-batch's activations, for each kind a
    block runs: [all-gather, reduce-scatter] with sequence parallel, [all-reduce] without."""
    act = sh.tokens * sh.h * DTYPE_BYTES[sh.store]
    kinds = ("all_gather", "reduce_scatter") if lay.sequence_parallel else ("all_reduce",)
    return [tp_collective_parts(hw, kind, act, lay.tp) for kind in kinds]


def block_collectives(lay: Layout, hw: "Hardware", columns: tuple[float, float],
                      parts: list[tuple[float, float]]) -> tuple[float, ...]:
    """How many tp collectives of one block show, forward plus backward: (all-gathers,
    reduce-scatters) with sequence parallel, (all-reduces,) without; fractions where a GEMM
    hides part of one. `columns`: the block's column-parallel GEMMs; `parts`: `tp_kinds`.

    With sequence parallel, forward: an all-gather into each of the two column-parallel linears
    (qkv, gate/up) and a reduce-scatter out of each row-parallel one (output, down). Backward: an
    all-gather of each row-parallel output's gradient; and in each column-parallel linear, which
    keeps only its sharded input, an all-gather of that input again beside the input-gradient
    GEMM, then the reduce-scatter of the input gradient beside the weight-gradient GEMM
    (parallel/tensor_layers.py `_ColumnParallel`; nanotron's asynchronous column linear with its
    default `tp_recompute_allgather` runs the same). Without sequence parallel: an all-reduce out
    of each row-parallel linear forward, and one of each column-parallel input gradient backward,
    beside the weight-gradient GEMM. A collective beside a GEMM shows as far as it outlasts it
    (`hidden_share`): a block shows 6 to 10 collectives (2 to 4 without sequence parallel). The
    column-parallel linears' backward GEMMs each cost what their forward GEMM does."""
    if not lay.sequence_parallel:
        return (2 + sum(1 - hidden_share(parts[0], g, hw) for g in columns),)
    gather, scatter = parts
    return (4 + sum(1 - hidden_share(gather, g, hw) for g in columns),
            2 + sum(1 - hidden_share(scatter, g, hw) for g in columns))


def layer_comm(lay: Layout, hw: "Hardware", columns: tuple[float, float],
               parts: list[tuple[float, float]]) -> tuple[float, float]:
    """(wait, transfer) of the tp collectives of one block that show, forward plus backward.
    Every ring step waits `Hardware.tp_step_wait_s` on a cluster that has such a wait
    (`rates.tp_collective_parts`)."""
    if lay.tp == 1:
        return 0.0, 0.0
    counts = block_collectives(lay, hw, columns, parts)
    return tuple(sum(c * p[i] for c, p in zip(counts, parts)) for i in (0, 1))


def ends_comm(lay: Layout, hw: "Hardware", sh: Shape, parts: list[tuple[float, float]],
              head_f: float, loss_all_reduces: int
              ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(wait, transfer) of the tp collectives outside the blocks, per micro-batch, forward plus
    backward: (on the stage with the output head, on the stage with the embedding); `parts`:
    `tp_kinds`.

    The head is a column-parallel linear over the vocabulary (as in `block_collectives`: its
    input gathered forward, gathered again beside its input-gradient GEMM and its input gradient
    reduced beside its weight-gradient GEMM; without sequence parallel only that reduction), and
    the vocabulary-parallel cross-entropy all-reduces a few fp32 numbers per token
    (`loss_all_reduces` of them: latency). The vocabulary-parallel embedding sums its partial rows
    forward (a reduce-scatter, or an all-reduce), and with sequence parallel gathers its gradient
    backward."""
    if lay.tp == 1:
        return (0.0, 0.0), (0.0, 0.0)
    loss = tp_collective_parts(hw, "all_reduce", sh.tokens * DTYPE_BYTES["fp32"], lay.tp)
    if lay.sequence_parallel:
        gather, scatter = parts
        gathers = 2 - hidden_share(gather, head_f, hw)
        scatters = 1 - hidden_share(scatter, head_f, hw)
        embedding = tuple(g + s for g, s in zip(gather, scatter))
    else:
        gather = scatter = embedding = parts[0]
        gathers, scatters = 0.0, 1 - hidden_share(scatter, head_f, hw)
    head = tuple(gathers * g + scatters * s + loss_all_reduces * lo
                 for g, s, lo in zip(gather, scatter, loss))
    return head, embedding


def _both(cost: tuple[float, float]) -> Pass:
    """A collective's (wait, transfer) over forward plus backward: its transfer half in each
    pass, its wait half in each."""
    return Pass({"tp_comm": cost[1] / 2}, {"tp_comm": cost[1] / 2}, {"tp_comm": cost[0] / 2})


def seconds(step: Step) -> Seconds | None:
    lay, hw, sh = step.lay, step.hw, step.sh
    if lay.tp == 1:
        return None
    parts = tp_kinds(lay, hw, sh)  # one collective of each kind the blocks and ends run
    block = layer_comm(lay, hw, column_gemms(step.model, hw, sh, step.attention), parts)
    head, embedding = ends_comm(lay, hw, sh, parts, step.head_f, step.impl.loss_all_reduces)
    return Seconds(layer=_both(block), head=_both(head), embedding=_both(embedding),
                   carried={"layer": Carried(comm=block[0] + block[1]),
                            "head": Carried(comm=head[0] + head[1]),
                            "embedding": Carried(comm=embedding[0] + embedding[1])})


TERM = Term("tensor", stage_bytes=stage_bytes, seconds=seconds)
