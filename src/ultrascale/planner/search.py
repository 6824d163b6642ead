"""The planner: the playbook's three steps over every layout worth trying.

1. Enumerate dp, tp, pp, cp, ep, ZeRO stage, micro-batch, accumulation, recompute, pipeline schedule
   and virtual stages, keeping only layouts that use all the devices and reach the global batch
   exactly (dp x mbs x accumulation = global batch in sequences).
2. Rank them by predicted throughput (`cost.predict`).
3. Walk down the ranking and keep the layouts that fit in memory (the memory estimator), so that the
   estimator runs on the few layouts that matter, not on thousands.

Pruning, each with its reason (a `SearchSpace` can lift any of them):

- tp stays inside a node: every block pays several tp collectives, inter-node they dominate.
- Micro-batches are powers of two up to 64: beyond that GEMMs are already at full efficiency.
- ZeRO-2/3 are not combined with pipeline parallel unless asked for (`--search-zero`): under pp
  ZeRO-3 gathering once a step (`parallel.zero3_gather: step`) holds the stage's parameters whole
  through the step and moves them once, what ZeRO-1 holds and moves, and gathering for every
  micro-batch moves 2m times the bytes (the playbook's advice, and nanotron's and Megatron's).
  Asked for, ZeRO-3 is tried both ways.
- Context parallel only splits sequences of 8k tokens or more (shorter ones fit as they are), up to 32.
- At most 16 pipeline stages (Llama 3 405B used 16; deeper pipelines only add bubble and transfers
  for the batches dp leaves them). pp divides the devices but need not divide the layers: stages
  then differ by one layer, the last ones taking the extra as the engine splits them
  (`rules.layers_per_stage`; Llama 3 405B put its 126 layers on 16 stages), and the written config
  lists them (`parallel.pp_layers`).
- Interleaved virtual stages 2 and 4, dualpipev's 2; AFAB only where asked for (1F1B takes the
  same time with less memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.cost import (Prediction, estimate_memory, predict_both,
                                     uneven_pp_layers)
from ultrascale.planner.hardware import Hardware
from ultrascale.rules import (
    engine_violations, fp8_expert_violations, layers_per_stage, layout_violations,
    schedule_violations, value_violations,
)
from ultrascale.theory.pipeline import rank_layers

GiB = 2**30
# The runtime the planner's ranking is for when it writes an `ultrascale train` config: ours ranks
# only what the engine runs today (rules.engine_violations). Other runtimes (nanotron, for the
# playbook's runs) may run more: their plans keep such layouts, marked (`Prediction.unsupported`).
OURS = "ultrascale"


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchSpace:
    """Which values each dimension may take. None means: everything the pruning rules allow."""

    tp: list[int] | None = None
    pp: list[int] | None = None
    cp: list[int] | None = None
    ep: list[int] | None = None
    zero: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    mbs: list[int] | None = None
    # None: none, selective and full, and for a model with multi-head latent attention
    # DeepSeek-V3's `norms_and_mla_up` too
    recompute: list[str] | None = None
    schedules: list[str] = field(default_factory=lambda: ["1f1b", "interleaved", "zero_bubble",
                                                          "dualpipev"])
    virtual_stages: list[int] = field(default_factory=lambda: [2, 4])
    sequence_parallel: bool = True  # with tp > 1
    tp_across_nodes: bool = False
    zero_with_pp: bool = False  # allow ZeRO-2/3 with pp > 1
    zero3_gather: list[str] = field(default_factory=lambda: ["step", "micro_batch"])
    dtype: str = "bf16"
    grad_accum_dtype: str = "fp32"
    max_mbs: int = 64
    max_pp: int = 16
    uneven_pp: bool = True  # allow pp (x virtual stages) that does not divide the layers
    # pp > 1 on our runtime: also cost the layers split so that the busiest rank is least busy
    # (`predict(pp_layers="balanced")`: the head's rank takes fewer), and rank whichever of it
    # and the engine's split is faster and fits
    balance_stages: bool = True
    min_cp_seq: int = 8192
    max_cp: int = 32
    optimizer: str = "adamw"  # muon: the blocks' matrices hold one optimizer buffer, not two
    fp8_cache: bool = False  # fp8: the linears keep their inputs in e4m3 (docs/precision.md)
    fp8_experts: bool = False  # fp8: the routed experts multiply in FP8 too


class PlanError(ValueError):
    """The request cannot be planned (bad sizes); the message says what to change."""


# A search-space field -> the layout field each of its values fills.
_SPACE_FIELDS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero", "mbs": "mbs",
                 "recompute": "recompute", "schedules": "pp_schedule",
                 "virtual_stages": "pp_virtual_stages", "zero3_gather": "zero3_gather"}


def request_violations(model: ModelConfig, devices: int, space: SearchSpace, seq_len: int,
                       top: int | None) -> list[str]:
    """What no layout of the request can take, found before any is enumerated: each value the
    space lists, and the sequence length, asked of the layout rules (`value_violations`) as a
    layout holding it; FP8 experts on a model without experts; no device; a `top` that would
    rank nothing."""
    out = [f"devices={devices}: plan for at least 1 device."] if devices < 1 else []
    out += [v.message for v in fp8_expert_violations(
        model, Layout(dtype=space.dtype, fp8_experts=space.fp8_experts))]
    for name, to in _SPACE_FIELDS.items():
        for value in getattr(space, name) or []:
            out += [f"the search's {name} values: {v.message}"
                    for v in value_violations(Layout(**{to: value}))]
    out += [v.message for v in value_violations(Layout(seq_len=seq_len))]
    if top is not None and top < 1:
        out.append(f"top={top}: rank at least 1 layout (or None for every one that fits).")
    return out


def enumerate_layouts(model: ModelConfig, devices: int, global_batch_tokens: int, seq_len: int,
                      hw: Hardware, space: SearchSpace | None = None) -> list[Layout]:
    """The layouts of the search space that split the devices and the batch and follow the
    layout rules."""
    space = _with_recompute(model, space or SearchSpace())
    return [lay for lay in _candidates(model, devices, global_batch_tokens, seq_len, hw, space)
            if _follows_the_rules(model, lay, space.uneven_pp)]


def _with_recompute(model: ModelConfig, space: SearchSpace) -> SearchSpace:
    """The space with its recompute modes named (by default, DeepSeek-V3's policy too for a
    model with multi-head latent attention)."""
    if space.recompute is None:
        space = replace(space, recompute=["none", "selective", "full"] + (
            ["norms_and_mla_up"] if model.attention == "mla" else []))
    return space


def _candidates(model: ModelConfig, devices: int, global_batch_tokens: int, seq_len: int,
                hw: Hardware, space: SearchSpace) -> list[Layout]:
    """The space's layouts whose sizes split the devices and the batch (before the rules)."""
    if global_batch_tokens % seq_len:
        raise PlanError(f"the global batch of {global_batch_tokens} tokens is not a whole number of "
                        f"sequences of {seq_len} tokens. Choose a multiple of {seq_len}.")
    gbs = global_batch_tokens // seq_len
    max_tp = devices if space.tp_across_nodes else min(devices, hw.devices_per_node)
    # The candidates of each dimension (the search's pruning); what divides what is the rules',
    # asked of every layout at the end (`_follows_the_rules`).
    tps = space.tp or _pow2_upto(max_tp)
    pps = space.pp or [p for p in _divisors(devices) if p <= space.max_pp]
    if space.cp is not None:
        cps = space.cp
    else:
        cps = _pow2_upto(space.max_cp) if seq_len >= space.min_cp_seq else [1]
    eps = space.ep or (_pow2_upto(model.num_experts) if model.num_experts else [1])
    out: list[Layout] = []
    for tp in tps:
        for pp in pps:
            for cp in cps:
                inner = tp * pp * cp
                if devices % inner:
                    continue
                dp = devices // inner
                if gbs % dp:
                    continue
                per_rank = gbs // dp
                mbss = space.mbs or _pow2_upto(min(space.max_mbs, per_rank))
                for ep in eps:
                    for mbs in mbss:
                        if per_rank % mbs:
                            continue
                        acc = per_rank // mbs
                        out += _variants(space, dp, tp, pp, cp, ep, mbs, acc, seq_len)
    return out


