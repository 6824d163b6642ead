"""What a term is, and what the two folds hand it.

A term is one dimension of the theory (`theory/terms.py` lists them). It answers two questions
about a layout, each with named parts:

- `stage_bytes(stage) -> Bytes`: what one rank of a pipeline stage holds because of this dimension
  (`memory.estimator.estimate` adds the terms' parts key by key, in the order of the list, and
  lets the pipeline's schedule say how many micro-batches of activations are held at the peak);
- `seconds(step) -> Seconds`: what one micro-batch costs on the costed rank (per layer, on the
  rank with the output head, on the rank with the embedding, per pipeline chunk, once), and
  `after_step(step, backward_matmul)` what the step costs after the last micro-batch
  (`planner.cost.predict` adds them up, overlaps waits with device work and runs the schedule).

Besides, a term may say what each parameter costs it (`param_bytes`: precision and the
optimizer), which the data-parallel term turns into what a rank holds under ZeRO.

A hook a term leaves out adds nothing. `Stage` and `Step` carry what several terms read, derived
once per stage or per prediction. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ultrascale.layout import Layout
from ultrascale.theory.implementation import Implementation
from ultrascale.theory.shape import ModelShape, Shape

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware
    from ultrascale.theory.attention import Attention
    from ultrascale.theory.pipeline import Schedule


# ------------------------------------------------------------------------------------------------
# Bytes


@dataclass
class ParamBytes:
    """Bytes each parameter costs of each kind (kept whole before ZeRO), and what each element of
    a matrix that Muon steps changes of the optimizer state."""

    params: float = 0
    grads: float = 0
    optimizer: float = 0
    matrix_optimizer: float = 0

    def __add__(self, other: "ParamBytes") -> "ParamBytes":
        return ParamBytes(self.params + other.params, self.grads + other.grads,
                          self.optimizer + other.optimizer,
                          self.matrix_optimizer + other.matrix_optimizer)


@dataclass
class Bytes:
    """What one term adds to one rank of a pipeline stage, by named part (bytes).

    Activations are of ONE micro-batch; the schedule multiplies them by the micro-batches held:
    `layers` (saved by the stage's layers) and `chunk` (once per chunk's forward) by those the
    stage holds, `edge` (the first or last chunk's own) by those held in that chunk. `deferred`:
    what one micro-batch keeps between its input-gradient and weight-gradient passes (zero
    bubble). `once`: held once, whatever the micro-batches; `transient`: exists only while used.
    `comm`: buffers during forward/backward; `step_comm`: during the optimizer step (a part in
    both is kept from step to step)."""

    params: float = 0
    grads: float = 0
    optimizer: float = 0
    experts: dict[str, float] = field(default_factory=dict)  # routed experts' share of the three
    layers: dict[str, float] = field(default_factory=dict)
    edge: dict[str, float] = field(default_factory=dict)
    chunk: dict[str, float] = field(default_factory=dict)
    deferred: float = 0
    once: dict[str, float] = field(default_factory=dict)
    transient: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    step_comm: dict[str, float] = field(default_factory=dict)
    # Gradients held at the forward/backward peak when fewer than `grads` (None: all of them).
    fb_grads: float | None = None
    # What the gradient norm holds while it runs, after the backward and apart from the optimizer
    # step's buffers (the larger of the two counts).
    norm: float = 0
    # Held at the end of the backward beside the states and the larger transient, once the
    # activations are gone (ZeRO-1's reduced shards awaiting the step): a third point of the
    # forward/backward phase.
    late: dict[str, float] = field(default_factory=dict)
    # Buffers that exist once a micro-batch's backward has run (ZeRO-2's and ZeRO-3's whole
    # gradients before their reduce-scatter), counted in `comm` only as far as they exceed what
    # they meet there: where every forward of the rank precedes its first backward
    # (all-forward-all-backward), one micro-batch's activations fewer than the peak
    # (memory/estimator.py's `_fold`).
    after_first_backward: dict[str, float] = field(default_factory=dict)


def add_bytes(terms: list[Bytes | None]) -> Bytes:
    """The terms' bytes added part by part, key by key, in the order given (None: nothing)."""
    out = Bytes()
    for b in terms:
        if b is None:
            continue
        out.params += b.params
        out.grads += b.grads
        out.optimizer += b.optimizer
        out.deferred += b.deferred
        out.norm = max(out.norm, b.norm)
        if b.fb_grads is not None:
            out.fb_grads = (out.fb_grads or 0) + b.fb_grads
        # Each part by name, written out: the planner adds these for every layout it ranks.
        if b.experts:
            add_into(out.experts, b.experts)
        if b.layers:
            add_into(out.layers, b.layers)
        if b.edge:
            add_into(out.edge, b.edge)
        if b.chunk:
            add_into(out.chunk, b.chunk)
        if b.once:
            add_into(out.once, b.once)
        if b.transient:
            add_into(out.transient, b.transient)
        if b.comm:
            add_into(out.comm, b.comm)
        if b.step_comm:
            add_into(out.step_comm, b.step_comm)
        if b.late:
            add_into(out.late, b.late)
        if b.after_first_backward:
            add_into(out.after_first_backward, b.after_first_backward)
    return out


def add_into(total: dict, part: dict) -> None:
    """`part` added into `total` key by key (a key new to `total` keeps its place in `part`)."""
    if total.keys().isdisjoint(part):  # the usual case: parts no other term names
        total.update(part)
        return
    for k, v in part.items():
        total[k] = total[k] + v if k in total else v


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer (dense MLP, or MoE): its sizes, saved parts (under the layout's
    recompute) and the bytes one layer rebuilds under full recomputation; `whole`: its saved
    parts without recomputation."""

    shape: Shape
    parts: dict
    full: int
    whole: dict


@dataclass
class Stage:
    """One pipeline rank as the memory fold sees it: the model, the layout, the implementation,
    which layers the rank holds and of which kinds, and the attention and schedule the model
    and layout use. Built once per stage."""

    model: ModelShape
    layout: Layout
    impl: Implementation
    attention: "Attention"  # the model's (`terms.attention_of`)
    schedule: "Schedule"  # the layout's (`terms.schedule_of`)
    index: int  # the pipeline rank
    layers: int  # layers it holds
    first: int  # global index of its first layer (interleaved chunks taken as one run)
    kinds: dict[str, LayerKind]
    count: dict[str, int]  # its layers of each kind
    present: list[str]  # the kinds it holds layers of
    shape: Shape  # the sizes of its layers (of an MoE layer where it holds one)
    norm: int  # one RMSNorm's saved bytes in a dense layer (what the final norm keeps)
    dense_params: int  # parameters it owns before ZeRO: dense, routed experts, its largest layer
    expert_params: int
    largest_layer: int
    embedding: bool  # it holds the embedding (the first stage)
    head: bool  # it holds the final norm, the output head and the loss (the last stage)
    param_bytes: ParamBytes = field(default_factory=ParamBytes)


# ------------------------------------------------------------------------------------------------
# Seconds


@dataclass
class Pass:
    """Seconds by breakdown key: device time of the forward, of the backward, and waits (host
    work, collective latencies: counted in each pass, overlapping its device time as far as
    `Hardware.host_overlap` says)."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)


@dataclass
class Carried:
    """What one unit puts on a pipeline rank in series (the cost-balanced split and time-shared
    cores weigh ranks with it): device seconds forward and backward, and transfers and waits of
    both passes together (half counted in each)."""

    forward: float = 0.0
    backward: float = 0.0
    comm: float = 0.0
    waits: float = 0.0


UNITS = ("layer", "head", "embedding", "chunk", "once")


@dataclass
class Seconds:
    """One term's seconds of one micro-batch on one rank: per layer it holds, on the rank with
    the output head, on the rank with the embedding, per pipeline chunk, and once (`Pass`), and
    what each unit carries in series (`Carried`: per layer, head, embedding, once)."""

    layer: Pass | None = None
    head: Pass | None = None
    embedding: Pass | None = None
    chunk: Pass | None = None
    once: Pass | None = None
    carried: dict[str, Carried] = field(default_factory=dict)  # by unit


@dataclass(frozen=True)
class Placement:
    """What the costed pipeline rank holds: its layers, the output head (1 or 0), the embedding
    (1 or 0), its chunks, what the schedule's fill and drain gain when the other ranks are
    lighter, and which rank it is."""

    layers: int
    with_head: float
    with_embedding: float
    chunks: int = 1
    fill_gain: float = 0.0
    rank: int = 0

    def counts(self) -> tuple[float, ...]:
        """How often the rank holds each unit (`UNITS` order)."""
        return self.layers, self.with_head, self.with_embedding, self.chunks, 1


@dataclass
class Step:
    """What every term's seconds read, derived once per prediction."""

    model: ModelShape
    lay: Layout
    hardware: "Hardware"  # the job's profile (`Hardware.for_job`)
    hw: "Hardware"  # as one rank sees it (`rates.rank_hardware`)
    impl: Implementation
    attention: "Attention"
    schedule: "Schedule"
    share: float  # the cores a rank computes on (`rates.rank_share`)
    alone: float
    sh: Shape
    layer: dict[str, float]  # one block's times (`block.block_times`)
    head_f: float  # the output head's forward GEMM (vocabulary-parallel over tp)
    ce: float  # the cross-entropy's memory traffic, forward plus backward
    params: float  # parameters of a rank of the busiest stage (`pipeline.busiest_params`)
    layers: int  # layers of the rank holding the most of them
    # Layers of each of the pp x v stages: the config's `parallel.pp_layers`, else the engine's
    # split (`pipeline.stage_split`).
    split: tuple[int, ...] = ()
    split_given: bool = False  # whether `split` is not the engine's own (a config must list it)


@dataclass(frozen=True)
class Term:
    """One dimension: its hooks (each optional)."""

    name: str
    stage_bytes: Callable[[Stage], Bytes | None] | None = None  # None: nothing for this stage
    param_bytes: Callable[[Stage], ParamBytes] | None = None
    seconds: Callable[[Step], Seconds | None] | None = None  # None: nothing for this layout
    after_step: Callable[[Step, float], dict[str, float]] | None = None
