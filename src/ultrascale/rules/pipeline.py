"""The pipeline: how the stages split the layers (`layers_per_stage`, the one convention for stages
that do not divide them, the first stages taking the smaller shares; `split_layers`, the engine's
ranges) and what each schedule needs."""

from __future__ import annotations

from typing import Optional, Sequence

from ultrascale.rules.violation import Violation, divisors

SCHEDULES = ("afab", "1f1b", "interleaved", "zero_bubble", "dualpipev")


def pipeline_split_violations(num_layers: int, pp: int, v: int = 1,
                              pp_layers: Optional[Sequence[int]] = None,
                              rank_layers: Optional[Sequence[int]] = None) -> list[Violation]:
    """The layers of the pp x v stages: listed per stage (each at least one), per rank (none
    below zero), or split evenly (pp x v divide them)."""
    stages = pp * v
    if pp_layers is not None:
        if len(pp_layers) != stages or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            return [Violation("parallel.pp_layers", list(pp_layers),
                              f"parallel.pp_layers={list(pp_layers)} must list {stages} positive "
                              "layer counts (pp x pp_virtual_stages) summing to model.num_layers="
                              f"{num_layers}")]
    elif rank_layers is not None:
        if len(rank_layers) != pp or sum(rank_layers) != num_layers or min(rank_layers) < 0:
            return [Violation("pp_layers", list(rank_layers),
                              f"pp_layers={list(rank_layers)} must list pp={pp} layer counts, one "
                              f"per pipeline rank, summing to model.num_layers={num_layers}")]
    elif num_layers % stages:
        return [Violation("parallel.pp", pp,
                          f"parallel.pp={pp} x parallel.pp_virtual_stages={v} does not divide "
                          f"model.num_layers={num_layers}",
                          f"Choose them so their product is among {divisors(num_layers)}, or list "
                          "the layers of each stage in parallel.pp_layers")]
    return []


def layers_per_stage(num_layers: int, stages: int) -> list[int]:
    """Layers of each of `stages` consecutive (virtual) stages, as even as possible, the first
    stages (which also embed) taking the smaller shares: the engine's split, which the estimator
    and the planner assume too. Stages beyond the layers get none (`split_layers` refuses that)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s >= stages - extra else 0) for s in range(stages)]


def split_layers(num_layers: int, pp: int, v: int = 1,
                 pp_layers: Optional[Sequence[int]] = None) -> list[range]:
    """Global layer indices of every virtual stage, in stage order (parallel/pipeline/stage.py
    cuts the model with them). `pp_layers` lists the layer count of each of the pp*v stages;
    otherwise `layers_per_stage`. Raises ValueError unless every stage gets a layer."""
    counts = list(pp_layers) if pp_layers is not None else layers_per_stage(num_layers, pp * v)
    broken = pipeline_split_violations(num_layers, pp, v, counts)
    if broken:
        raise ValueError(broken[0].message)
    bounds, start = [], 0
    for n in counts:
        bounds.append(range(start, start + n))
        start += n
    return bounds


def schedule_violations(layout, num_layers: Optional[int] = None) -> list[Violation]:
    """What the pipeline schedules need (parallel/pipeline/schedules.py runs them): the
    interleaved one, pp >= 2, v >= 2 and micro-batches in groups of pp; dualpipev, pp >= 2, v = 2
    and at least 2 pp micro-batches; with `num_layers`, at least one layer per virtual stage."""
    pp, v, m, name = layout.pp, layout.pp_virtual_stages, layout.grad_accum, layout.pp_schedule
    out = []

    def bad(reason: str, fix: str) -> None:
        out.append(Violation("parallel.pp_schedule", name, reason, fix))

    if name == "interleaved":
        if pp < 2:
            bad("The 'interleaved' schedule needs pp >= 2 (with one rank there is no bubble to "
                "shrink)", "Use pp_schedule=1f1b or raise parallel.pp")
        if v < 2:
            bad(f"The 'interleaved' schedule needs pp_virtual_stages >= 2 (got {v}); with one "
                "chunk per rank it is plain 1F1B", "Set pp_virtual_stages=2 or pp_schedule=1f1b")
        if pp >= 1 and m % pp:
            # Micro-batches go round the ranks in groups of pp per chunk; a short last group
            # would leave the first rank waiting for its own chunk's input.
            lo, hi = (m // pp) * pp, (m // pp + 1) * pp
            bad(f"The 'interleaved' schedule needs the number of micro-batches (grad_accum_steps="
                f"{m}) to be a multiple of pp={pp}", f"Use {f'{lo} or {hi}' if lo else hi} "
                "micro-batches")
    if name == "dualpipev":
        if pp < 2:
            bad("The 'dualpipev' schedule needs pp >= 2 (its V goes down the ranks and back up)",
                "Use pp_schedule=1f1b or raise parallel.pp")
        if v != 2:
            bad(f"The 'dualpipev' schedule runs two chunks per rank (stages r and 2pp-1-r, the "
                f"V); got pp_virtual_stages={v}", "Set parallel.pp_virtual_stages=2")
        if m < 2 * pp:
            bad(f"The 'dualpipev' schedule needs at least 2 x pp = {2 * pp} micro-batches "
                f"(grad_accum_steps={m})", f"Use {2 * pp} or more")
    if num_layers is not None and num_layers < pp * v:
        bad(f"{num_layers} layers do not fit {pp} pipeline ranks x {v} virtual stages = "
            f"{pp * v} stages (each needs at least one layer)",
            "Lower pp or pp_virtual_stages, or use a deeper model")
    return out
