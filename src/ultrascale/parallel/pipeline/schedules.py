"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it runs.

The model is cut into `pp * v` consecutive *virtual stages*; rank r holds the chunks r, r+pp,
r+2pp, ... (Megatron's interleaving; v = 1 is the plain pipeline). An `Action` names a local chunk
index c on its rank, so its virtual stage is `c * pp + r`.

A schedule built here lists only compute actions (F, B, or I + W). The point-to-point transfers
follow from them: a forward of stage s > 0 needs the activation of stage s-1, a backward of stage
s < last needs the gradient from stage s+1. `add_communication` writes them out explicitly as
SEND_*/RECV_* actions next to the compute that produces or consumes them, so that an executor can
post each run of adjacent transfers as one `batch_isend_irecv`.

`check_program` proves a list of programs valid: one F and one B (or I then W) per micro-batch and
chunk on the owning rank, and a dependency-respecting order exists in which every rank runs its
list in sequence (no deadlock). `play` is that ordering; the simulator times it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULE_NAMES = ("afab", "1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: `kind` on micro-batch `microbatch` of local chunk `chunk`.

    F: forward. B: full backward (input and weight gradients). I: input-gradient backward only.
    W: weight-gradient backward (needs the I of the same micro-batch and chunk).
    SEND_F/RECV_F: the activation leaving / entering this chunk's forward.
    SEND_B/RECV_B: the gradient leaving / entering this chunk's backward.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {COMPUTE_KINDS + COMM_KINDS}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


class PipelineDeadlock(ValueError):
    """The per-rank programs cannot all run to the end: some ranks wait on each other forever."""


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """Virtual stage index of local chunk `chunk` on `rank`."""
    return chunk * pp + rank


def owner_of(stage: int, pp: int) -> tuple[int, int]:
    """(rank, local chunk) holding virtual stage `stage`."""
    return stage % pp, stage // pp


# --------------------------------------------------------------------------------------------
# Validation


def validate_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1,
                      num_layers: int | None = None) -> None:
    """Raise ValueError (what is wrong, how to fix it) unless `name` can run with these sizes.

    `num_layers`, when given, must leave at least one transformer layer per virtual stage.
    """
    m, v = num_microbatches, virtual_stages
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown pipeline schedule {name!r}: parallel.pp_schedule must be one of "
                         f"{', '.join(SCHEDULE_NAMES)}.")
    for key, value in (("pp", pp), ("num_microbatches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Pipeline {key}={value!r} must be a positive integer.")
    if name != "interleaved" and v != 1:
        raise ValueError(
            f"parallel.pp_virtual_stages={v} only applies to the 'interleaved' schedule, not "
            f"{name!r}. Set pp_virtual_stages=1, or pp_schedule=interleaved.")
    if name == "interleaved":
        if pp < 2:
            raise ValueError("The 'interleaved' schedule needs pp >= 2 (with one rank there is no "
                             "bubble to shrink). Use pp_schedule=1f1b or raise parallel.pp.")
        if v < 2:
            raise ValueError(
                f"The 'interleaved' schedule needs pp_virtual_stages >= 2 (got {v}); with one "
                "chunk per rank it is plain 1F1B. Set pp_virtual_stages=2 or pp_schedule=1f1b.")
        if m % pp:
            # Micro-batches go round the ranks in groups of pp per chunk; a short last group
            # would leave the first rank waiting for its own chunk's input.
            lo, hi = (m // pp) * pp, (m // pp + 1) * pp
            fix = f"{lo} or {hi}" if lo else f"{hi}"
            raise ValueError(
                f"The 'interleaved' schedule needs the number of micro-batches (grad_accum_steps="
                f"{m}) to be a multiple of pp={pp}. Use {fix} micro-batches.")
    if num_layers is not None and num_layers < pp * v:
        raise ValueError(
            f"{num_layers} layers do not fit {pp} pipeline ranks x {v} virtual stages = "
            f"{pp * v} stages (each needs at least one layer). Lower pp or pp_virtual_stages, "
            "or use a deeper model.")


# --------------------------------------------------------------------------------------------
# The schedules (compute actions only)


def _afab(pp: int, m: int, v: int) -> list[list[Action]]:
    # GPipe: every forward, then every backward; peak memory holds all m micro-batches.
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(pp)]


def _one_f_one_b(pp: int, m: int, v: int) -> list[list[Action]]:
    programs = []
    for r in range(pp):
        # Rank r needs pp-1-r forwards in flight before the first gradient can come back.
        warm = min(pp - 1 - r, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        programs.append(acts)
    return programs


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    total = m * v

    # The k-th forward of a rank: micro-batches go in groups of pp through chunk 0, then the same
    # group through chunk 1, ...; backwards run the chunks in reverse order.
    def nth(kind: str, k: int) -> Action:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, group * pp + k % pp, chunk)

    programs = []
    for r in range(pp):
        # Forwards ahead of the first backward: the full first pass over chunks 0..v-2 of a group
        # ((v-1)*pp), plus two per downstream rank, because a gradient must come back through
        # pp-1-r ranks while the forward went out through as many (Megatron's count).
        warm = min(2 * (pp - 1 - r) + (v - 1) * pp, total)
        acts = [nth("F", k) for k in range(warm)]
        for k in range(total - warm):
            acts += [nth("F", warm + k), nth("B", k)]
        acts += [nth("B", k) for k in range(total - warm, total)]
        programs.append(acts)
    return programs


def _zero_bubble(pp: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with B split into I (critical path) and W (deferred into the bubbles).

    Rank r starts like 1F1B (pp-1-r warm-up forwards), then runs F, I pairs and delays each W by
    r steps: the first rank, whose 1F1B peak is already pp micro-batches, never delays, and rank r
    may hold r more, so no rank holds more than pp (counting a micro-batch until its W), the peak
    of 1F1B. The delayed W's then fill the cool-down, where 1F1B waits for gradients.
    """
    programs = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [Action("F", i) for i in range(warm)]
        delayed: deque[int] = deque()
        for i in range(m):
            if warm + i < m:
                acts.append(Action("F", warm + i))
            acts.append(Action("I", i))
            delayed.append(i)
            # Steady state keeps r W's back; in the cool-down (no forward left) one W follows
            # each I, filling the wait for the next gradient.
            if len(delayed) > r or warm + i >= m:
                acts.append(Action("W", delayed.popleft()))
        acts += [Action("W", i) for i in delayed]
        programs.append(acts)
    return programs


_BUILDERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "afab": _afab, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zero_bubble": _zero_bubble,
}


def build_schedule(name: str, pp: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """For each pipeline rank, its ordered compute actions (F, B, I, W) for one training step."""
    validate_schedule(name, pp, num_microbatches, virtual_stages)
    return _BUILDERS[name](pp, num_microbatches, virtual_stages)


# --------------------------------------------------------------------------------------------
# Dependencies, communication, and proof of a valid program


def dependencies(rank: int, action: Action, pp: int, v: int) -> list[tuple[int, Action]]:
    """The (rank, compute action) pairs that must finish before `action` on `rank` can start."""
    stage, last = stage_of(rank, action.chunk, pp), pp * v - 1
    mb = action.microbatch
    if action.kind == "F":
        if stage == 0:
            return []
        r, c = owner_of(stage - 1, pp)
        return [(r, Action("F", mb, c))]
    if action.kind in ("B", "I"):
        deps = [(rank, Action("F", mb, action.chunk))]
        if stage < last:
            r, c = owner_of(stage + 1, pp)
            # The gradient comes from whichever of B or I the next stage runs; the caller's
            # program decides, so both are named and `play` picks the one present.
            deps.append((r, Action("B", mb, c)))
            deps.append((r, Action("I", mb, c)))
        return deps
    if action.kind == "W":
        return [(rank, Action("I", mb, action.chunk))]
    raise ValueError(f"{action} is a communication action; it has no compute dependencies")


def play(programs: list[list[Action]], pp: int, v: int,
         on_action: Callable[[int, Action, list[tuple[int, Action]]], None] | None = None) -> None:
    """Run the compute actions of all ranks in some order that respects every dependency.

    Each rank runs its list in sequence. `on_action(rank, action, deps)` is called for each action
    once its dependencies `deps` (those present in the programs) have been called. Raises
    PipelineDeadlock, naming what every stuck rank waits for, if the programs cannot finish.
    """
    lists = [[a for a in prog if a.is_compute] for prog in programs]
    present = {(r, a) for r, prog in enumerate(lists) for a in prog}
    done: set[tuple[int, Action]] = set()
    pos = [0] * len(lists)
    progressed = True
    while progressed:
        progressed = False
        for r, prog in enumerate(lists):
            while pos[r] < len(prog):
                a = prog[pos[r]]
                deps = [d for d in dependencies(r, a, pp, v) if d in present]
                if not all(d in done for d in deps):
                    break
                if on_action is not None:
                    on_action(r, a, deps)
                done.add((r, a))
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(prog) for r, prog in enumerate(lists)):
        stuck = []
        for r, prog in enumerate(lists):
            if pos[r] < len(prog):
                a = prog[pos[r]]
                waits = [f"{b} on rank {q}" for q, b in dependencies(r, a, pp, v)
                         if (q, b) in present and (q, b) not in done]
                stuck.append(f"rank {r} at {a} waits for {', '.join(waits)}")
        raise PipelineDeadlock("Pipeline programs deadlock: " + "; ".join(stuck))


def check_program(programs: list[list[Action]], pp: int, num_microbatches: int,
                  virtual_stages: int = 1) -> None:
    """Raise ValueError unless `programs` is a complete, deadlock-free pipeline step.

    Complete: every rank runs, for each micro-batch and local chunk, exactly one F and either one B
    or one I and one W, with F before its B/I and I before its W.
    """
    m, v = num_microbatches, virtual_stages
    if len(programs) != pp:
        raise ValueError(f"Expected one program per pipeline rank ({pp}), got {len(programs)}.")
    for r, prog in enumerate(programs):
        seen: dict[Action, int] = {}
        for idx, a in enumerate(prog):
            if not a.is_compute:
                continue
            if not (0 <= a.microbatch < m and 0 <= a.chunk < v):
                raise ValueError(f"rank {r}: {a} is outside micro-batches 0..{m - 1}, "
                                 f"chunks 0..{v - 1}.")
            if a in seen:
                raise ValueError(f"rank {r}: {a} appears twice (positions {seen[a]} and {idx}).")
            seen[a] = idx
        for mb in range(m):
            for c in range(v):
                f, b = Action("F", mb, c), Action("B", mb, c)
                i, w = Action("I", mb, c), Action("W", mb, c)
                if f not in seen:
                    raise ValueError(f"rank {r}: missing {f}.")
                if (b in seen) == (i in seen) or (i in seen) != (w in seen):
                    raise ValueError(f"rank {r}: micro-batch {mb} chunk {c} needs exactly one "
                                     "backward: either B, or I and W.")
                first_bwd = seen[b] if b in seen else seen[i]
                if first_bwd < seen[f]:
                    raise ValueError(f"rank {r}: the backward of micro-batch {mb} chunk {c} comes "
                                     "before its forward.")
                if i in seen and seen[w] < seen[i]:
                    raise ValueError(f"rank {r}: {w} comes before {i}.")
    play(programs, pp, v)


def add_communication(programs: list[list[Action]], pp: int,
                      virtual_stages: int = 1) -> list[list[Action]]:
    """The programs with their point-to-point transfers written out.

    Each RECV sits just before the compute that consumes it and each SEND just after the compute
    that produces it; the peer follows from the stage (`peer_of`). Runs of adjacent transfers are
    meant to be posted together as one batch of asynchronous sends and receives.
    """
    last = pp * virtual_stages - 1
    out = []
    for r, prog in enumerate(programs):
        acts: list[Action] = []
        for a in prog:
            stage = stage_of(r, a.chunk, pp)
            if a.kind == "F" and stage > 0:
                acts.append(Action("RECV_F", a.microbatch, a.chunk))
            if a.kind in ("B", "I") and stage < last:
                acts.append(Action("RECV_B", a.microbatch, a.chunk))
            acts.append(a)
            if a.kind == "F" and stage < last:
                acts.append(Action("SEND_F", a.microbatch, a.chunk))
            if a.kind in ("B", "I") and stage > 0:
                acts.append(Action("SEND_B", a.microbatch, a.chunk))
        out.append(acts)
    return out


def peer_of(rank: int, action: Action, pp: int) -> tuple[int, int]:
    """(peer rank, peer local chunk) of a communication action."""
    stage = stage_of(rank, action.chunk, pp)
    other = stage + 1 if action.kind in ("SEND_F", "RECV_B") else stage - 1
    if action.kind not in COMM_KINDS:
        raise ValueError(f"{action} is not a communication action")
    return owner_of(other, pp)
