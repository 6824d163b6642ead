"""Step time of a layout, from FLOPs, bytes and bandwidths: a fold over the theory's terms.

`predict` asks every term of `theory/terms.py` for its seconds of one micro-batch on the costed
pipeline rank (`term.Seconds`: per layer, on the rank with the head, on the rank with the
embedding, per chunk, once), adds them up for what that rank holds, overlaps the waits with the
device's work, runs the m micro-batches through the schedule (the bubble included), and adds what
each term costs after the last micro-batch. The model, per device:

* compute of one micro-batch on one pipeline stage (`theory/block.py`, `attention.py`,
  `expert.py`, `ends.py`): every GEMM of a block costed at an achieved rate that grows with its
  size (`Hardware.matmul_eff_max`, `matmul_half_flops`), causal flash attention at
  `attention_eff`, elementwise work (norms, residuals, rotary, SwiGLU, cross-entropy, fp32
  gradient accumulation) as HBM traffic, recomputation as extra forward work (`recompute.py`);
* waits against device work: the host work of each layer and the per-step latencies of collectives
  overlap the device's FLOPs and bytes per micro-batch; the longer counts in full and
  `Hardware.host_overlap` of the shorter hides (a GPU runs ahead of its host; 0 on a CPU);
* tensor-parallel collectives (`tensor.py`), the cp ring exchange (`context.py`: hidden under
  attention where it can be; an MoE's per-sequence balance statistics too) and the ep all-to-all
  (`expert.py`), each costed on the link it crosses (inside a node or between nodes, from the rank
  order tp, cp, dp, pp; between nodes a group gets its share of the node's links,
  `rates.inter_share`), every tp ring step waiting `Hardware.tp_step_wait_s` on a cluster in a
  state that stalls them;
* the pipeline (`pipeline.py`): forward/backward times of a stage fed to the schedule simulator,
  whose total time contains the bubble; point-to-point activation transfers added to each stage;
* after the last micro-batch: the data-parallel gradient reduction (bucketed, each bucket paying
  its ring steps, overlapped with the last backward; reduce-scatter with ZeRO), the optimizer
  update (HBM traffic of Adam over the local shard, `optimizer.py`) and the ZeRO-1/2 parameter
  all-gather; with ZeRO-3 the per-micro-batch gathers, prefetched under compute (`data.py`);
* on a CPU profile (`Hardware.host_cores`), each rank computes on its share of the node's cores:
  when ranks outnumber cores they time-share them, so every rank's compute slows by ranks / cores,
  and a pipeline's idle ranks hand their cores to the busy ones (the bubble shrinks to what the
  node's total work leaves).

Everything is physical (FLOPs, bytes, bandwidths, latencies); the only fitted numbers are the
efficiency constants of the hardware profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.memory.estimator import estimate
from ultrascale.params import flops_per_token
from ultrascale.planner.hardware import Hardware
from ultrascale.rules import layers_per_stage
from ultrascale.theory import block, ends, pipeline, tensor
from ultrascale.theory.implementation import implementation
from ultrascale.theory.pipeline import (busiest_params, rank_layers, split_rank_layers,
                                        stage_split)
from ultrascale.theory.rates import rank_hardware, rank_share
from ultrascale.theory.shape import Shape, model_shape
from ultrascale.theory.term import UNITS, Placement, Seconds, Step
from ultrascale.theory.terms import TERMS, attention_of, schedule_of


@dataclass
class Prediction:
    """Predicted step of one layout. Times in seconds; `breakdown` holds the exposed time of each
    part over one optimizer step (they sum to `step_time_s`)."""

    layout: Layout
    hardware: str
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)
    memory_bytes: float | None = None
    fits: bool | None = None
    # Why ultrascale's engine would refuse this layout (rules.engine_violations), when a plan for
    # another runtime ranks it; empty for what our engine runs.
    unsupported: list[str] = field(default_factory=list)
    # The runtime whose step it predicts (theory/implementation.py): "ultrascale", our engine.
    runtime: str = "ultrascale"
    # The layers of each of the pp x v stages it costed (`predict`'s `pp_layers`), and the
    # pipeline rank it costed (the busiest: `pipeline.placement`).
    pp_layers: list[int] = field(default_factory=list)
    costed_rank: int = 0
    # Whether that split is not the engine's own (a config must then list it: `own_split`).
    split_given: bool = False

    @property
    def own_split(self) -> list[int] | None:
        """The stages' layers a config must list to run what was costed (None: the engine's)."""
        return list(self.pp_layers) if self.split_given else None

    @property
    def dominant(self) -> str:
        return max(self.breakdown, key=self.breakdown.get)

    def shares(self) -> dict[str, float]:
        return {k: v / self.step_time_s for k, v in self.breakdown.items()}

    def as_dict(self) -> dict:
        out = {"layout": self.layout.short(), "layout_fields": self.layout.as_dict(),
               "hardware": self.hardware, "step_time_s": self.step_time_s,
               "tokens_per_s": self.tokens_per_s,
               "tokens_per_s_per_device": self.tokens_per_s_per_device, "mfu": self.mfu,
               "breakdown_s": self.breakdown, "dominant": self.dominant,
               "memory_bytes": self.memory_bytes, "fits": self.fits, "runtime": self.runtime,
               "pp_layers": self.pp_layers, "costed_rank": self.costed_rank,
               "split_given": self.split_given}
        if self.unsupported:
            out["ultrascale_refuses"] = list(self.unsupported)
        return out



def _overlapped(device: tuple[dict, dict], waits: tuple[dict, dict],
                overlap: float) -> tuple[dict, dict]:
    """Exposed parts of a micro-batch's (forward, backward) over a stage: the longer of its device
    work and its waits counts in full, `overlap` of the shorter hides under it. A GPU runs ahead
    of its host (kernels queue up through the forward and into the backward) and computes while a
    collective's latency passes; on a CPU nothing hides (`overlap` 0)."""
    d = sum(sum(p.values()) for p in device)
    w = sum(sum(p.values()) for p in waits)
    keep_device, keep_waits = (1.0, 1.0 - overlap) if d >= w else (1.0 - overlap, 1.0)
    passes = []
    for dev, wait in zip(device, waits):
        out = {k: val * keep_device for k, val in dev.items()}
        for k, val in wait.items():
            out[k] = out.get(k, 0.0) + val * keep_waits
        passes.append(out)
    return passes[0], passes[1]


