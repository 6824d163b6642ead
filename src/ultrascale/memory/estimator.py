"""Per-device memory of a training layout, before any run: bytes of named tensors, most loaded rank.

`estimate(model, layout)` is a fold over the theory's terms (`theory/terms.py`): for a pipeline
stage, every term says what one rank of it holds because of its dimension (`term.Bytes`), the
terms' parts are added, and the layout's pipeline schedule says how many micro-batches of
activations the rank holds at its peak (`theory/pipeline.py`):

- parameters, gradients and optimizer state: the bytes per parameter that precision and the
  optimizer give (the playbook's 2+2+12 in mixed precision with Adam, +4 for an fp32 gradient
  accumulation buffer), divided by ZeRO over the dp_shard x cp ranks (`theory/data.py`), and by
  tp, pp and ep for the parameters each rank owns (`params.py`);
- activations at the peak of the pipeline schedule: the layers' saved tensors (`theory/block.py`,
  `attention.py`, `expert.py`) times the micro-batches in flight, the first and last stages' own
  (`ends.py`), what recomputation keeps and rebuilds (`recompute.py`), what zero bubble's deferred
  weight-gradient passes keep;
- communication buffers: each dimension's (`tensor.py`, `context.py`, `pipeline.py`,
  `expert.py`, `data.py`), and whatever the implementation keeps between steps.

Two phases peak separately: forward/backward (activations) and the optimizer step (ZeRO's gathered
parameters); the total is the larger, and the fields (params + grads + optimizer + activations +
comm_buffers + other) add up to it. `reserved` adds what PyTorch's caching allocator keeps on top
of memory that comes and goes within a step; the fits verdict compares it with the device.
Implementation choices that change which tensors exist (fused kernels, DDP's gradient buckets,
...) live in an `Implementation` (`theory/implementation.py`): `ULTRASCALE` is ours, `NANOTRON`
the runtime behind the playbook's H100 benchmarks, `PLAYBOOK` the playbook's formulas.
No torch import: the planner calls this for tens of thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ultrascale.layout import Layout
from ultrascale.params import dense_layers_in, stage_params
from ultrascale.rules import (fp8_expert_violations, layout_violations, schedule_violations,
                              value_violations)
from ultrascale.theory.attention import Attention
from ultrascale.theory.context import CP_ATTENTION_BACKWARD
from ultrascale.theory.block import layer_kinds
from ultrascale.theory.implementation import ULTRASCALE, Implementation, implementation
from ultrascale.theory.pipeline import Schedule, split_rank_layers
from ultrascale.theory.stages import rank_dense_layers
from ultrascale.theory.shape import ModelShape, model_shape
from ultrascale.theory.term import LayerKind, ParamBytes, Stage, add_bytes
from ultrascale.theory.data import (MTP_BLOCK_GRADS, ZERO2_BUCKETS, ZERO3_LAYER_BACKWARD,
                                    shard_group)
from ultrascale.theory.terms import TERMS, attention_of, schedule_of

GIB = 2**30


class LayoutError(ValueError):
    """A layout that cannot run this model, explained in one paragraph with the fix."""


@dataclass
class MemoryEstimate:
    """Bytes on the most loaded rank (or the rank asked for). `total` is the peak over the step."""

    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    other: int
    total: int
    rank_desc: str
    fits: bool | None
    device_memory: int | None
    stage: int
    phase: str  # which phase holds the peak: "forward/backward" or "optimizer step"
    phases: dict[str, int] = field(default_factory=dict)
    activation_parts: dict[str, int] = field(default_factory=dict)
    comm_parts: dict[str, int] = field(default_factory=dict)
    runtime: str = "ultrascale"
    activations_peak: int = 0  # the forward/backward peak, even when the optimizer step binds
    reserved: int = 0  # total plus the caching allocator's fragmentation; what `fits` compares
    # Of params, grads and optimizer, the bytes of routed-expert weights (E / ep experts of each
    # MoE layer, their ZeRO shards over edp): keys "params", "grads", "optimizer".
    experts: dict[str, int] = field(default_factory=dict)
    # Gradients held at the optimizer step (`grads` is what the peak holds, fewer where a runtime
    # starts its backward without them: `Implementation.grads_between_steps`).
    grads_step: int = 0
    # The activation parts that live only while something runs and that the peak meets: the
    # logits while the loss runs, or a layer backward's (its rebuilt layer, its workspace, ...).
    transient_parts: tuple[str, ...] = ()
    # Saved tensors the peak's moment no longer holds (a layer's backward comes after the loss's
    # backward has freed one micro-batch's loss tensors), by part.
    freed_parts: dict[str, int] = field(default_factory=dict)

    @property
    def saved_activations(self) -> int:
        """Activation bytes saved for backward at the end of the forward (what
        `saved_tensors_hooks`, e.g. memory/measure.py, sees): the peak less its transients, with
        what it had freed."""
        return (sum(v for k, v in self.activation_parts.items() if k not in self.transient_parts)
                + sum(self.freed_parts.values()))

    @property
    def steady(self) -> int:
        """Parameters, gradients and optimizer state: held all the time."""
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
            "activations": self.activations, "comm_buffers": self.comm_buffers,
            "other": self.other, "total": self.total, "rank_desc": self.rank_desc,
            "fits": self.fits, "device_memory": self.device_memory, "stage": self.stage,
            "phase": self.phase, "phases": dict(self.phases),
            "activation_parts": dict(self.activation_parts),
            "comm_parts": dict(self.comm_parts),
            "runtime": self.runtime, "activations_peak": self.activations_peak,
            "saved_activations": self.saved_activations,
            "reserved": self.reserved, "experts": dict(self.experts),
            "grads_step": self.grads_step,
            "total_gib": round(self.total / GIB, 3),
        }

    def format_table(self) -> str:
        from ultrascale.memory.report import format_table

        return format_table(self)


# ---------------------------------------------------------------------------------------------
# The layout's rules and its layers per stage


def check_layout(m: ModelShape, lay: Layout, pp_layers: tuple[int, ...] | None = None) -> None:
    """Raise LayoutError unless `lay` can run model `m` (`pp_layers`: layers per pipeline rank)."""
    bad = value_violations(lay)
    if not bad:
        bad = (layout_violations(m, lay, rank_layers=pp_layers) + schedule_violations(lay)
               + fp8_expert_violations(m, lay))
    if bad:
        raise LayoutError(bad[0].message)


def stage_layers(m: ModelShape, lay: Layout,
                 pp_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    if pp_layers is not None:
        return tuple(pp_layers)
    return (m.num_layers // lay.pp,) * lay.pp


# ---------------------------------------------------------------------------------------------
# The fold


def _stage(m: ModelShape, lay: Layout, impl: Implementation, layers: tuple[int, ...],
           index: int, kinds: dict[str, LayerKind], norm: int, attention: Attention,
           schedule: Schedule, dense: tuple[int, ...] | None = None) -> Stage:
    """Pipeline rank `index` as the terms see it (`dense`: each rank's dense-MLP layers, where
    its chunks lie apart; else its layers are taken as one run)."""
    first = sum(layers[:index])
    n_dense = dense_layers_in(m, first, layers[index]) if dense is None \
        else min(dense[index], layers[index])
    count = {"dense": n_dense, "moe": layers[index] - n_dense}
    present = [k for k in kinds if count[k]]
    embedding, head = schedule.ends(index, lay.pp)
    dense, expert, largest = stage_params(m, lay, layers[index], index, impl.whole_kv, first,
                                          embedding=embedding, head=head, dense_layers=n_dense)
    stage = Stage(model=m, layout=lay, impl=impl, attention=attention, schedule=schedule,
                  index=index, layers=layers[index], first=first, kinds=kinds, count=count,
                  present=present,
                  shape=kinds["moe" if "moe" in present else "dense"].shape, norm=norm,
                  dense_params=dense, expert_params=expert, largest_layer=largest,
                  embedding=embedding, head=head)
    rates = ParamBytes()
    for term in TERMS:
        if term.param_bytes:
            rates = rates + term.param_bytes(stage)
    stage.param_bytes = rates
    return stage


def _fold(stage: Stage, detail: bool) -> dict:
    """The terms' bytes of one stage added up; the schedule's micro-batches held; the two
    phases' peaks."""
    b = add_bytes([term.stage_bytes(stage) for term in TERMS if term.stage_bytes])
    edge = sum(b.edge.values())
    per_mb = sum(b.layers.values()) + edge + sum(b.chunk.values())
    held, held_edge, n_deferred = stage.schedule.held(stage, per_mb, b.deferred, edge)
    # After the first backward one micro-batch's activations are gone where every forward came
    # first (held = all of them); otherwise a later forward meets the whole buffer.
    first = stage.layout.pp > 1 and held >= stage.layout.grad_accum
    for k, whole in b.after_first_backward.items():
        b.comm[k] = max(b.comm.get(k, 0.0), whole - per_mb if first else whole)
        # What a buffer holds as the first backward starts (ZeRO-2's first bucket), a transient
        # of the layer backward, beyond what it is counted with already.
        start = b.transient.pop(k, 0.0) - b.comm[k]
        if start > 0:
            b.transient[k] = start
    # The per-part dict only for the rank reported; the others need the sum.
    acts: dict[str, float] = ({k: v * held for k, v in b.layers.items()} if detail
                              else {"layers": sum(b.layers.values()) * held})
    acts.update({k: v * held_edge for k, v in b.edge.items()})
    acts.update({k: v * held for k, v in b.chunk.items()})
    if n_deferred:
        acts["deferred weight-gradient inputs"] = b.deferred * n_deferred
    acts.update(b.once)
    # A layer's backward no longer meets one micro-batch's loss tensors (the others' stay where
    # the schedule holds them; all it holds, where it holds less).
    loss_edges = {k: v * min(1.0, held_edge) for k, v in b.edge.items()} if stage.head else {}
    meeting, freed = _meeting_transients(b.transient, loss_edges)
    acts.update(meeting)
    for k, v in freed.items():
        acts[k] -= v
        if acts[k] <= 0:
            del acts[k]
    activations = sum(acts.values())
    # A buffer held in both phases is kept from step to step: the allocator does not fragment it.
    persistent = sum(v for k, v in b.comm.items() if k in b.step_comm)
    steady = b.params + b.grads + b.optimizer + stage.impl.workspace
    comm_fb = sum(b.comm.values())
    grads_fb = b.grads if b.fb_grads is None else b.fb_grads
    fb = steady - b.grads + grads_fb + activations + comm_fb
    comm_now = b.comm
    late = steady + sum(b.late.values()) + sum(meeting.values())
    if late > fb:  # the end of the backward binds: the activations are gone, the shards held
        acts, freed = {k: v for k, v in acts.items() if k in b.transient}, {}
        activations, comm_now, comm_fb, fb = sum(acts.values()), b.late, sum(b.late.values()), late
    opt = steady + max(sum(b.step_comm.values()), b.norm)
    phase = "forward/backward" if fb >= opt else "optimizer step"
    # What the caching allocator reserves: tensors that come and go within a step fragment it.
    dynamic = activations + comm_fb - persistent
    reserved = max(fb + stage.impl.fragmentation * dynamic, opt)
    return {
        "params": b.params, "grads": grads_fb if phase == "forward/backward" else b.grads,
        "grads_step": b.grads, "optimizer": b.optimizer,
        "activations": activations,
        "comm": comm_now if phase == "forward/backward" else b.step_comm, "acts": acts,
        "phases": {"forward/backward": fb, "optimizer step": opt}, "phase": phase,
        "total": max(fb, opt), "reserved": reserved, "transient": tuple(meeting),
        "freed": freed,
        "experts": _held_experts(b, grads_fb if phase == "forward/backward" else b.grads),
    }


