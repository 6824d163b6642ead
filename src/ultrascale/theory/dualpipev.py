"""DualPipeV (parallel/pipeline/schedules.py) as the theory sees it: which ranks hold the ends, how
many micro-batches each holds at its peak, and its step time.

Rank r holds stages r and 2pp-1-r (two chunks, v = 2): the first stage (the embedding) and the
last (the final norm, the head and the loss) both sit on rank 0. A chunk is held from its forward
until its backward, or until its weight-gradient pass where the backward is split, keeping from
its input-gradient pass on only what that pass needs. Every rank peaks at 2pp + 1 chunks (DualPipe's
PP + 1), none of them past its input-gradient pass then, and rank 0's last-stage chunk holds one
micro-batch (rank r's second chunk r + 1); the mix of whole and deferred chunks whose bytes peak
comes from replaying the rank's program (O(m), cached), as zero bubble's candidates do.
tests/test_pipeline_schedules.py holds these against the replay and the simulator. The step time
is the simulator's (a chunk's bubble (pp-1)(F&B + B - 3W)), linear in m past the warm-up; with
ranks sharing a CPU node's cores, the processor-sharing replay of the V (each chunk its own
stage's work: rank 0 its embedding and its head). Torch-free.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

from ultrascale.parallel.pipeline.schedules import dualpipev_rank
from ultrascale.parallel.pipeline.simulator import simulate
from ultrascale.theory.pipeline import RATIO_STEP, Schedule, shared_pipeline_total
from ultrascale.theory.term import Placement, Stage, Step

if TYPE_CHECKING:
    from ultrascale.theory.pipeline import Loads


@lru_cache(maxsize=4096)
def held_states(pp: int, m: int, rank: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """The (whole, deferred, edge) chunk counts `rank` passes through over a step, and the most
    micro-batches its second chunk holds at once (on rank 0 the last stage), counted until their
    backward or weight-gradient pass. `edge`: second-chunk micro-batches before their backward
    or input-gradient pass, whose loss tensors (rank 0) are still held. A paired forward is
    counted before its backward frees anything (the pair runs together)."""
    whole = deferred = edge = 0
    second = second_peak = 0
    states = set()
    for a in dualpipev_rank(pp, m, rank):
        last = a.chunk == 1
        if a.kind == "F":
            whole, edge = whole + 1, edge + last
        elif a.kind == "B":
            whole, edge = whole - 1, edge - last
        elif a.kind == "I":
            whole, deferred, edge = whole - 1, deferred + 1, edge - last
        else:  # W
            deferred -= 1
        if last and a.kind != "I":  # held from its forward to its backward or W
            second += 1 if a.kind == "F" else -1
            second_peak = max(second_peak, second)
        states.add((whole, deferred, edge))
    return tuple(sorted(states)), second_peak


class DualPipeV(Schedule):
    defers_weight_gradients = True

    def in_flight(self, pp: int, m: int, v: int, rank: int) -> float:
        """Chunks held at the peak, counted until their backward or weight-gradient pass, in
        whole-stage units: 2pp + 1 chunks (DualPipe's PP + 1)."""
        return (2 * pp + 1) / 2

    def edge_in_flight(self, pp: int, m: int, v: int, rank: int, held: float) -> float:
        """Micro-batches of the second chunk held at once: on rank 0 the last stage's, one."""
        return float(rank + 1)

    def held(self, stage: Stage, per_micro_batch: float, deferred: float,
             edge: float = 0.0) -> tuple[float, float, float]:
        """(stage-equivalents held, micro-batches of the ends' own tensors held, stage-equivalents
        kept for a weight-gradient pass), at the state of the rank's program whose bytes peak.
        The ends sit on rank 0; their tensors (`edge` bytes a micro-batch) are counted for the
        last stage's micro-batches before their backward, which hold the loss's (fp32
        probabilities over the vocabulary): the first stage's token ids, 8 bytes a token, are
        held a little longer."""
        lay = stage.layout
        pp, m, rank = lay.pp, lay.grad_accum, stage.index
        if stage.impl.activations != "tensors":
            return self.in_flight(pp, m, 2, rank), self.edge_in_flight(pp, m, 2, rank, 0.0), 0
        states, _ = held_states(pp, m, rank)
        # A chunk is half the rank's layers: half a micro-batch of each kind.
        body = per_micro_batch - edge
        whole, n_deferred, n_edge = max(
            states, key=lambda s: s[0] * body / 2 + s[1] * deferred / 2 + s[2] * edge)
        return whole / 2, n_edge, n_deferred / 2

    def ends(self, rank: int, pp: int) -> tuple[bool, bool]:
        return rank == 0, rank == 0

    def placement(self, step: Step, load: "Loads") -> Placement:
        """The costed rank holds the embedding and the head (rank 0)."""
        return Placement(step.layers, 1.0, 1.0, step.lay.pp_virtual_stages)

    def step_total(self, step: Step, load: "Loads", at: Placement, t_f: float,
                   t_b: float) -> float:
        """The m micro-batches through the V (on a CPU node whose ranks share its cores, the
        processor-sharing replay with each chunk's own work: `pipeline.shared_pipeline_total`)."""
        lay = step.lay
        m = lay.grad_accum
        if step.hardware.host_cores:
            return shared_pipeline_total(step, load)
        return max(m * (t_f + t_b), dualpipev_time(lay.pp, m, t_f, t_b) - at.fill_gain)


@lru_cache(maxsize=4096)
def _unit_total(pp: int, m: int, ratio: float) -> float:
    """Total time with a stage forward of 1 and backward of `ratio`: simulated at 2pp and 2pp+1
    micro-batches, extended linearly (each more micro-batch is one more steady round)."""
    if m <= 2 * pp + 1:
        return float(simulate("dualpipev", pp, m, 2, t_f=1.0, t_b=ratio).total_time)
    a, b = _unit_total(pp, 2 * pp, ratio), _unit_total(pp, 2 * pp + 1, ratio)
    return a + (m - 2 * pp) * (b - a)


def dualpipev_time(pp: int, m: int, t_f: float, t_b: float) -> float:
    """The step's time for stage times t_f, t_b (both chunks), interpolated between backward /
    forward ratios on `pipeline.RATIO_STEP`'s grid, as `pipeline.pipeline_time` does."""
    if pp == 1:
        return m * (t_f + t_b)
    ratio = t_b / t_f
    lo = math.floor(ratio / RATIO_STEP) * RATIO_STEP
    t_lo, t_hi = _unit_total(pp, m, round(lo, 4)), _unit_total(pp, m, round(lo + RATIO_STEP, 4))
    return t_f * (t_lo + (t_hi - t_lo) * (ratio - lo) / RATIO_STEP)
