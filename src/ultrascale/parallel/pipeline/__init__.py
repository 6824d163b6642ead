"""Pipeline parallelism.

- `schedules`: each schedule (afab, 1f1b, interleaved, zero_bubble, dualpipev) as per-rank action
  lists, where the stages sit (looped, or dualpipev's V), their validation and the proof that a
  set of lists runs without deadlock;
- `simulator`: step time, bubble and peak activations of a schedule (planner, memory estimator);
- `stage`: the split of the plain model into stages, tied embeddings;
- `deferred`: weight gradients left from I to W (zero_bubble, dualpipev);
- `executor`: runs a rank's action list with batched asynchronous point-to-point transfers;
- `runtime`: `apply_pipeline(model, ctx, cfg)`, the trainer's Runtime for pp > 1.

Only the first two are imported here: they need no torch, so the planner and the memory estimator
can use them cheaply (they import no torch themselves; the parent package still does).
"""

from ultrascale.parallel.pipeline.schedules import (
    SCHEDULE_NAMES, Action, PipelineDeadlock, add_communication, build_schedule, check_program,
    validate_schedule,
)
from ultrascale.parallel.pipeline.simulator import SimResult, simulate, simulate_program

__all__ = [
    "SCHEDULE_NAMES", "Action", "PipelineDeadlock", "SimResult", "add_communication",
    "build_schedule", "check_program", "simulate", "simulate_program", "validate_schedule",
]