# The phase each transient lives in, where not a layer's backward: the loss's logits are gone
# before multi-token prediction's blocks run their backward, and theirs before the layers'.
# ZeRO-2's two buckets in flight are apart: on fake tensors (tiny-moe cp4, 0.25 MB buckets) a
# layer backward's workspace met one bucket, not two.
MTP_BACKWARD = "multi-token prediction block backward"
TRANSIENT_PHASES = {"logits": "loss", "loss chunk": "loss", MTP_BLOCK_GRADS: MTP_BACKWARD,
                    ZERO2_BUCKETS: "gradient buckets"}
# What the losses' backward frees of its micro-batch before a layer's backward: the final norm's
# and the losses' saved tensors (theory/ends.py `loss_kept`: probabilities, or chunked, the
# gradients).
LOSS_KEPT = ("loss probabilities (fp32)", "loss gradients (chunked)")
LOSS_FREED = ("final norm", "MTP final norm", *LOSS_KEPT, *(f"MTP {k}" for k in LOSS_KEPT))
# Multi-token prediction's block runs its backward before the main model's layers, its own loss's
# tensors freed but the main loss's and the final norm's still held: on fake tensors
# (deepseek-v3, 4 layers, tp4 pp2 ep4 ZeRO-2 zero bubble, full recompute) the head's stage peaks
# there, its block rebuilt, 8.7% over the estimate that had every layer backward after the main
# loss's.
MTP_FREED = ("MTP final norm", *(f"MTP {k}" for k in LOSS_KEPT))