def _why_no_layout(model: ModelConfig, devices: int, global_batch_tokens: int, seq_len: int,
                   hw: Hardware, space: SearchSpace | None) -> str:
    """Why the search found no layout: the rules' refusal of the first layout whose sizes fit,
    or, where none does, the sizes."""
    space = _with_recompute(model, space or SearchSpace())
    sized = _candidates(model, devices, global_batch_tokens, seq_len, hw, space)
    if sized:
        bad = _rule_violations(model, sized[0], space.uneven_pp)
        return (f"none of the {len(sized)} layouts that split {devices} devices and the batch "
                f"follows the layout rules; the first, {sized[0].short()}: {bad[0].message}")
    gbs = global_batch_tokens // seq_len
    return (f"no layout splits {devices} devices for a global batch of {global_batch_tokens} "
            f"tokens ({gbs} sequences of {seq_len}): tp x pp x cp must divide the devices and "
            "dp the batch in sequences. Change the device count, the global batch (powers of two "
            "divide best) or the search's values.")


def _windowed_cp(model: ModelConfig, lay: Layout) -> Layout:
    """A sliding window shorter than the sequence: Ulysses attends over whole sequences with the
    kernel's own window, where ring and all-gather cp compute the blocks the window cuts as
    masked pieces in the math reference (parallel/ring_attention.py): a cp layout of such a
    model is planned with Ulysses, where the heads split."""
    window = getattr(model, "sliding_window", None)
    if lay.cp == 1 or window is None or window >= lay.seq_len:
        return lay
    ulysses = lay.with_(cp_mode="ulysses")
    return ulysses if not layout_violations(model, ulysses) else lay


