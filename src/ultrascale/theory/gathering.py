"""ZeRO-3's gathering (parallel/zero3.py) replayed over a pipeline rank's program: the most
parameter bytes the rank holds gathered at once, and the bytes it all-gathers in a step.

The engine gathers a unit (the embedding, a layer, the final norm with the head) before its
forward and prefetches the next unit of the rank's chain (its chunks' units end to end); after the
forward it frees the unit again (`micro_batch`), and the unit's backward gathers it once more,
prefetching the unit before it; a bucket of the unit is freed when all its gradients are in: at
the end of its backward, or, where the schedule splits the backward (zero_bubble, dualpipev), at
the weight-gradient pass W for the layers' linears (their input-gradient pass I leaves the weights
gathered). A unit whose first module does not hold all its parameters (the head, used after the
final norm returns; a tied embedding merged with it) is gathered once and kept to the end of the
step on a pipeline stage. `step` frees nothing until the step ends: each unit is gathered once
and the whole stage held. Which of these overlap depends on the schedule's order, so the figures
come from replaying the rank's program (O(m v units), cached); tests/test_pipeline_dualpipev.py
holds them against the engine's counted all-gathers and `peak_gathered_bytes`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ultrascale.params import dense_layers_in, layer_params, mtp_rank_params
from ultrascale.parallel.pipeline.schedules import build_schedule, placement_of, stage_of
from ultrascale.rules import layers_per_stage


@dataclass(frozen=True)
class Unit:
    """What ZeRO-3 gathers together: its buckets' (bytes, whether their gradients wait for the
    W pass), and whether its first module holds all of it (`covered`: freed after its
    forward)."""

    buckets: tuple[tuple[float, bool], ...]
    covered: bool = True


@dataclass(frozen=True)
class Gathering:
    """A rank's ZeRO-3 gathering over one step."""

    peak: float  # most bytes held gathered at once
    forward: float  # bytes all-gathered by forward hooks (the gathers and their prefetches)
    backward: float  # ... by backward hooks
    calls_forward: int  # bucket all-gathers
    calls_backward: int

    @property
    def total(self) -> float:
        return self.forward + self.backward