def _meeting_transients(transient: dict[str, float], loss_edges: dict[str, float]
                        ) -> tuple[dict[str, float], dict[str, float]]:
    """The transients the peak meets at once (the fake step's timeline), and what is freed by
    then. Those of one phase meet: a layer's backward holds its rebuilt layer, its workspace and
    the gradients whose reduction is in flight at once, but no longer the loss's saved tensors
    (`loss_edges`: one micro-batch's, on the stage with the loss); multi-token prediction's block
    the same, but beside the main loss's. The heaviest phase counts."""
    phases: dict[str, dict[str, float]] = {}
    for k, v in transient.items():
        phases.setdefault(TRANSIENT_PHASES.get(k, "layer backward"), {})[k] = v
    if "layer backward" in phases:
        phases["layer backward"] = _one_workspace(phases["layer backward"])
    freed = {"layer backward": {k: v for k, v in loss_edges.items() if k in LOSS_FREED}}
    if any(k in loss_edges for k in MTP_FREED) and "layer backward" in phases:
        # Its block's backward is a layer's, ZeRO-3's gathering of the main layers aside.
        block = {k: v for k, v in phases["layer backward"].items() if k != ZERO3_LAYER_BACKWARD}
        phases[MTP_BACKWARD] = {**phases.get(MTP_BACKWARD, {}), **block}
        freed[MTP_BACKWARD] = {k: v for k, v in loss_edges.items() if k in MTP_FREED}

    def net(phase: str) -> float:
        return sum(phases[phase].values()) - sum(freed.get(phase, {}).values())
    if not phases:
        return {}, {}
    top = max(phases, key=net)
    return phases[top], freed.get(top, {})


