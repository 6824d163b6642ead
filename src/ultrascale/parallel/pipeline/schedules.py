"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it runs.

The model is cut into `pp * v` consecutive *virtual stages*. Where they sit is the schedule's
*placement*: "loop" (every schedule but dualpipev) gives rank r the chunks r, r+pp, r+2pp, ...
(Megatron's interleaving; v = 1 is the plain pipeline), so local chunk c is stage `c * pp + r`;
"v" (dualpipev, v = 2) gives rank r the stages r and 2pp-1-r, so that the model goes down the
ranks and comes back up: the first and the last stage both sit on rank 0, and the two middle
stages on rank pp-1, which hands its activation from one to the other without a transfer.
An `Action` names a local chunk index c on its rank (`stage_of` gives its stage).

A schedule built here lists only compute actions (F, B, or I + W). The point-to-point transfers
follow from them: a forward of stage s > 0 needs the activation of stage s-1, a backward of stage
s < last needs the gradient from stage s+1. `add_communication` writes them out explicitly as
SEND_*/RECV_* actions next to the compute that produces or consumes them, so that an executor can
post each run of adjacent transfers as one `batch_isend_irecv`; a neighbour on the same rank
needs none.

DualPipeV runs a forward and a backward of two different chunks *together* (the forward marked
`paired`, its backward next in the list): both inputs are received first, both outputs sent after,
and with a mixture of experts one's all-to-alls overlap the other's compute (executor.py). The
deadlock check and the simulator treat such a pair as one unit that needs both inputs.

`check_program` proves a list of programs valid: one F and one B (or I then W) per micro-batch and
chunk on the owning rank, and a dependency-respecting order exists in which every rank runs its
list in sequence (no deadlock). `play` is that ordering; the simulator times it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULE_NAMES = ("afab", "1f1b", "interleaved", "zero_bubble", "dualpipev")
# Schedules that split backwards into I and W (the model's linears defer their weight gradients).
SPLIT_BACKWARD = ("zero_bubble", "dualpipev")
PLACEMENTS = ("loop", "v")


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
    # An F that runs together with the backward (B) right after it in its program. Not part of
    # the action's identity: the same F, whether paired or not.
    paired: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {COMPUTE_KINDS + COMM_KINDS}")
        if self.paired and self.kind != "F":
            raise ValueError(f"Only a forward pairs with the backward after it, not {self.kind}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return (f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")
                + ("&" if self.paired else ""))


class PipelineDeadlock(ValueError):
    """The per-rank programs cannot all run to the end: some ranks wait on each other forever."""


def placement_of(name: str) -> str:
    """Where schedule `name` puts the virtual stages: "v" for dualpipev, else "loop"."""
    return "v" if name == "dualpipev" else "loop"