def _follows_the_rules(model: ModelConfig, lay: Layout, uneven: bool) -> bool:
    return not _rule_violations(model, lay, uneven)


def _rule_violations(model: ModelConfig, lay: Layout, uneven: bool) -> list:
    """The layout rules (tp divides the heads and the MLP, cp and sequence parallel split the
    sequence, ep divides dp and the experts, the schedules' own), with stages that need not
    divide the layers when `uneven` (the engine's split, which the written config lists)."""
    stages = lay.pp * lay.pp_virtual_stages
    split = (layers_per_stage(model.num_layers, stages)
             if uneven and model.num_layers % stages else None)
    return (layout_violations(model, lay, pp_layers=split)
            or schedule_violations(lay, model.num_layers))


def _variants(space, dp, tp, pp, cp, ep, mbs, acc, seq_len) -> list[Layout]:
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        schedules = []
        for name in space.schedules:
            if name == "interleaved":
                schedules += [(name, v) for v in space.virtual_stages]
            elif name == "dualpipev":
                schedules.append((name, 2))  # its V: two chunks per rank
            else:
                schedules.append((name, 1))
    zeros = [z for z in space.zero if dp > 1 or z == 0]
    if pp > 1 and not space.zero_with_pp:
        zeros = [z for z in zeros if z <= 1]
    out = []
    for zero in zeros:
        # ZeRO-3 under pp: both ways of gathering (once a step, holding the stage; or for every
        # forward and backward, moving 2m times the bytes).
        gathers = space.zero3_gather if zero == 3 and pp > 1 else ["auto"]
        for rec in space.recompute:
            for sched, v in schedules:
                for gather in gathers:
                    out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, mbs=mbs,
                                      grad_accum=acc, seq_len=seq_len, recompute=rec,
                                      sequence_parallel=space.sequence_parallel and tp > 1,
                                      pp_schedule=sched, pp_virtual_stages=v, dtype=space.dtype,
                                      grad_accum_dtype=space.grad_accum_dtype,
                                      optimizer=space.optimizer, zero3_gather=gather,
                                      fp8_cache=space.fp8_cache,
                                      fp8_experts=space.fp8_experts))
    return out


@dataclass
class Plan:
    ranked: list[Prediction]  # the fitting layouts, best first (at most `top`)
    considered: int
    smallest: Prediction | None = None  # when nothing fits: the layout with the least memory
    advice: list[str] = field(default_factory=list)
    why: str = ""
    # Layouts left out because our engine does not run them yet (planning for our runtime).
    left_out: int = 0
    # A ranked layout's name -> the fitting layouts with the very same predicted step (another ZeRO
    # stage the cost model prices alike, ...): folded into its row, not ranked apart.
    same_time: dict[str, list[str]] = field(default_factory=dict)

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None