# A layer's backward runs its parts one after another: of its norm's or SwiGLU's workspace and
# its attention's context-parallel buffers, the larger counts.
LAYER_WORKSPACES = ("layer backward workspace", CP_ATTENTION_BACKWARD)


def _one_workspace(phase: dict[str, float]) -> dict[str, float]:
    present = [k for k in LAYER_WORKSPACES if k in phase]
    keep = max(present, key=phase.__getitem__, default=None)
    return {k: v for k, v in phase.items() if k not in present or k == keep}


def stage_view(model, lay: Layout, index: int = 0, runtime: Implementation | str = ULTRASCALE
               ) -> Stage:
    """Pipeline rank `index` of `lay` as the terms see it (the layers split evenly), for a
    term's own check."""
    m, impl = model_shape(model), implementation(runtime)
    attention, kinds = attention_of(m), layer_kinds(m, lay, impl, attention_of(m))
    return _stage(m, lay, impl, stage_layers(m, lay, None), index, kinds,
                  kinds["dense"].whole.get("MLP norm", 0), attention, schedule_of(lay))


@lru_cache(maxsize=8192)
def _estimate(m: ModelShape, lay: Layout, impl: Implementation,
              pp_layers: tuple[int, ...] | None, stage: int | None,
              dense: tuple[int, ...] | None = None) -> MemoryEstimate:
    check_layout(m, lay, pp_layers)
    layers = stage_layers(m, lay, pp_layers)
    attention, schedule = attention_of(m), schedule_of(lay)
    kinds = layer_kinds(m, lay, impl, attention)
    norm = kinds["dense"].whole.get("MLP norm", 0)
    if stage is not None:
        candidates = [stage]
    elif pp_layers is None:
        candidates = schedule.peak_candidates(lay.pp)
    else:
        candidates = range(lay.pp)
    # Part-by-part detail only when one stage is asked for or the candidates are few.
    detail = len(candidates) <= 2
    stages = {c: _stage(m, lay, impl, layers, c, kinds, norm, attention, schedule, dense)
              for c in candidates}
    results = {c: _fold(stages[c], detail) for c in candidates}
    pick = max(candidates, key=lambda c: results[c]["reserved"])
    r = results[pick] if detail else _fold(stages[pick], True)
    return _result(r, stages[pick], impl)


def _held_experts(b, grads_held: float) -> dict:
    """The routed experts' part of the states the peak holds: of the gradients, the same share
    as of all of them (none where the backward starts without gradients)."""
    out = dict(b.experts)
    if out.get("grads") and b.grads:
        out["grads"] = out["grads"] * grads_held / b.grads
    return out