def stage_of(rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """Virtual stage index of local chunk `chunk` on `rank`."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def owner_of(stage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, local chunk) holding virtual stage `stage`."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
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
    if name == "dualpipev":
        _validate_dualpipev(pp, m, v)
    elif name != "interleaved" and v != 1:
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


def _validate_dualpipev(pp: int, m: int, v: int) -> None:
    # pp = 1 is valid here (one rank holds the whole V, every hand-over local: the executor's
    # one-process tests run it); a layout refuses it (rules.schedule_violations).
    if v != 2:
        raise ValueError(
            f"The 'dualpipev' schedule runs two chunks per rank (stages r and 2pp-1-r, the V); "
            f"got pp_virtual_stages={v}. Set parallel.pp_virtual_stages=2.")
    if m < 2 * pp:
        # DualPipe's own bound: the steady state pairs a forward of one chunk with a backward of
        # the other, which needs 2 pp micro-batches in flight on the first rank.
        raise ValueError(
            f"The 'dualpipev' schedule needs at least 2 x pp = {2 * pp} micro-batches "
            f"(grad_accum_steps={m}). Use {2 * pp} or more.")


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


def _dualpipev(pp: int, m: int, v: int) -> list[list[Action]]:
    return [dualpipev_rank(pp, m, r) for r in range(pp)]


def dualpipev_rank(pp: int, m: int, r: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI's V shape) on rank r: chunk 0 is stage
    r (going down), chunk 1 stage 2pp-1-r (coming back). The eight phases of DualPipe's own
    program, in torch.distributed.pipelining's ScheduleDualPipeV order; each F and B takes the
    next micro-batch of its chunk, and a W the oldest pending I (first in, first out)."""
    acts: list[Action] = []
    next_mb = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    pending_w: deque[tuple[int, int]] = deque()

    def forward(c: int, paired: bool = False) -> None:
        acts.append(Action("F", next_mb["F", c], c, paired))
        next_mb["F", c] += 1

    def backward(c: int, split: bool = False) -> None:
        mb = next_mb["B", c]
        next_mb["B", c] += 1
        acts.append(Action("I" if split else "B", mb, c))
        if split:
            pending_w.append((mb, c))

    def weight() -> None:
        if pending_w:
            mb, c = pending_w.popleft()
            acts.append(Action("W", mb, c))

    def together(c_forward: int, c_backward: int) -> None:
        forward(c_forward, paired=True)
        backward(c_backward)

    down = pp - r - 1  # ranks after this one
    for _ in range(2 * down):  # 1: the first chunk's warm-up
        forward(0)
    for _ in range(r + 1):  # 2: both chunks
        forward(0)
        forward(1)
    for _ in range(down):  # 3: I, W, F of the second chunk (zero bubble)
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(m - 2 * pp + r + 1):  # 4: the steady state, F0&B1 then F1&B0
        if i == 0 and r == pp - 1:
            # DualPipe runs these two apart on the last rank (a smaller bubble, its authors
            # note: the B1's gradient is the first to come back, and waits for nothing else).
            forward(0)
            backward(1)
        else:
            together(0, 1)
        together(1, 0)
    for _ in range(down):  # 5: B1, then F1&B0
        backward(1)
        together(1, 0)
    split = False
    for i in range(r + 1):  # 6: B1, B0; the second half split into I and W
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(down):  # 7: W, I0
        weight()
        backward(0, split=True)
    while pending_w:  # 8: the remaining W's (r + 1 of them)
        weight()
    return acts


_BUILDERS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "afab": _afab, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zero_bubble": _zero_bubble,
    "dualpipev": _dualpipev,
}


def build_schedule(name: str, pp: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """For each pipeline rank, its ordered compute actions (F, B, I, W) for one training step."""
    validate_schedule(name, pp, num_microbatches, virtual_stages)
    return _BUILDERS[name](pp, num_microbatches, virtual_stages)


# --------------------------------------------------------------------------------------------
# Dependencies, communication, and proof of a valid program


def dependencies(rank: int, action: Action, pp: int, v: int,
                 placement: str = "loop") -> list[tuple[int, Action]]:
    """The (rank, compute action) pairs that must finish before `action` on `rank` can start."""
    stage, last = stage_of(rank, action.chunk, pp, placement), pp * v - 1
    mb = action.microbatch
    if action.kind == "F":
        if stage == 0:
            return []
        r, c = owner_of(stage - 1, pp, placement)
        return [(r, Action("F", mb, c))]
    if action.kind in ("B", "I"):
        deps = [(rank, Action("F", mb, action.chunk))]
        if stage < last:
            r, c = owner_of(stage + 1, pp, placement)
            # The gradient comes from whichever of B or I the next stage runs; the caller's
            # program decides, so both are named and `play` picks the one present.
            deps.append((r, Action("B", mb, c)))
            deps.append((r, Action("I", mb, c)))
        return deps
    if action.kind == "W":
        return [(rank, Action("I", mb, action.chunk))]
    raise ValueError(f"{action} is a communication action; it has no compute dependencies")


def units(program: list[Action]) -> list[list[Action]]:
    """The program's compute actions in what runs as one: a paired forward with its backward,
    every other action alone. Raises ValueError where a paired forward is not followed by a
    backward (B) of another chunk or micro-batch."""
    acts = [a for a in program if a.is_compute]
    out, i = [], 0
    while i < len(acts):
        a = acts[i]
        if a.paired:
            b = acts[i + 1] if i + 1 < len(acts) else None
            if b is None or b.kind != "B" or (b.microbatch, b.chunk) == (a.microbatch, a.chunk):
                raise ValueError(f"{a} runs together with the action after it, which must be the "
                                 f"backward (B) of another micro-batch or chunk (got {b}).")
            out.append([a, b])
            i += 2
        else:
            out.append([a])
            i += 1
    return out


def play(programs: list[list[Action]], pp: int, v: int,
         on_action: Callable[[int, Action, list[tuple[int, Action]]], None] | None = None,
         placement: str = "loop") -> None:
    """Run the compute actions of all ranks in some order that respects every dependency.

    Each rank runs its list in sequence; a paired forward and its backward start together, once
    the inputs of both are there. `on_action(rank, action, deps)` is called for each action once
    its dependencies `deps` (those present in the programs) have been called (for a pair: the F,
    then the B). Raises PipelineDeadlock, naming what every stuck rank waits for, if the programs
    cannot finish.
    """
    lists = [units(prog) for prog in programs]
    present = {(r, a) for r, prog in enumerate(lists) for unit in prog for a in unit}
    done: set[tuple[int, Action]] = set()
    pos = [0] * len(lists)

    def missing(r: int, unit: list[Action]) -> list[tuple[int, Action]]:
        return [d for a in unit for d in dependencies(r, a, pp, v, placement)
                if d in present and d not in done]

    progressed = True
    while progressed:
        progressed = False
        for r, prog in enumerate(lists):
            while pos[r] < len(prog) and not missing(r, unit := prog[pos[r]]):
                for a in unit:
                    if on_action is not None:
                        on_action(r, a, [d for d in dependencies(r, a, pp, v, placement)
                                         if d in present])
                    done.add((r, a))
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(prog) for r, prog in enumerate(lists)):
        stuck = []
        for r, prog in enumerate(lists):
            if pos[r] < len(prog):
                unit = prog[pos[r]]
                waits = [f"{b} on rank {q}" for q, b in missing(r, unit)]
                stuck.append(f"rank {r} at {''.join(map(str, unit))} waits for "
                             f"{', '.join(waits)}")
        raise PipelineDeadlock("Pipeline programs deadlock: " + "; ".join(stuck))