def plan(model: ModelConfig, devices: int, global_batch_tokens: int, hw: Hardware,
         seq_len: int = 4096, top: int | None = 5, space: SearchSpace | None = None,
         check_memory: bool = True, runtime: str = "ultrascale", headroom: float = 0.0,
         progress: Callable[[str, int, int], None] | None = None) -> Plan:
    """Rank the layouts that fit (the first `top`, or all with None); when none fits, say which
    comes closest and what to change. `runtime` and `headroom` go to the memory estimator; for
    our runtime only the layouts our engine runs are ranked. `progress(phase, done, total)` is
    told how far the costing and the memory checks are (a large cluster's plan takes a minute)."""
    tell = progress or (lambda phase, done, total: None)
    bad = request_violations(model, devices, space or SearchSpace(), seq_len, top)
    if bad:
        raise PlanError(" ".join(bad))
    layouts = enumerate_layouts(model, devices, global_batch_tokens, seq_len, hw, space)
    if not layouts:
        raise PlanError(_why_no_layout(model, devices, global_batch_tokens, seq_len, hw, space))
    if runtime == OURS:
        layouts = [_windowed_cp(model, lay) for lay in layouts]
    refusals = {lay: engine_violations(model, lay) for lay in layouts}
    left_out = 0
    if runtime == OURS:
        runnable = [lay for lay in layouts if not refusals[lay]]
        if not runnable:
            reasons = sorted({v.line() for lay in layouts for v in refusals[lay]})
            raise PlanError(f"none of the {len(layouts)} layouts for this request runs on "
                            "ultrascale's engine yet: " + " ".join(reasons))
        left_out, layouts = len(layouts) - len(runnable), runnable
    balance = runtime == OURS and (space or SearchSpace()).balance_stages
    preds = _predictions(model, layouts, hw, runtime, balance, tell)
    preds.sort(key=lambda p: -p.tokens_per_s)
    for p in preds:
        p.unsupported = [v.line() for v in refusals[p.layout]]
    ranked: list[Prediction] = []
    same_time: dict[int, list[Prediction]] = {}  # position in `ranked` -> its twins
    placed: set[Layout] = set()  # a layout's faster split that fits stands for it
    for checked, p in enumerate(preds):
        if checked % PROGRESS_EVERY == 0:
            tell("checking memory", checked, len(preds))
        if p.layout in placed:
            continue
        twin = next((i for i, r in enumerate(ranked) if _same_step(r, p)), None)
        if top is not None and len(ranked) == top and twin is None:
            break
        if check_memory:
            est = estimate_memory(model, p.layout, hw, runtime, headroom, p.own_split)
            p.memory_bytes, p.fits = est.total, est.fits
            if not est.fits:
                continue
        placed.add(p.layout)
        if twin is None:
            ranked.append(p)
        else:  # the same step time: one row (the first found), the others named on it
            same_time.setdefault(twin, []).append(p)
    result = Plan(ranked=ranked, considered=len(layouts), left_out=left_out,
                  same_time={ranked[i].layout.short(): [t.layout.short() for t in twins]
                             for i, twins in same_time.items()})
    if ranked:
        result.why = explain(ranked, preds, model)
    else:
        result.smallest, result.advice = _closest(model, preds, hw, devices, runtime)
    return result


PROGRESS_EVERY = 1000  # layouts between two calls of `plan`'s progress


def _predictions(model: ModelConfig, layouts: list[Layout], hw: Hardware, runtime: str,
            balance: bool, tell: Callable[[str, int, int], None]) -> list[Prediction]:
    """Each layout's prediction on the engine's split; with `balance`, after them the pipelined
    layouts costed with their layers balanced (`pipeline.balanced_split`), where that split is
    not the engine's own (the two share the first costing, and layouts one block's times:
    `cost.predict_both`)."""
    plain, split, blocks = [], [], {}
    for i, lay in enumerate(layouts):
        if i % PROGRESS_EVERY == 0:
            tell("costing layouts", i, len(layouts))
        p, b = predict_both(model, lay, hw, runtime, blocks, balance)
        plain.append(p)
        if b is not None and b.split_given:
            split.append(b)
    return plain + split


def _same_step(a: Prediction, b: Prediction) -> bool:
    """Two layouts the cost model prices alike (to float rounding): the plan shows them as one."""
    return abs(a.step_time_s - b.step_time_s) <= 1e-9 * max(a.step_time_s, b.step_time_s)


