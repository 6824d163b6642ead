"""How many micro-batches of activations each pipeline rank holds at its peak.

The pipeline simulator (`ultrascale.parallel.pipeline.simulator`) replays each schedule action by
action, in time proportional to pp x m x v; the planner asks for thousands of layouts with up to
thousands of micro-batches. So the estimator uses the closed forms below, which
tests/test_estimator.py checks equal to the simulator's `peak_in_flight` over a grid of schedules,
ranks, micro-batch counts and virtual stages.
"""

from __future__ import annotations

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


def edge_in_flight(schedule: str, pp: int, m: int, v: int, rank: int, held: float) -> float:
    """Micro-batches whose first-stage tensors (token ids, on rank 0) or last-stage tensors (the
    loss's, on rank pp-1) the rank holds at its peak. Without virtual stages they are the stage's
    `held`; with them only the micro-batches in flight in the first (rank 0) or the last (rank
    pp-1) chunk count. Megatron's interleaved order runs each last chunk's backward right after its
    forward on the last rank, so it holds one; rank 0 has pushed chunk 0 of two rounds of pp
    micro-batches when its backwards start (tests/test_estimator.py replays the schedules)."""
    if pp == 1 or schedule != "interleaved" or v == 1:
        return held
    if rank == pp - 1:
        return 1.0
    return float(min(2 * pp, m)) if rank == 0 else held


def zero_bubble_states(pp: int, m: int, rank: int) -> list[tuple[int, int]]:
    """(whole, deferred) micro-batch counts a zero-bubble (ZB-H1) rank may hold at its peak.

    Between F and I a micro-batch holds everything its backward needs ("whole"); after I only what
    the deferred W pass needs (the linears' inputs and output gradients, "deferred"). ZB-H1 keeps
    min(pp, m) micro-batches between F and W on every rank, at most min(pp - rank, m) of them
    before their I; which mix is the peak depends on the bytes of each kind, so the candidates are
    returned (for m < pp a few may never occur: the bound is then on the safe side)."""
    total = min(pp, m)
    most = min(pp - rank, m)
    return [(f, total - f) for f in range(max(0, total - rank - 1), most + 1)]


@lru_cache(maxsize=65536)
def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    return closed_form_in_flight(schedule, pp, m, v, rank)