def setup(model, lay: Layout, hardware: Hardware, runtime: str = "ultrascale",
          pp_layers=None, blocks: dict | None = None) -> Step:
    """What every term's seconds read, derived once: the job's profile as one rank sees it, the
    sizes, one block's times, the head, the stages' split (`pp_layers`, the config's
    `parallel.pp_layers`, else the engine's), the busiest rank's parameters and layers.
    `blocks`: a dict the caller keeps for one model and profile, where layouts that differ only
    in the step's fields (`STEP_FIELDS`) find one block's times costed once."""
    world = lay.world_size
    hardware = hardware.for_job(math.ceil(world / hardware.devices_per_node))
    share, alone = rank_share(hardware, min(world, hardware.devices_per_node))
    hw = rank_hardware(hardware, share, alone)
    m = model_shape(model)
    attention = attention_of(m)
    sh = Shape.of(m, lay)
    step = Step(model=m, lay=lay, hardware=hardware, hw=hw, impl=implementation(runtime),
                attention=attention, schedule=schedule_of(lay), share=share, alone=alone, sh=sh,
                layer=_block_times(m, lay, hw, sh, attention, blocks),
                head_f=ends.head_forward(m, hw, sh), ce=ends.loss_traffic(m, hw, sh),
                params=0.0, layers=0)
    return with_split(step, pp_layers)


# The layout fields one block's forward and backward never read (how the step accumulates
# micro-batches, pipelines and keeps its states): a plan's layouts that differ only in them
# share one `block.block_times`
# (tests/test_planner.py::test_a_block_costs_the_same_whatever_the_step_around_it).
STEP_FIELDS = dict(dp=1, pp=1, zero=0, zero3_gather="auto", dp_shard=None, grad_accum=1,
                   pp_schedule="1f1b", pp_virtual_stages=1, master_dtype="fp32",
                   grad_accum_dtype="fp32", bucket_mb=25.0, optimizer="adamw")


def _block_times(m, lay: Layout, hw: Hardware, sh: Shape, attention,
                 blocks: dict | None) -> dict[str, float]:
    """`block.block_times`; `blocks`: the times already costed for one model on one hardware
    profile, by the fields a block reads (and the world size, which the rank's rates read)."""
    if blocks is None:
        return block.block_times(m, lay, hw, sh, attention)
    key = (replace(lay, **STEP_FIELDS), lay.world_size)
    if key not in blocks:
        blocks[key] = block.block_times(m, lay, hw, sh, attention)
    return dict(blocks[key])


def with_split(step: Step, pp_layers=None) -> Step:
    """`step` with its stages split as `pp_layers` says (None: the engine's split): what the
    split changes (the busiest rank's layers and parameters); the sizes and one block's times
    stay."""
    m, lay = step.model, step.lay
    split = stage_split(m, lay, pp_layers)
    layers = max(split_rank_layers(split, lay.pp, lay.pp_schedule))
    return replace(step, params=busiest_params(m, lay, layers), layers=layers, split=split,
                   split_given=split != stage_split(m, lay))


