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

The overlap of a paired forward and backward ("F&B": the steady state's actions, the schedule's
`paired`). The engine runs the pair's two chunks in two threads that take turns
(parallel/overlap.py): when one reaches the wait of an expert all-to-all (dispatch or combine,
forward or backward, and those a full recomputation replays: parallel/expert.py `_exchange`), the
other computes while those rows travel. Nothing else goes through those turns: the pipeline's
receives are taken before the pair and its sends posted after it, the all-to-all of the
per-rank counts before each dispatch and every other collective (tp, cp, ZeRO-3's gathers) block
the chunk that issues them (benchmarks/dualpipev_overlap_cpu.py counts what runs inside a pair).
The model, per pair, with S the pair's pipeline transfers (`pp_p2p`), A its two chunks' expert
all-to-alls (`ep_comm`) and C all the rest of their two chunks' time (device work and waits):

    F&B = S + max(C, A)          (an unpaired F, B, I or W: its own time, all of it in series)

Compute runs one chunk at a time and the exchanges of both chunks share the ranks' links, so the
pair takes at least C and at least A; this is that bound, reached when every exchange fits under
the other chunk's compute that runs while it travels. It is what the engine can reach, not more:
the planner's average block gives every chunk the model's share of MoE layers, while a chunk of
dense layers only has no exchange to hand the turn over at, and its partner's exchanges after the
first then wait in the open (DeepSeek-V3's first three layers, on ranks 0 and 1). The hidden time
comes off the `ep_comm` of the step's breakdown (`DualPipeV.hidden`); the warm-up's forwards and
the cool-down's backward passes, which run alone, pay their all-to-alls in full.

On a CPU profile (ranks sharing a node's cores) nothing is hidden: gloo moves the bytes with the
same cores the ranks compute on (loopback copies), so the all-to-alls' time is core time that the
other chunk cannot use as well; the processor-sharing replay keeps them in series.
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

    def step_total(self, step: Step, load: "Loads", at: Placement, t_f: float,
                   t_b: float, parts: tuple[dict, dict] | None = None) -> float:
        """The m micro-batches through the V, each F&B pair taking `pair_time` (on a CPU node
        whose ranks share its cores, the processor-sharing replay with each chunk's own work, in
        series: `pipeline.shared_pipeline_total`)."""
        lay = step.lay
        m = lay.grad_accum
        if step.hardware.host_cores:
            return shared_pipeline_total(step, load)
        t_pair = pair_time(*parts) if parts is not None else t_f + t_b
        work = m * (t_f + t_b) - paired_forwards(lay.pp, m, at.rank) * (t_f + t_b - t_pair) / 2
        return max(work, dualpipev_time(lay.pp, m, t_f, t_b, t_pair) - at.fill_gain)

    def hidden(self, step: Step, parts: tuple[dict, dict], at: Placement) -> dict[str, float]:
        """The expert all-to-alls the costed rank hides in its pairs over a step: each of its
        paired chunks' share of (t_f + t_b) - `pair_time` (none on a CPU profile)."""
        if step.hardware.host_cores or step.lay.pp == 1:
            return {}
        saved = hidden_in_pair(*parts)
        if saved <= 0:
            return {}
        return {OVERLAPPED: paired_forwards(step.lay.pp, step.lay.grad_accum, at.rank) * saved / 2}


OVERLAPPED = "ep_comm"  # the breakdown key the pairs hide (theory/expert.py's all-to-alls)
IN_SERIES = ("pp_p2p",)  # taken before the pair and posted after it (theory/pipeline.py)


def pair_time(forward: dict[str, float], backward: dict[str, float]) -> float:
    """A paired forward and backward of a whole stage (both chunks' share: each chunk's pair is
    half of it), from their seconds by breakdown key: S + max(C, A) (module docstring)."""
    return sum(forward.values()) + sum(backward.values()) - hidden_in_pair(forward, backward)


def hidden_in_pair(forward: dict[str, float], backward: dict[str, float]) -> float:
    """What a pair (whole stage) hides of its expert all-to-alls: min(A, C)."""
    series = sum(part.get(k, 0.0) for part in (forward, backward) for k in IN_SERIES)
    comm = forward.get(OVERLAPPED, 0.0) + backward.get(OVERLAPPED, 0.0)
    rest = sum(forward.values()) + sum(backward.values()) - series - comm
    return max(0.0, min(comm, rest))


@lru_cache(maxsize=512)
def paired_forwards(pp: int, m: int, rank: int) -> int:
    """The F&B pairs of `rank`'s program."""
    return sum(a.paired for a in dualpipev_rank(pp, m, rank))


@lru_cache(maxsize=4096)
def _unit_total(pp: int, m: int, ratio: float, pair: float = 1.0) -> float:
    """Total time with a stage forward of 1, a backward of `ratio` and a pair of `pair` x
    (1 + ratio): simulated at 2pp and 2pp+1 micro-batches, extended linearly (each more
    micro-batch is one more steady round)."""
    if m <= 2 * pp + 1:
        t_pair = None if pair == 1.0 else pair * (1.0 + ratio)
        return float(simulate("dualpipev", pp, m, 2, t_f=1.0, t_b=ratio,
                              t_pair=t_pair).total_time)
    a, b = _unit_total(pp, 2 * pp, ratio, pair), _unit_total(pp, 2 * pp + 1, ratio, pair)
    return a + (m - 2 * pp) * (b - a)


PAIR_STEP = 0.0625  # grid of pair / (forward + backward) the simulator is run at


def dualpipev_time(pp: int, m: int, t_f: float, t_b: float,
                   t_pair: float | None = None) -> float:
    """The step's time for stage times t_f, t_b (both chunks) and a pair's `t_pair` (t_f + t_b
    when None), interpolated between backward / forward ratios on `pipeline.RATIO_STEP`'s grid,
    as `pipeline.pipeline_time` does, and between pair / (t_f + t_b) on `PAIR_STEP`'s."""
    if pp == 1:
        return m * (t_f + t_b)
    ratio = t_b / t_f
    lo = math.floor(ratio / RATIO_STEP) * RATIO_STEP
    q = 1.0 if t_pair is None else min(1.0, t_pair / (t_f + t_b))
    q_lo = min(math.floor(q / PAIR_STEP) * PAIR_STEP, 1.0)
    q_hi = min(q_lo + PAIR_STEP, 1.0)

    def at(r: float) -> float:  # linear in the pair's share between its grid points
        a = _unit_total(pp, m, round(r, 4), round(q_lo, 6))
        if q_hi == q_lo:
            return a
        b = _unit_total(pp, m, round(r, 4), round(q_hi, 6))
        return a + (b - a) * (q - q_lo) / PAIR_STEP

    t_lo, t_hi = at(lo), at(lo + RATIO_STEP)
    return t_f * (t_lo + (t_hi - t_lo) * (ratio - lo) / RATIO_STEP)
