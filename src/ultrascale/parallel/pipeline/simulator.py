"""A discrete-event simulator of pipeline schedules: step time, bubble and activation memory.

Each rank runs its program in order; an action starts when the rank is free and its inputs have
arrived (`schedules.dependencies`, plus `t_comm` for a transfer between two ranks). Times are
given for a whole (non-interleaved) stage: with v chunks per rank each chunk takes t / v.
The backward splits as I (input gradient, `t_b - t_w`) and W (weight gradient, `t_w`) for the
zero-bubble schedule; `t_w` defaults to half of `t_b`.

A forward and a backward that a schedule pairs (dualpipev) start together once both inputs are
in and take the sum of their times, or `t_pair` (a whole stage's pair: each chunk's t_pair / v)
where the caller says how much their overlap hides (theory/dualpipev.py: the expert all-to-alls
under the other chunk's compute); both outputs leave at the end of the pair.

The bubble is the playbook's: (total - ideal) / ideal, with ideal = m * (t_f + t_b), the work of
one rank; it is (p-1)/m for AFAB and 1F1B and (p-1)/(v*m) for the interleaved schedule. For
dualpipev, total - ideal is DualPipe's (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and the
times of one chunk (F = t_f/2, B = t_b/2, W = t_w/2, F&B = F + B).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ultrascale.parallel.pipeline.schedules import (
    Action, build_schedule, check_program, placement_of, play,
)


@dataclass
class SimResult:
    total_time: float
    ideal_time: float
    bubble_fraction: float
    peak_in_flight: list[float]  # per rank, in full-stage activations (chunk count / v)
    peak_in_flight_chunks: list[int]  # per rank, chunk-micro-batches held at once
    busy_time: list[float]
    idle_time: list[float]
    # (rank, action, start, end) for every compute action, in the order it was played.
    timeline: list[tuple[int, Action, float, float]] = field(repr=False, default_factory=list)


def peak_in_flight_chunks(program: list[Action]) -> int:
    """Most chunk-micro-batches whose activations a rank holds at once.

    A micro-batch is held from its F until its backward has fully run: B, or W when the backward
    is split (W still needs the layer inputs). A rank runs one action at a time, so list order is
    enough; no timing is needed.
    """
    held = peak = 0
    for a in program:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind in ("B", "W"):
            held -= 1
    return peak


def simulate_program(programs: list[list[Action]], pp: int, num_microbatches: int, v: int = 1,
                     t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None,
                     t_comm: float = 0.0, placement: str = "loop",
                     t_pair: float | None = None) -> SimResult:
    """Time the given per-rank programs. Raises ValueError (PipelineDeadlock) if they deadlock.
    `t_pair`: a paired forward and backward's time (whole stage), t_f + t_b when None."""
    check_program(programs, pp, num_microbatches, v, placement)
    return _timed(programs, _play_order(programs, pp, v, placement), num_microbatches, v,
                  (t_f, t_b, t_w, t_comm, t_pair))


Played = tuple[tuple[int, Action, tuple[tuple[int, Action], ...]], ...]


def _play_order(programs: list[list[Action]], pp: int, v: int, placement: str) -> Played:
    """The order `play` runs the compute actions in, each with the dependencies it waited for:
    it depends on the programs only, not on the times."""
    order: list = []
    play(programs, pp, v, lambda r, a, deps: order.append((r, a, tuple(deps))), placement)
    return tuple(order)


def _timed(programs: list[list[Action]], order: Played, num_microbatches: int, v: int,
           times: tuple) -> SimResult:
    """The programs timed along their play order; `times`: (t_f, t_b, t_w, t_comm, t_pair)."""
    t_f, t_b, t_w, t_comm, t_pair = times
    pp = len(programs)
    if t_w is None:
        t_w = t_b / 2
    if t_pair is None:
        t_pair = t_f + t_b
    if not (0 <= t_w <= t_b) or t_f < 0 or t_comm < 0 or t_pair < 0:
        raise ValueError(f"Stage times must be >= 0 with 0 <= t_w <= t_b (got t_f={t_f}, "
                         f"t_b={t_b}, t_w={t_w}, t_comm={t_comm}, t_pair={t_pair}).")
    duration = {"F": t_f / v, "B": t_b / v, "I": (t_b - t_w) / v, "W": t_w / v}
    # A pair's two parts drawn in proportion to their own times, over t_pair in all.
    squeeze = t_pair / (t_f + t_b) if t_f + t_b > 0 else 1.0
    clock = [0.0] * pp
    busy = [0.0] * pp
    end_of: dict[tuple[int, Action], float] = {}
    timeline: list[tuple[int, Action, float, float]] = []

    paired: dict[int, tuple[Action, list[tuple[int, Action]]]] = {}  # rank -> its pair's F

    def ready(rank: int, deps: list[tuple[int, Action]]) -> list[float]:
        return [end_of[d] + (t_comm if d[0] != rank else 0.0) for d in deps]

    def run(rank: int, action: Action, deps: list[tuple[int, Action]]) -> None:
        if action.paired:  # wait for its backward: the pair starts when both inputs are in
            paired[rank] = (action, deps)
            return
        first = paired.pop(rank, None)
        start = max([clock[rank], *ready(rank, deps),
                     *(ready(rank, first[1]) if first else ())])
        scale = 1.0 if first is None else squeeze
        if first is not None:  # drawn one after the other; both outputs leave at the end
            mid = start + duration["F"] * scale
            timeline.append((rank, first[0], start, mid))
            busy[rank] += duration["F"] * scale
            start_b = mid
        else:
            start_b = start
        end = start_b + duration[action.kind] * scale
        clock[rank] = end
        busy[rank] += duration[action.kind] * scale
        end_of[(rank, action)] = end
        if first is not None:
            end_of[(rank, first[0])] = end
        timeline.append((rank, action, start_b, end))

    for rank, action, deps in order:
        run(rank, action, list(deps))
    total = max(clock)
    ideal = num_microbatches * (t_f + t_b)
    chunks = [peak_in_flight_chunks(p) for p in programs]
    return SimResult(
        total_time=total,
        ideal_time=ideal,
        bubble_fraction=(total - ideal) / ideal if ideal > 0 else 0.0,
        peak_in_flight=[c / v for c in chunks],
        peak_in_flight_chunks=chunks,
        busy_time=busy,
        idle_time=[total - b for b in busy],
        timeline=timeline,
    )


def simulate(name: str, pp: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float | None = None, t_comm: float = 0.0,
             t_pair: float | None = None) -> SimResult:
    """Simulate schedule `name` on `pp` ranks with `m` micro-batches and `v` chunks per rank."""
    programs, order = _built(name, pp, m, v)
    return _timed(programs, order, m, v, (t_f, t_b, t_w, t_comm, t_pair))


@lru_cache(maxsize=512)
def _built(name: str, pp: int, m: int, v: int) -> tuple[list[list[Action]], Played]:
    """A named schedule's programs, checked, and their play order: built once per shape, since
    the planner times the same schedule under many stage times."""
    programs = build_schedule(name, pp, m, v)
    check_program(programs, pp, m, v, placement_of(name))
    return programs, _play_order(programs, pp, v, placement_of(name))