def micro_batch(parts: list[Seconds], at: Placement) -> tuple[dict, dict, dict]:
    """The terms' seconds of one micro-batch on the costed rank, by breakdown key: (forward
    device, backward device, waits). Each unit counts as often as the rank holds it; units are
    added in order (per layer, head, embedding, chunk, once), the terms in theirs."""
    out: tuple[dict, dict, dict] = ({}, {}, {})
    for unit, n in zip(UNITS, at.counts()):
        for part in parts:
            p = getattr(part, unit)
            if p is not None:
                _add(out[0], p.forward, n)
                _add(out[1], p.backward, n)
                _add(out[2], p.waits, n)
    return out


def _add(total: dict, seconds: dict, n: float) -> None:
    for k, val in seconds.items():
        total[k] = total[k] + n * val if k in total else n * val


def predict(model: ModelConfig, layout: Layout, hardware: Hardware, nodes: int | None = None,
            memory: bool = True, runtime: str = "ultrascale", pp_layers=None) -> Prediction:
    """Predict one step of `layout` training `model` on `hardware`.

    `nodes`, when given, is checked against the layout's world size. With `memory`, the memory
    estimator's total and `fits` are attached. `runtime` names the implementation that runs the
    step (`theory.implementation`: ours, or "nanotron" for the playbook runs): its memory, its
    pipeline split, its loss's all-reduces, and whether its ZeRO reduce-scatter overlaps the
    backward. `pp_layers`: the layers of each of the pp x v stages (the config's
    `parallel.pp_layers`; default the engine's split), or "balanced" (`pipeline.balanced_split`:
    the split that least loads the busiest rank): the busiest rank under it is costed.
    """
    lay = layout
    world = lay.world_size
    if nodes is not None and world > nodes * hardware.devices_per_node:
        raise ValueError(f"layout {lay.short()} needs {world} devices but {nodes} node(s) of "
                         f"{hardware.devices_per_node} hold only "
                         f"{nodes * hardware.devices_per_node}.")
    balance = isinstance(pp_layers, str)
    if balance and pp_layers != "balanced":
        raise ValueError(f"pp_layers={pp_layers!r}: give the layers of each stage, or "
                         "'balanced'.")
    costed = _costed(setup(model, lay, hardware, runtime, None if balance else pp_layers))
    if balance and lay.pp > 1:
        costed = balanced(costed)
    return _predicted(costed, runtime, memory, pp_layers)


def predict_both(model: ModelConfig, layout: Layout, hardware: Hardware,
                 runtime: str = "ultrascale", blocks: dict | None = None,
                 balance: bool = True) -> tuple[Prediction, Prediction | None]:
    """`predict(memory=False)` on the engine's split and, with `balance` for a pipelined layout,
    on the balanced one (else None): the two share the first costing (the planner asks both of
    every layout). `blocks`: as `setup`'s."""
    costed = _costed(setup(model, layout, hardware, runtime, blocks=blocks))
    plain = _predicted(costed, runtime, False, None)
    if layout.pp == 1 or not balance:
        return plain, None
    return plain, _predicted(balanced(costed), runtime, False, "balanced")


class Costed(NamedTuple):
    """A layout's step and every term's seconds of one micro-batch on it."""

    step: Step
    by_term: dict[str, Seconds | None]  # a term's name -> its seconds (None: nothing here)
    load: "pipeline.Loads"  # what a pipeline rank carries of them

    @property
    def parts(self) -> list[Seconds]:
        return [s for s in self.by_term.values() if s is not None]


# The terms whose seconds read the stages' split (the busiest rank's layers and parameters, the
# split itself): a second split of the same layout costs them alone again (`balanced`;
# tests/test_planner.py::test_only_the_split_terms_read_the_split checks the others).
SPLIT_TERMS = ("data", "pipeline")


def _costed(step: Step, again: Costed | None = None) -> Costed:
    """Every term's seconds of `step`; `again`: the same layout on another split, whose terms
    outside `SPLIT_TERMS` stand."""
    by_term = {t.name: (t.seconds(step) if again is None or t.name in SPLIT_TERMS
                        else again.by_term[t.name]) for t in TERMS if t.seconds}
    parts = [s for s in by_term.values() if s is not None]
    return Costed(step, by_term, pipeline.loads(parts))


def balanced(costed: Costed) -> Costed:
    """`costed` again on the split that least loads the busiest rank (`pipeline.balanced_split`
    of the per-unit loads, which stay: only what the busiest rank holds changes)."""
    step = with_split(costed.step, pipeline.balanced_split(costed.step, costed.load))
    return _costed(step, again=costed)