def explain(ranked: list[Prediction], all_preds: list[Prediction],
            model: ModelConfig | None = None) -> str:
    """Why the first layout wins: where its step goes, and what the runner-up loses, part by part
    (and, given the model, how its pipeline stages split the layers when they do not divide)."""
    best = ranked[0]
    shares = best.shares()
    compute = sum(shares.get(k, 0.0) for k in ("matmul", "attention", "elementwise", "recompute"))
    lines = [f"{best.layout.short()} spends {compute:.0%} of its step computing; its largest cost is "
             f"{best.dominant} ({shares[best.dominant]:.0%})."]
    exposed = {k: v for k, v in shares.items()
               if k not in ("matmul", "attention", "elementwise", "recompute") and v >= 0.01}
    if exposed:
        lines.append("Exposed: " + ", ".join(f"{k} {v:.0%}" for k, v in
                                             sorted(exposed.items(), key=lambda kv: -kv[1])) + ".")
    if len(ranked) > 1:
        second = ranked[1]
        gain = best.tokens_per_s / second.tokens_per_s - 1
        # In a fixed order: layouts that tie (cp's ring hidden under attention ties with dp) must
        # name the same part in every process, whatever its string hashing.
        diff = {k: second.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
                for k in sorted(set(best.breakdown) | set(second.breakdown))}
        worst = max(diff, key=diff.get)
        by = f"{gain:.1%}" if gain >= 0.001 else f"{gain:.2%}"  # (never "by 0.0%")
        lines.append(f"It beats {second.layout.short()} by {by}: the runner-up spends "
                     f"{diff[worst] * 1e3:.1f} ms more per step in {worst}.")
    stages = (best.own_split or uneven_pp_layers(model, best.layout)) if model is not None \
        else None
    if stages:
        pp = best.layout.pp
        ranks = rank_layers(model, best.layout, stages)
        if best.own_split:
            split = (f"balanced: pipeline rank {best.costed_rank}, the busiest, holds "
                     f"{ranks[best.costed_rank]}")
        else:
            split = (f"{len(stages)} virtual stages of {max(stages)} or {min(stages)}"
                     if len(stages) > pp else "the last ones the more")
        lines.append(f"Its {pp} pipeline ranks hold {max(ranks)} or {min(ranks)} of the "
                     f"{model.num_layers} layers ({split}: parallel.pp_layers in the written "
                     "config).")
    faster, seen = [], {best.layout}  # one per layout (its two splits are one layout)
    for p in all_preds:
        if p.tokens_per_s > best.tokens_per_s and p.layout not in seen:
            seen.add(p.layout)
            faster.append(p)
    if faster:
        lines.append(f"{len(faster)} faster layout(s) do not fit in memory (the fastest: "
                     f"{faster[0].layout.short()}, {faster[0].tokens_per_s / best.tokens_per_s - 1:+.0%}).")
    return " ".join(lines)


def _closest(model: ModelConfig, preds: list[Prediction], hw: Hardware, devices: int,
             runtime: str) -> tuple[Prediction, list[str]]:
    """The least-memory layout, and the changes that would let a run fit."""
    best_p, best_est = None, None
    for p in preds:
        est = estimate_memory(model, p.layout, hw, runtime, pp_layers=p.own_split)
        p.memory_bytes, p.fits = est.total, est.fits
        if best_est is None or est.total < best_est.total:
            best_p, best_est = p, est
    usable = hw.usable_memory_bytes
    need = best_est.total / usable
    states = best_est.params + best_est.grads_step + best_est.optimizer
    lay = best_p.layout
    kept = (f" less {hw.outside_allocator_bytes / GiB:.0f} GiB for the CUDA context and NCCL"
            if hw.outside_allocator_bytes else "")
    advice = [f"The smallest footprint is {best_est.total / GiB:.1f} GiB per device "
              f"({lay.short()}), {need:.1f}x the {usable / GiB:.0f} GiB of a {hw.name}"
              f" ({hw.memory_bytes / GiB:.0f} GiB{kept})."]
    if states > usable * 0.5:
        advice.append(
            f"Parameters, gradients and optimizer states alone take {states / GiB:.1f} GiB: use "
            f"at least {math.ceil(devices * states / (usable * 0.8))} devices (ZeRO-3 and "
            "pp shard them further the more devices there are), or a device with more memory.")
    if best_est.activations > usable * 0.2:
        advice.append(
            f"Activations take {best_est.activations / GiB:.1f} GiB: shorten the sequences, or "
            "give more devices to tp/cp (which split activations); full recompute and micro-batch "
            "1 are already the least this search could use.")
    return best_p, advice