def rank_units(model, lay, rank: int, layers: int, first: int, embedding: bool, head: bool,
               whole_kv: bool, elem_bytes: int) -> tuple[tuple[Unit, ...], tuple[tuple, ...]]:
    """(the units, each chunk's units in chain order by index) of pipeline rank `rank` holding
    `layers` layers from global layer `first` (its chunks' layers as `rules.layers_per_stage`
    splits them, unless the rank's total differs: then evenly), and the ends it holds.
    Bytes are the rank's (tp, ep) shares of the parameters at `elem_bytes` each."""
    v, pp = lay.pp_virtual_stages, lay.pp
    placement = placement_of(lay.pp_schedule)
    stages = [stage_of(rank, c, pp, placement) for c in range(v)]
    split = layers_per_stage(model.num_layers, pp * v)
    counts = [split[s] for s in stages]
    starts = [sum(split[:s]) for s in stages]
    if sum(counts) != layers:  # a split of the rank's own (parallel.pp_layers)
        counts = [layers // v + (c >= v - layers % v) for c in range(v)]
        starts = [first + sum(counts[:c]) for c in range(v)]
    dense, expert = layer_params(model, lay.tp, lay.ep, whole_kv)
    plain, _ = layer_params(model, lay.tp, lay.ep, whole_kv, moe=False)
    emb = -(-model.vocab_size // lay.tp) * model.hidden_size * elem_bytes
    h = model.hidden_size * elem_bytes
    moe_layer = Unit(((dense * elem_bytes, True),) + (((expert * elem_bytes, False),)
                                                      if expert else ()))
    dense_layer = Unit(((plain * elem_bytes, True),))
    units: list[Unit] = []
    chunks = []
    merged = embedding and head and model.tie_embeddings  # one copy, gathered with the norm
    ends = Unit(((emb + h, False),) + (_mtp_buckets(model, lay, embedding, whole_kv, elem_bytes)
                                       if head else ()), covered=False)
    for c in range(v):
        chain = []
        if embedding and stages[c] == 0:
            units.append(ends if merged else Unit(((emb, False),)))
            chain.append(len(units) - 1)
        n_dense = dense_layers_in(model, starts[c], counts[c])
        for i in range(counts[c]):
            units.append(dense_layer if i < n_dense else moe_layer)
            chain.append(len(units) - 1)
        if head and stages[c] == pp * v - 1:
            if merged:
                chain.append(0)
            else:
                units.append(ends)
                chain.append(len(units) - 1)
        chunks.append(tuple(chain))
    return tuple(units), tuple(chunks)


def _mtp_buckets(model, lay, embedding: bool, whole_kv: bool, elem_bytes: int) -> tuple:
    """Multi-token prediction's modules, gathered with the head (models/mtp.py: they run
    outside module calls, so ZeRO-3 gathers them with the head for the loss's backward): their
    norms, projection and block, and the embedding copy their tokens are embedded with where
    the rank holds none (params.py `stage_params`)."""
    mtp = getattr(model, "mtp_layers", 0)
    if not mtp:
        return ()
    own, experts = (mtp * n for n in mtp_rank_params(model, lay.tp, lay.ep, whole_kv))
    if not model.tie_embeddings and not embedding:
        own += -(-model.vocab_size // lay.tp) * model.hidden_size
    return ((own * elem_bytes, False),) + (((experts * elem_bytes, False),) if experts else ())


def gathering(schedule: str, pp: int, m: int, v: int, rank: int, units: tuple[Unit, ...],
              chunks: tuple[tuple[int, ...], ...], per_step: bool) -> Gathering:
    """`replay`'s figures, in time independent of m. Gathered once a step, every bucket is
    gathered by the first forward and held: the stage. Else past the warm-up each group of pp
    micro-batches repeats the same hooks (tests/test_gathering.py checks it against the full
    replay): two replays, of 2pp + m mod pp and pp more micro-batches, give the peak and, by
    linear extension, the bytes and calls."""
    if per_step:
        every = [nbytes for u in set(u for c in chunks for u in c) for nbytes, _ in
                 units[u].buckets]
        return Gathering(sum(every), sum(every), 0.0, len(every), 0)
    if m <= 3 * pp:
        return replay(schedule, pp, m, v, rank, units, chunks, False)
    m_a = 2 * pp + m % pp
    a = replay(schedule, pp, m_a, v, rank, units, chunks, False)
    b = replay(schedule, pp, m_a + pp, v, rank, units, chunks, False)
    k = (m - m_a) // pp
    return Gathering(b.peak, a.forward + k * (b.forward - a.forward),
                     a.backward + k * (b.backward - a.backward),
                     a.calls_forward + k * (b.calls_forward - a.calls_forward),
                     a.calls_backward + k * (b.calls_backward - a.calls_backward))


@lru_cache(maxsize=4096)
def replay(schedule: str, pp: int, m: int, v: int, rank: int, units: tuple[Unit, ...],
           chunks: tuple[tuple[int, ...], ...], per_step: bool) -> Gathering:
    """Play `rank`'s program of `schedule` with ZeRO-3's hooks (the module docstring)."""
    chain = [u for c in chunks for u in c]
    offsets = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
    bwd_prev = {u: chain[i - 1] if i else None for i, u in enumerate(chain)}  # last place wins
    full: set[tuple[int, int]] = set()  # (unit, bucket) gathered now
    sums = {"held": 0.0, "peak": 0.0, "F": 0.0, "B": 0.0, "calls_F": 0, "calls_B": 0}

    def gather(u: int | None, phase: str) -> None:
        for k, (nbytes, _) in enumerate(units[u].buckets if u is not None else ()):
            if (u, k) not in full:
                full.add((u, k))
                sums["held"] += nbytes
                sums["peak"] = max(sums["peak"], sums["held"])
                sums[phase] += nbytes
                sums["calls_" + phase] += 1

    def free(u: int, deferred: bool | None = None) -> None:
        """The unit's buckets (those whose gradients come in this pass: `deferred` True in W,
        False in I, None in B) freed, if the engine frees them."""
        if per_step or not units[u].covered:
            return
        for k, (nbytes, waits) in enumerate(units[u].buckets):
            if (u, k) in full and (deferred is None or waits == deferred):
                full.discard((u, k))
                sums["held"] -= nbytes

    for a in build_schedule(schedule, pp, m, v)[rank]:
        at = range(offsets[a.chunk], offsets[a.chunk] + len(chunks[a.chunk]))
        if a.kind == "F":
            for i in at:
                gather(chain[i], "F")
                gather(chain[i + 1] if i + 1 < len(chain) else None, "F")  # prefetch
                if units[chain[i]].covered:
                    free(chain[i])
        elif a.kind in ("B", "I"):
            for i in reversed(at):
                u = chain[i]
                if units[u].covered and not per_step:  # its output's gradient hook
                    gather(u, "B")
                    gather(bwd_prev[u], "B")
                free(u, None if a.kind == "B" else False)
        else:  # W: the deferred weight gradients arrive
            for i in reversed(at):
                free(chain[i], True)
    return Gathering(sums["peak"], sums["F"], sums["B"], sums["calls_F"], sums["calls_B"])