def _predicted(costed: Costed, runtime: str, memory: bool, pp_layers) -> Prediction:
    """The step time of a costed layout: the micro-batches through the schedule, what it hides,
    the bubble, the work after the last micro-batch; with `memory`, the estimator's verdict."""
    step, parts, load = costed.step, costed.parts, costed.load
    lay = step.lay
    hw, m = step.hw, lay.grad_accum
    at = step.schedule.placement(step, load)
    f_device, b_device, waits = micro_batch(parts, at)
    f_parts, b_parts = _overlapped((f_device, b_device), (waits, waits), hw.host_overlap)
    t_f, t_b = sum(f_parts.values()), sum(b_parts.values())
    # The m micro-batches through the schedule; whatever it takes beyond their work is bubble. (A
    # time-shared pipeline can take less than the busiest stage's work at the shared speed: that
    # stage then runs faster, and its parts shrink in proportion.)
    # What the schedule hides (dualpipev: the all-to-alls of its paired chunks) comes off its
    # part and off the work the schedule runs in series.
    total_pipe = step.schedule.step_total(step, load, at, t_f, t_b, (f_parts, b_parts))
    hidden = step.schedule.hidden(step, (f_parts, b_parts), at)
    work = m * (t_f + t_b) - sum(hidden.values())
    scale = min(1.0, total_pipe / work) if work > 0 else 1.0
    breakdown: dict[str, float] = {}
    for parts_ in (f_parts, b_parts):
        for k, val in parts_.items():
            breakdown[k] = breakdown.get(k, 0.0) + val * m * scale
    for k, val in hidden.items():
        breakdown[k] -= val * scale
    breakdown["pp_bubble"] = max(0.0, total_pipe - work)
    # After the last micro-batch: gradient reduction, optimizer step, parameter all-gather.
    for term in TERMS:
        if term.after_step:
            for k, val in term.after_step(step, b_device["matmul"]).items():
                breakdown[k] = breakdown.get(k, 0.0) + val
    breakdown = {k: val for k, val in breakdown.items() if val > 0}
    step_time = sum(breakdown.values())

    tps = lay.global_batch_tokens / step_time
    per_dev = tps / lay.world_size
    mfu = per_dev * flops_per_token(step.model, lay.seq_len) / hw.peak(lay.dtype)
    pred = Prediction(layout=lay, hardware=hw.name, step_time_s=step_time, tokens_per_s=tps,
                      tokens_per_s_per_device=per_dev, mfu=mfu, breakdown=breakdown,
                      runtime=step.impl.name, pp_layers=list(step.split), costed_rank=at.rank,
                      split_given=step.split_given)
    if memory:
        est = estimate_memory(step.model, lay, hw, runtime,
                              pp_layers=None if pp_layers is None else step.split)
        pred.memory_bytes, pred.fits = est.total, est.fits
    return pred


def estimate_memory(model: ModelConfig, layout: Layout, hw: Hardware, runtime: str = "ultrascale",
                    headroom: float = 0.0, pp_layers=None):
    """The memory estimator's answer for this layout on this device (bytes, fits): the estimate
    against the device's memory less what the CUDA context and NCCL hold
    (`Hardware.usable_memory_bytes`). `runtime` names the implementation whose tensors are counted
    (ours, or "nanotron" for the playbook runs); `pp_layers` the stages' split, as `predict`."""
    uneven = pp_layers is not None or uneven_pp_layers(model, layout) is not None
    ranks = rank_layers(model, layout, pp_layers) if uneven else None
    return estimate(model, layout, device_memory=int(hw.usable_memory_bytes), runtime=runtime,
                    headroom=headroom, pp_layers=ranks)


def uneven_pp_layers(model: ModelConfig, layout: Layout) -> list[int] | None:
    """The layers of each (virtual) stage the prediction assumes when the stages do not divide the
    layers (`rules.layers_per_stage`, the engine's own split), as `parallel.pp_layers` takes them;
    None when they divide evenly."""
    stages = layout.pp * layout.pp_virtual_stages
    return layers_per_stage(model.num_layers, stages) if model.num_layers % stages else None


# ------------------------------------------------------------------------------------------------
# Figures of one part, for calibration and tests (the config's model; the terms' own functions)


def block_times(model, lay: Layout, hw: Hardware) -> dict[str, float]:
    """Forward and backward time of one transformer block for one micro-batch, by part
    (`theory.block.block_times`, with the model's attention)."""
    m = model_shape(model)
    return block.block_times(m, lay, hw, Shape.of(m, lay), attention_of(m))


def tp_block_collectives(model, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """How many tp collectives of one block show, forward plus backward: (all-gathers,
    reduce-scatters) with sequence parallel, (all-reduces, 0) without
    (`theory.tensor.block_collectives`)."""
    if lay.tp == 1:
        return 0.0, 0.0
    m = model_shape(model)
    sh = Shape.of(m, lay)
    counts = tensor.block_collectives(lay, hw, block.column_gemms(m, hw, sh, attention_of(m)),
                                      tensor.tp_kinds(lay, hw, sh))
    return (counts[0], counts[1] if len(counts) > 1 else 0.0)