def check_program(programs: list[list[Action]], pp: int, num_microbatches: int,
                  virtual_stages: int = 1, placement: str = "loop") -> None:
    """Raise ValueError unless `programs` is a complete, deadlock-free pipeline step.

    Complete: every rank runs, for each micro-batch and local chunk, exactly one F and either one B
    or one I and one W, with F before its B/I and I before its W; a paired F is followed by a B.
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
    play(programs, pp, v, placement=placement)


def add_communication(programs: list[list[Action]], pp: int, virtual_stages: int = 1,
                      placement: str = "loop") -> list[list[Action]]:
    """The programs with their point-to-point transfers written out.

    Each RECV sits just before the compute that consumes it and each SEND just after the compute
    that produces it; the peer follows from the stage (`peer_of`). A paired forward and backward
    receive both inputs before them and send both outputs after. Runs of adjacent transfers are
    meant to be posted together as one batch of asynchronous sends and receives. Neighbouring
    stages on the same rank (dualpipev's middle) exchange nothing: the executor hands the tensor
    over.
    """
    last = pp * virtual_stages - 1

    def crosses(r: int, stage: int, other: int) -> bool:
        return 0 <= other <= last and owner_of(other, pp, placement)[0] != r

    def receives(r: int, a: Action) -> list[Action]:
        stage = stage_of(r, a.chunk, pp, placement)
        if a.kind == "F" and crosses(r, stage, stage - 1):
            return [Action("RECV_F", a.microbatch, a.chunk)]
        if a.kind in ("B", "I") and crosses(r, stage, stage + 1):
            return [Action("RECV_B", a.microbatch, a.chunk)]
        return []

    def sends(r: int, a: Action) -> list[Action]:
        stage = stage_of(r, a.chunk, pp, placement)
        if a.kind == "F" and crosses(r, stage, stage + 1):
            return [Action("SEND_F", a.microbatch, a.chunk)]
        if a.kind in ("B", "I") and crosses(r, stage, stage - 1):
            return [Action("SEND_B", a.microbatch, a.chunk)]
        return []

    out = []
    for r, prog in enumerate(programs):
        acts: list[Action] = []
        for unit in units(prog):
            for a in unit:
                acts += receives(r, a)
            acts += unit
            for a in unit:
                acts += sends(r, a)
        out.append(acts)
    return out


def peer_of(rank: int, action: Action, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(peer rank, peer local chunk) of a communication action."""
    if action.kind not in COMM_KINDS:
        raise ValueError(f"{action} is not a communication action")
    stage = stage_of(rank, action.chunk, pp, placement)
    other = stage + 1 if action.kind in ("SEND_F", "RECV_B") else stage - 1
    return owner_of(other, pp, placement)