def _result(r: dict, stage: Stage, impl: Implementation) -> MemoryEstimate:
    lay, pick = stage.layout, stage.index
    if lay.pp == 1:
        desc = "every rank (no pipeline parallel)"
    else:
        ends = [what for what, held in (("embedding", stage.embedding),
                                        ("output head and loss", stage.head)) if held]
        desc = f"pp stage {pick} of {lay.pp}" + (f" ({', '.join(ends)})" if ends else "")
    comm = {k: int(v) for k, v in r["comm"].items()}
    parts = {k: int(v) for k, v in r["acts"].items()}
    params, grads, optimizer = int(r["params"]), int(r["grads"]), int(r["optimizer"])
    peak_acts = sum(parts.values())
    binding_fb = r["phase"] == "forward/backward"
    activations = peak_acts if binding_fb else 0
    total = params + grads + optimizer + activations + sum(comm.values()) + impl.workspace
    if not binding_fb:  # the gradient norm's buffers, when they outweigh the step's
        total = max(total, int(r["phases"]["optimizer step"]))
    return MemoryEstimate(
        params=params, grads=grads, optimizer=optimizer, activations=activations,
        comm_buffers=sum(comm.values()), other=impl.workspace, total=total, rank_desc=desc,
        fits=None, device_memory=None, stage=pick, phase=r["phase"],
        phases={k: int(v) for k, v in r["phases"].items()}, activation_parts=parts,
        comm_parts=comm, runtime=impl.name, activations_peak=peak_acts,
        reserved=max(int(r["reserved"]), total),
        experts={k: int(v) for k, v in r["experts"].items()}, grads_step=int(r["grads_step"]),
        transient_parts=r["transient"], freed_parts={k: int(v) for k, v in r["freed"].items()},
    )


def estimate(model, layout: Layout, *, device_memory: int | None = None,
             runtime: Implementation | str = ULTRASCALE, stage: int | None = None,
             pp_layers: list[int] | tuple[int, ...] | None = None,
             headroom: float = 0.0) -> MemoryEstimate:
    """Per-device memory of `model` (a ModelConfig) trained with `layout`.

    runtime: the implementation whose tensors are counted (`theory.implementation`: an
    `Implementation` or its name). stage: the pipeline stage to report (default: the most loaded
    one). pp_layers: layers per pipeline rank when the split is uneven, or per stage as the
    config's `parallel.pp_layers` lists them (pp x v of them: summed per rank as the schedule
    places its stages). fits: whether `reserved` (the peak
    plus the implementation's allocator fragmentation) <= device_memory * (1 - headroom); the
    headroom is for what no tensor count sees (the CUDA context, NCCL's own buffers) when the
    device size given is the raw one.
    """
    impl = implementation(runtime)
    if stage is not None and not 0 <= stage < layout.pp:
        raise LayoutError(f"stage={stage} is not a pipeline stage of pp={layout.pp}.")
    if not 0.0 <= headroom < 1.0:
        raise LayoutError(f"headroom={headroom} is not a fraction of the device kept free: give "
                          "one from 0 up to 1 (not 1 itself), e.g. 0.05.")
    if device_memory is not None and device_memory <= 0:
        raise LayoutError(f"device_memory={device_memory} bytes: give the device's size, e.g. "
                          "80GiB.")
    if layout.zero and shard_group(layout) == 1:
        layout = layout.with_(zero=0)  # nothing to shard: the engine runs it as zero 0
    m = model_shape(model)
    dense = rank_dense_layers(m, layout, pp_layers)
    if pp_layers and len(pp_layers) == layout.pp * layout.pp_virtual_stages != layout.pp:
        pp_layers = split_rank_layers(tuple(pp_layers), layout.pp, layout.pp_schedule)
    est = _estimate(m, layout, impl, tuple(pp_layers) if pp_layers else None, stage, dense)
    fits = None if device_memory is None else est.reserved <= device_memory * (1.0 - headroom)
    # A copy: the cached estimate stays untouched whatever the caller does with its own. (Made as
    # `replace` would, without its checks of every field: the planner asks for thousands.)
    return MemoryEstimate(**{**vars(est), "fits": fits, "device_memory": device_memory,
                             "phases": dict(est.phases),
                             "activation_parts": dict(est.activation_parts),
                             "comm_parts": dict(est.comm_parts), "experts": dict(est.experts)})
