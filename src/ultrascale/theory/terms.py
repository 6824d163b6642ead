"""The lists the two folds run over: the terms (one per dimension), the kinds of attention, the
pipeline schedules.

`memory.estimator.estimate` and `planner.cost.predict` add the terms' bytes and seconds in this
order (it is also the order of the parts in their reports). A new dimension is one theory file
with a `TERM` and one line here; a new attention (`attention.Attention` subclass) or pipeline
schedule (`pipeline.Schedule` subclass) is one file and one line in its list
(docs/architecture.md, "The theory wing"). Torch-free.
"""

from __future__ import annotations

from ultrascale.layout import Layout
from ultrascale.theory import (block, context, data, ends, expert, optimizer, pipeline, precision,
                               recompute, tensor)
from ultrascale.theory.attention import GQA, Attention
from ultrascale.theory.dualpipev import DualPipeV
from ultrascale.theory.pipeline import BUILT_IN, Schedule
from ultrascale.theory.shape import ModelShape

TERMS = (
    block.TERM,  # the layers: attention, MLP or experts, norms
    ends.TERM,  # embedding, final norm, output head and loss
    recompute.TERM,
    tensor.TERM,
    context.TERM,
    pipeline.TERM,
    expert.TERM,
    data.TERM,  # data parallel and ZeRO, and every gradient sum over copies of a weight
    precision.TERM,
    optimizer.TERM,
)

# The first whose `applies(model)` holds describes the model's attention.
ATTENTIONS: tuple[Attention, ...] = (
    GQA(),
)

SCHEDULES: tuple[Schedule, ...] = (
    BUILT_IN["afab"],
    BUILT_IN["1f1b"],
    BUILT_IN["interleaved"],
    BUILT_IN["zero_bubble"],
    DualPipeV("dualpipev"),
)


def attention_of(m: ModelShape) -> Attention:
    return next(a for a in ATTENTIONS if a.applies(m))


def schedule_of(lay: Layout) -> Schedule:
    return _SCHEDULE_NAMED[lay.pp_schedule]


_SCHEDULE_NAMED = {s.name: s for s in SCHEDULES}
