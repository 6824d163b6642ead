"""Pipeline parallelism (parallel/pipeline/): which layers each rank holds, how many micro-batches
of activations its schedule keeps at its peak, and what the schedule's bubble costs.

The pipeline is the part of both folds that turns one micro-batch into a step:

- bytes: `Schedule.held` says how many micro-batches of a stage's activations its rank holds at
  its peak (closed forms: the pipeline simulator replays each schedule action by action, in time
  proportional to pp x m x v, and tests/test_estimator.py checks the two agree over a grid), and
  the term adds the send/receive buffers;
- seconds: the term adds each chunk's point-to-point transfers; `placement` picks the rank the
  prediction costs (its layers, and whether it holds the head or the embedding) and
  `step_total` runs the m micro-batches through the schedule (simulated, the bubble included).

A schedule is a `Schedule` (its closed forms of the micro-batches held, the ranks holding the
embedding and the head); another one is one more file with a subclass, listed in
`terms.SCHEDULES`. Torch-free (the simulator is the engine's own torch-free replay).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ultrascale.layout import Layout, storage_bytes
from ultrascale.parallel.pipeline.schedules import (build_schedule, dependencies, owner_of,
                                                    placement_of, stage_of)
from ultrascale.parallel.pipeline.simulator import simulate
from ultrascale.theory.rates import p2p_time
from ultrascale.theory.stages import (  # (where the split lives; re-exported for the callers)
    busiest_params, busiest_stage_layers, cost_balanced_ranks, rank_layers,
    split_rank_layers, stage_split,
)
from ultrascale.theory.term import Bytes, Carried, Pass, Placement, Seconds, Stage, Step, Term

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware


# ------------------------------------------------------------------------------------------------
# Micro-batches held at the peak (bytes)


class Schedule:
    """A pipeline schedule as the theory sees it (1F1B's answers are the defaults)."""

    # Whether it runs weight-gradient passes after the input-gradient ones (the layers then say
    # what a deferred pass keeps: `block.deferred_weight_grad_layer`).
    defers_weight_gradients = False
    # How much of the lighter ranks' slack the schedule's fill and drain gain (`placement`):
    # all of it by the simulator replaying every rank with its own work, for the schedules
    # whose warm-up and cool-down pass each rank once (tests/test_pipeline_split.py).
    fill_gain_share = 1.0

    def __init__(self, name: str) -> None:
        self.name = name

    def in_flight(self, pp: int, m: int, v: int, rank: int) -> float:
        """Peak micro-batches held by `rank`, in whole-stage units (a chunk counts 1/v): 1F1B's
        pp-1-rank warm-up forwards, then one more."""
        return float(min(pp - rank, m))

    def edge_in_flight(self, pp: int, m: int, v: int, rank: int, held: float) -> float:
        """Micro-batches whose first-stage tensors (token ids, on rank 0) or last-stage tensors
        (the loss's, on rank pp-1) the rank holds at its peak: without virtual stages the
        stage's `held`."""
        return held

    def held(self, stage: Stage, per_micro_batch: float, deferred: float,
             edge: float = 0.0) -> tuple[float, float, int]:
        """(micro-batches held, of them in the edge chunk, micro-batches held past their input
        gradient pass only for a deferred weight-gradient pass) at the rank's peak;
        `per_micro_batch`: the stage's activation bytes of one micro-batch (`edge` of them the
        first or last chunk's own), `deferred`: what one keeps for its deferred pass."""
        lay = stage.layout
        held = in_flight(self, lay.pp, lay.grad_accum, lay.pp_virtual_stages, stage.index)
        if lay.pp == 1:
            return held, held, 0
        return held, self.edge_in_flight(lay.pp, lay.grad_accum, lay.pp_virtual_stages,
                                         stage.index, held), 0

    def ends(self, rank: int, pp: int) -> tuple[bool, bool]:
        """Whether pipeline rank `rank` holds (the embedding, the output head and loss)."""
        return rank == 0, rank == pp - 1

    def placement(self, step: Step, load: "Loads") -> Placement:
        """The pipeline rank the step time is costed on (`placement`)."""
        return placement(step, load)

    def step_total(self, step: Step, load: "Loads", at: Placement, t_f: float,
                   t_b: float, parts: tuple[dict, dict] | None = None) -> float:
        """The m micro-batches through the schedule (`step_total`). `parts`: the stage's
        (forward, backward) seconds by breakdown key, which t_f and t_b sum."""
        return step_total(step, load, at, t_f, t_b)

    def hidden(self, step: Step, parts: tuple[dict, dict], at: Placement) -> dict[str, float]:
        """Seconds of each breakdown key the schedule hides on the costed rank `at` over a step
        (work that `step_total` no longer runs in series): none, but under dualpipev."""
        return {}

    def peak_candidates(self, pp: int) -> list[int]:
        """The ranks that may hold the most with the layers split evenly: every schedule's
        in-flight count is non-increasing in the rank and a middle rank holds no embedding, so
        the first or the last."""
        return sorted({0, pp - 1})


class AllForwardAllBackward(Schedule):
    def in_flight(self, pp: int, m: int, v: int, rank: int) -> float:
        return float(m)


class Interleaved(Schedule):
    """Megatron's interleaved 1F1B over v chunks per rank."""

    def in_flight(self, pp: int, m: int, v: int, rank: int) -> float:
        # Megatron's warm-up: 2 per downstream rank plus the first pass over chunks 0..v-2,
        # then one more forward before the first backward.
        chunks = min(2 * (pp - 1 - rank) + (v - 1) * pp + 1, m * v)
        return chunks / v

    def edge_in_flight(self, pp: int, m: int, v: int, rank: int, held: float) -> float:
        """With virtual stages only the micro-batches in flight in the first (rank 0) or the last
        (rank pp-1) chunk count. Megatron's interleaved order runs each last chunk's backward
        right after its forward on the last rank, so it holds one; rank 0 has pushed chunk 0 of
        two rounds of pp micro-batches when its backwards start (tests/test_estimator.py replays
        the schedules)."""
        if v == 1:
            return held
        if rank == pp - 1:
            return 1.0
        return float(min(2 * pp, m)) if rank == 0 else held


class ZeroBubble(Schedule):
    """ZB-H1 (parallel/pipeline/stage.py): each weight-gradient (W) pass deferred by `rank`
    steps; an input-gradient (I) pass frees what only it needed, the W pass still needs each
    linear's input and output gradient."""

    defers_weight_gradients = True
    # Its deferred W passes already fill the bubbles the lighter ranks' slack would: against the
    # replay, half the slack is gained (within 2.1% on 150 seeded loads; all of it would be up
    # to 8.3% fast: benchmarks/fill_gain_vs_replay.py).
    fill_gain_share = 0.5

    def in_flight(self, pp: int, m: int, v: int, rank: int) -> float:
        return float(min(pp, m))  # every rank peaks at pp

    def held(self, stage: Stage, per_micro_batch: float, deferred: float,
             edge: float = 0.0) -> tuple[float, float, int]:
        lay = stage.layout
        if lay.pp == 1 or stage.impl.activations != "tensors":
            return super().held(stage, per_micro_batch, deferred)
        held, n_deferred = max(zero_bubble_states(lay.pp, lay.grad_accum, stage.index),
                               key=lambda s: s[0] * per_micro_batch + s[1] * deferred)
        return held, held, n_deferred


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


BUILT_IN = {s.name: s for s in (AllForwardAllBackward("afab"), Schedule("1f1b"),
                                Interleaved("interleaved"), ZeroBubble("zero_bubble"))}


@lru_cache(maxsize=65536)
def in_flight(schedule: Schedule, pp: int, m: int, v: int, rank: int) -> float:
    """`schedule.in_flight`, and 1 without a pipeline: gradient accumulation runs each
    micro-batch's backward right after its forward, whatever schedule the layout names."""
    return 1.0 if pp == 1 else schedule.in_flight(pp, m, v, rank)


def closed_form_in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Peak micro-batches held by `rank` of a built-in schedule, by name (the tests' door)."""
    return in_flight(BUILT_IN[schedule], pp, m, v, rank)


def edge_in_flight(schedule: str, pp: int, m: int, v: int, rank: int, held: float) -> float:
    """`Schedule.edge_in_flight` of a built-in schedule, by name (1 rank: `held`)."""
    return held if pp == 1 else BUILT_IN[schedule].edge_in_flight(pp, m, v, rank, held)


def stage_bytes(stage: Stage) -> Bytes | None:
    """An activation in and a gradient out."""
    if stage.layout.pp == 1:
        return None
    x = stage.shape
    res = x.b * x.s * x.h // (x.tp if x.sp else 1)
    return Bytes(comm={"pipeline send/recv": 2 * res * x.act})


# ------------------------------------------------------------------------------------------------
# Which rank is costed, and the schedule's time (seconds)


def pp_crosses_nodes(lay: Layout, hw: "Hardware") -> bool:
    """Whether neighbouring pipeline stages sit on different nodes (pp is outermost)."""
    return lay.pp > 1 and lay.tp * lay.cp * lay.dp >= hw.devices_per_node


@lru_cache(maxsize=1024)
def transfers(schedule: str, pp: int, v: int, rank: int) -> tuple[int, int]:
    """(sent, received) activations or gradients of one micro-batch on pipeline rank `rank`: each
    of its chunks sends its activation to the next stage and its gradient to the one before, and
    receives theirs, unless that stage is on the same rank (dualpipev's turn) or there is none."""
    placement, last = placement_of(schedule), pp * v - 1
    n = sum(0 <= other <= last and owner_of(other, pp, placement)[0] != rank
            for c in range(v) for other in (stage_of(rank, c, pp, placement) + d
                                            for d in (-1, 1)))
    return n, n  # each boundary crossed is one send and one receive each way


def p2p_bytes_per_step(lay: Layout, rank: int, activation_bytes: float) -> float:
    """Bytes pipeline rank `rank` sends in a step (as many it receives): what
    distributed/comm.py counts (tests/test_pipeline_dualpipev.py)."""
    if lay.pp == 1:
        return 0.0
    return transfers(lay.pp_schedule, lay.pp, lay.pp_virtual_stages, rank)[0] * lay.grad_accum \
        * activation_bytes


def p2p_per_chunk(step: Step) -> float:
    """One chunk's share of a micro-batch's transfers, sent and received, on the rank holding the
    head (the costed one: `placement`; under a cost-balanced split its chunk's share too), each
    a `p2p_time` (crossing nodes when the inner dimensions fill one). The last stage of a plain
    pipeline takes an activation in and sends a gradient out; dualpipev's rank 0 twice that
    over its two chunks; an interleaved last rank four for every chunk but the last."""
    lay = step.lay
    if lay.pp == 1:
        return 0.0
    head_rank = next(r for r in range(lay.pp) if step.schedule.ends(r, lay.pp)[1])
    sent, received = transfers(lay.pp_schedule, lay.pp, lay.pp_virtual_stages, head_rank)
    return (sent + received) * p2p_one(step) / lay.pp_virtual_stages


def p2p_one(step: Step) -> float:
    """One micro-batch's activation (or its gradient) between two stages."""
    lay, sh = step.lay, step.sh
    act = sh.tokens * sh.h * storage_bytes(lay.dtype) / (lay.tp if lay.sequence_parallel else 1)
    return p2p_time(step.hw, act, crosses_node=pp_crosses_nodes(lay, step.hw))


def seconds(step: Step) -> Seconds | None:
    """Each chunk's transfers, half in each pass (the bubble is the schedule's: `step_total`)."""
    if step.lay.pp == 1:
        return None
    p2p = p2p_per_chunk(step)
    return Seconds(chunk=Pass({"pp_p2p": p2p / 2}, {"pp_p2p": p2p / 2}))


@dataclass(frozen=True)
class Loads:
    """One micro-batch through one layer, the output head, the embedding, and once, everything
    in series: what a pipeline rank carries (the cost-balanced split and time-shared cores)."""

    layer_f: float
    layer_b: float
    head_f: float
    head_b: float
    embedding: float
    once_f: float
    once_b: float


def loads(parts: list[Seconds]) -> Loads:
    """The terms' carried seconds added unit by unit: device time of each pass plus half of the
    transfers and waits of both."""
    layer, head, emb, once = Carried(), Carried(), Carried(), Carried()
    sums = {"layer": layer, "head": head, "embedding": emb, "once": once}
    for part in parts:
        for unit, c in part.carried.items():
            total = sums[unit]
            total.forward += c.forward
            total.backward += c.backward
            total.comm += c.comm
            total.waits += c.waits
    return Loads(layer.forward + (layer.comm + layer.waits) / 2,
                 layer.backward + (layer.comm + layer.waits) / 2,
                 head.forward + (head.comm + head.waits) / 2,
                 head.backward + (head.comm + head.waits) / 2,
                 emb.forward + emb.backward + emb.comm + emb.waits, once.forward, once.backward)


def placement(step: Step, load: Loads) -> Placement:
    """The rank the prediction costs: the busiest, from what each rank holds (its layers, the
    output head, the embedding) at the loads of one micro-batch. The stages are split as the
    layout says (`Step.split`), or by cost where the implementation splits so (nanotron).

    Where the split is not the engine's own, the schedule's fill and drain pass through the
    lighter ranks at their own pace (`fill_gain`): a 1F1B step is about m - 1 passes of the
    busiest rank plus one of every rank (against the simulator run with each rank's own work:
    tests/test_pipeline_split.py; `Schedule.fill_gain_share`). Under the engine's split, where
    the ranks differ by the head alone, none is counted: the H100 constants were fitted without
    it (benchmarks/planner_notes.md, "The costed pipeline rank")."""
    lay = step.lay
    v, pp = lay.pp_virtual_stages, lay.pp
    gains = step.split_given
    if pp > 1 and v == 1 and step.impl.pp_partition == "cost":
        gains = True
        holds = [(n, float(head), float(r == 0))
                 for r, (n, head) in enumerate(cost_balanced_ranks(step.model, pp))]
    else:
        layers = split_rank_layers(step.split, pp, lay.pp_schedule)
        ends = [step.schedule.ends(r, pp) for r in range(pp)]
        holds = [(n, float(last), float(first)) for n, (first, last) in zip(layers, ends)]
    times = [n * (load.layer_f + load.layer_b) + head * (load.head_f + load.head_b)
             + emb * load.embedding for n, head, emb in holds]
    busiest = max(range(pp), key=lambda r: (times[r], r))
    n, head, emb = holds[busiest]
    gain = step.schedule.fill_gain_share * (pp * times[busiest] - sum(times)) if gains else 0.0
    return Placement(n, head, emb, v, fill_gain=gain, rank=busiest)


def balanced_split(step: Step, load: Loads) -> tuple[int, ...]:
    """The layers of each stage that make the busiest rank least busy at these loads: every stage
    gets a layer, then each further layer goes to the rank it leaves least loaded (a rank's load:
    its layers, plus the head or the embedding where its stages hold them; a tie goes to the later
    rank, as the engine's split gives the last stages the extra layers). A rank's layers are
    spread evenly over its chunks, the later chunk taking the extra one. Thus the rank with the
    output head holds fewer layers when the head is heavy (a large vocabulary, an MTP module)."""
    lay, schedule = step.lay, step.schedule
    pp, v = lay.pp, lay.pp_virtual_stages
    if step.model.num_layers < pp * v:  # (refused by the rules: the engine's split stands)
        return step.split
    per_layer = load.layer_f + load.layer_b
    extra = [(load.head_f + load.head_b) * schedule.ends(r, pp)[1]
             + load.embedding * schedule.ends(r, pp)[0] for r in range(pp)]
    layers = [v] * pp
    # Each rank's load with one more layer, least first (ties: the later rank); only the rank
    # that takes a layer changes its key, so a heap picks what a scan of every rank would.
    heap = [((v + 1) * per_layer + extra[r], -r) for r in range(pp)]
    heapq.heapify(heap)
    for _ in range(step.model.num_layers - pp * v):
        _, neg = heapq.heappop(heap)
        layers[-neg] += 1
        heapq.heappush(heap, ((layers[-neg] + 1) * per_layer + extra[-neg], neg))
    split = [0] * (pp * v)
    placement = placement_of(lay.pp_schedule)
    for r, n in enumerate(layers):
        for c in range(v):
            split[stage_of(r, c, pp, placement)] = n // v + (c >= v - n % v)
    return tuple(split)


def step_total(step: Step, load: Loads, at: Placement, t_f: float, t_b: float) -> float:
    """The m micro-batches of stage times t_f, t_b through the schedule, the bubble included (on
    a CPU node whose ranks share its cores, simulated with each rank's own work)."""
    lay = step.lay
    m = lay.grad_accum
    if lay.pp > 1 and step.hardware.host_cores:
        return shared_pipeline_total(step, load)
    total = pipeline_time(lay.pp_schedule, lay.pp, m, lay.pp_virtual_stages, t_f, t_b)
    return max(m * (t_f + t_b), total - at.fill_gain)


def shared_pipeline_total(step: Step, load: Loads) -> float:
    """Ranks share the node's cores: simulate the schedule with each rank's own stages (layers,
    the embedding on the first, the head on the last: under dualpipev's V both on rank 0, each
    chunk its own stage's) and the cores divided among the ranks that have work at each moment,
    so that idle stages hand their cores to busy ones."""
    lay, hardware, share = step.lay, step.hardware, step.share
    v, pp = lay.pp_virtual_stages, lay.pp
    placement = placement_of(lay.pp_schedule)
    common_f, common_b = load.once_f, load.once_b  # transfers: delays below
    split = step.split

    def work(stages: list[int], n_chunks: int) -> tuple[float, float]:
        """Forward and backward core-seconds of these stages, taken as `n_chunks` of v."""
        n_layers = sum(split[s] for s in stages)
        emb = load.embedding / 2 if 0 in stages else 0.0
        head = pp * v - 1 in stages
        return (share * (n_layers * load.layer_f + common_f * n_chunks / v + emb
                         + (load.head_f if head else 0.0)),
                share * (n_layers * load.layer_b + common_b * n_chunks / v + emb
                         + (load.head_b if head else 0.0)))

    work_f, work_b = [], []
    for r in range(pp):
        stages = [stage_of(r, c, pp, placement) for c in range(v)]
        if placement == "loop":  # the rank's stages, in v equal chunks
            f, b = work(stages, v)
            work_f.append(f)
            work_b.append(b)
        else:  # each chunk its own stage's work
            chunks = [work([s], 1) for s in stages]
            work_f.append(tuple(f for f, _ in chunks))
            work_b.append(tuple(b for _, b in chunks))
    group = lay.tp * lay.cp
    ranks_on_node = min(lay.world_size, hardware.devices_per_node)
    cores = hardware.host_cores * pp * group / ranks_on_node  # one pipeline's share
    return shared_pipeline_time(lay.pp_schedule, pp, lay.grad_accum, v, tuple(work_f),
                                tuple(work_b), cores, step.alone, group, p2p_one(step))


@lru_cache(maxsize=4096)
def _simulated_total(schedule: str, pp: int, m: int, v: int, ratio: float) -> float:
    return float(simulate(schedule, pp, m, v=v, t_f=1.0, t_b=ratio).total_time)


def _pipeline_total_unit(schedule: str, pp: int, m: int, v: int, ratio: float) -> float:
    """Total time of the schedule with a stage forward of 1 and backward of `ratio` (the result
    scales linearly with the stage times).

    Past the warm-up every schedule runs in a steady state, so the total grows linearly with m: for
    long runs two shorter simulations (same m mod pp, so the schedule accepts them) extrapolate.
    """
    short = pp
    if m <= 2 * short:
        return _simulated_total(schedule, pp, m, v, ratio)
    m_a = short + m % pp
    m_b = m_a + pp
    t_a = _simulated_total(schedule, pp, m_a, v, ratio)
    t_b = _simulated_total(schedule, pp, m_b, v, ratio)
    return t_a + (m - m_a) * (t_b - t_a) / (m_b - m_a)


RATIO_STEP = 0.5  # grid of backward/forward ratios the simulator is run at


def pipeline_time(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
    """Total time of the schedule for stage times t_f, t_b (whole stage, all v chunks).

    The simulated total is piecewise linear in t_b / t_f, so it is simulated on a grid of ratios and
    interpolated: thousands of layouts then share a few dozen simulations.
    """
    if pp == 1:
        return m * (t_f + t_b)
    ratio = t_b / t_f
    lo = math.floor(ratio / RATIO_STEP) * RATIO_STEP
    hi = lo + RATIO_STEP
    t_lo = _pipeline_total_unit(schedule, pp, m, v, round(lo, 4))
    t_hi = _pipeline_total_unit(schedule, pp, m, v, round(hi, 4))
    return t_f * (t_lo + (t_hi - t_lo) * (ratio - lo) / RATIO_STEP)


@lru_cache(maxsize=1024)
def shared_pipeline_time(schedule: str, pp: int, m: int, v: int, work_f: tuple, work_b: tuple,
                         cores: float, threads: float, group: int = 1,
                         t_comm: float = 0.0) -> float:
    """Total time of a pipeline schedule whose ranks share `cores` (processor sharing).

    `work_f[r]`, `work_b[r]`: core-seconds of pipeline rank r's forward and backward of one
    micro-batch, all its chunks (split evenly among them), or a tuple of each chunk's. Each rank
    is a group of `group` processes (its tp x cp ranks) of `threads` threads; at every moment the
    processes of the ranks that can run (their previous action done, their inputs arrived) split
    the cores evenly, each getting at most its threads. With as many cores as processes this is
    the plain schedule; with fewer, a rank left alone in the warm-up or the drain runs faster,
    and imbalance between stages is paid only where the dependencies make the others wait. An
    input from another rank arrives `t_comm` after the action that produced it (a transfer: no
    core is used meanwhile). A forward paired with the backward after it (dualpipev) starts once
    both inputs are in, runs before it, and both outputs leave when the pair ends.
    """
    placement = placement_of(schedule)
    programs = [[a for a in prog if a.is_compute] for prog in build_schedule(schedule, pp, m, v)]
    present = {(r, a) for r, prog in enumerate(programs) for a in prog}

    def work(r: int, a) -> float:
        f, b = work_f[r], work_b[r]
        f, b = (f[a.chunk], b[a.chunk]) if isinstance(f, tuple) else (f / v, b / v)
        return {"F": f, "B": b, "I": b / 2, "W": b / 2}[a.kind]

    def deps_of(r: int, i: int) -> list:
        a = programs[r][i]
        deps = dependencies(r, a, pp, v, placement)
        if a.paired:  # the pair waits for its backward's inputs too
            deps = deps + [d for d in dependencies(r, programs[r][i + 1], pp, v, placement)
                           if d != (r, a)]
        return [d for d in deps if d in present]

    pos = [0] * pp
    done: dict = {}  # finished action -> when
    left: dict[int, float] = {}  # remaining work of the action each runnable rank is on
    now = 0.0
    while True:
        runnable, arrival = [], math.inf
        for r in range(pp):
            if pos[r] >= len(programs[r]):
                continue
            a = programs[r][pos[r]]
            deps = deps_of(r, pos[r])
            if not all(d in done for d in deps):
                continue
            ready = max([done[d] + (t_comm if d[0] != r else 0.0) for d in deps], default=0.0)
            if ready <= now + 1e-12:
                runnable.append(r)
                left.setdefault(r, work(r, a))
            else:
                arrival = min(arrival, ready)
        if not runnable:
            if arrival == math.inf:
                break
            now = arrival
            continue
        rate = min(threads, cores / (group * len(runnable)))
        dt = min(min(left[r] for r in runnable) / rate, arrival - now)
        now += dt
        for r in runnable:
            left[r] -= dt * rate
            if left[r] <= 1e-12 * (1 + dt * rate):
                _finish(programs[r], pos[r], r, now, done)
                pos[r] += 1
                del left[r]
    if any(pos[r] < len(programs[r]) for r in range(pp)):
        raise ValueError(f"schedule {schedule} with pp={pp}, m={m}, v={v} does not finish")
    return now


def _finish(program: list, i: int, r: int, now: float, done: dict) -> None:
    """Action i of rank r's program is over; a paired forward's output leaves with its
    backward's (it is marked done when the backward is)."""
    if program[i].paired:
        return
    done[(r, program[i])] = now
    if i and program[i - 1].paired:
        done[(r, program[i - 1])] = now


# ------------------------------------------------------------------------------------------------
# The step


TERM = Term("pipeline", stage_bytes=stage_bytes, seconds=seconds)
