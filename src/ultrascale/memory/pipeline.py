"""How many micro-batches of activations each pipeline rank holds at its peak.

The pipeline helper's simulator (`ultrascale.parallel.pipeline.simulator`) replays each schedule
action by action; importing it pulls in torch through `ultrascale.parallel`, which would cost the
`ultrascale memory` command seconds. So the estimator uses the closed forms below, which
tests/test_estimator.py checks equal to the simulator's `peak_in_flight` over a grid of schedules,
ranks, micro-batch counts and virtual stages; when the simulator is already loaded (the planner, the
trainer), it is used directly.
"""

from __future__ import annotations

import sys
from functools import lru_cache


def closed_form_in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Peak micro-batches held by `rank`, in whole-stage units (a chunk counts 1/v)."""
    if pp == 1:
        # No pipeline: gradient accumulation runs each micro-batch's backward right after its
        # forward, whatever schedule name the layout carries.
        return 1.0
    if schedule == "afab":
        return float(m)
    if schedule == "interleaved":
        # Megatron's warm-up: 2 per downstream rank plus the first pass over chunks 0..v-2,
        # then one more forward before the first backward.
        chunks = min(2 * (pp - 1 - rank) + (v - 1) * pp + 1, m * v)
        return chunks / v
    if schedule == "zero_bubble":
        # ZB-H1 defers each weight-gradient pass by `rank` steps: every rank peaks at pp.
        return float(min(pp, m))
    return float(min(pp - rank, m))  # 1f1b: pp-1-rank warm-up forwards, then one more


@lru_cache(maxsize=4096)
def _simulated(schedule: str, pp: int, m: int, v: int) -> tuple[float, ...]:
    sim = sys.modules["ultrascale.parallel.pipeline.simulator"]
    return tuple(sim.simulate(schedule, pp, m, v).peak_in_flight)


@lru_cache(maxsize=65536)
def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    if pp > 1 and "ultrascale.parallel.pipeline.simulator" in sys.modules:
        try:
            return _simulated(schedule, pp, m, v)[rank]
        except ValueError:  # a combination the schedule refuses (e.g. m < pp for interleaved)
            pass
    return closed_form_in_flight(schedule, pp, m, v, rank)
