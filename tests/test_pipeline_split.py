"""The planner costs the pipeline rank that is busiest under the layers' split the run uses (the
config's `parallel.pp_layers`, or the split the planner balances), not a rank holding the most
layers and the head at once."""

from __future__ import annotations

import argparse
import itertools
import json
import random

import pytest
import yaml

from ultrascale.config import ModelConfig, load_config
from ultrascale.layout import Layout
from ultrascale.planner.command import layout_config
from ultrascale.planner.command import main as plan_main
from ultrascale.planner.cost import predict, setup
from ultrascale.planner.hardware import H100
from ultrascale.theory import pipeline
from ultrascale.theory.dualpipev import dualpipev_time
from ultrascale.theory.pipeline import (
    Loads, balanced_split, pipeline_time, rank_layers, shared_pipeline_time, split_rank_layers,
)
from ultrascale.theory.terms import TERMS

# A model whose output head costs about as much as three of its layers (a large vocabulary).
HEAVY_HEAD = ModelConfig(preset="llama3-8b", num_layers=13, vocab_size=512_000)


def _layout(schedule: str = "1f1b", pp: int = 4, v: int = 1, m: int = 16) -> Layout:
    return Layout(dp=1, pp=pp, pp_virtual_stages=v, pp_schedule=schedule, grad_accum=m,
                  mbs=1, seq_len=4096, dtype="bf16")


def _loads(model, lay, split=None):
    step = setup(model, lay, H100, pp_layers=split)
    parts = [s for s in (t.seconds(step) for t in TERMS if t.seconds) if s is not None]
    return step, pipeline.loads(parts)


def _rank_loads(step, load: Loads, split) -> list[float]:
    """Each rank's forward plus backward of one micro-batch under `split` (as `placement`)."""
    pp = step.lay.pp
    layers = split_rank_layers(tuple(split), pp, step.lay.pp_schedule)
    return [n * (load.layer_f + load.layer_b)
            + (load.head_f + load.head_b) * step.schedule.ends(r, pp)[1]
            + load.embedding * step.schedule.ends(r, pp)[0] for r, n in enumerate(layers)]


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("dualpipev", 2), ("interleaved", 2)])
def test_the_balanced_split_leaves_the_busiest_rank_least_busy(schedule, v):
    """Against every split with a layer on each stage (enumerated)."""
    lay = _layout(schedule, pp=3, v=v, m=12)
    step, load = _loads(HEAVY_HEAD, lay)
    stages = lay.pp * v
    best = min(max(_rank_loads(step, load, split))
               for split in itertools.product(range(1, HEAVY_HEAD.num_layers + 1), repeat=stages)
               if sum(split) == HEAVY_HEAD.num_layers)
    split = balanced_split(step, load)
    assert sum(split) == HEAVY_HEAD.num_layers and min(split) >= 1 and len(split) == stages
    assert max(_rank_loads(step, load, split)) == pytest.approx(best, rel=1e-12)
    # The head's rank holds fewer layers than the others (it is heavy here).
    ranks = split_rank_layers(split, lay.pp, schedule)
    head_rank = next(r for r in range(lay.pp) if step.schedule.ends(r, lay.pp)[1])
    assert ranks[head_rank] < max(ranks)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("dualpipev", 2)])
def test_the_costed_rank_is_the_busiest_under_the_split(schedule, v):
    lay = _layout(schedule, v=v)
    engine = predict(HEAVY_HEAD, lay, H100, memory=False)
    balanced = predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers="balanced")
    # The engine's split gives the head's rank the extra layers: it is the busiest, and the
    # balanced split, moving layers off it, is faster.
    assert engine.costed_rank == (lay.pp - 1 if schedule == "1f1b" else 0)
    assert balanced.step_time_s < engine.step_time_s
    assert sum(balanced.breakdown.values()) == pytest.approx(balanced.step_time_s)
    # The costed rank holds what that rank holds under the split, no more.
    step, load = _loads(HEAVY_HEAD, lay, balanced.pp_layers)
    at = step.schedule.placement(step, load)
    loads = _rank_loads(step, load, balanced.pp_layers)
    assert at.rank == balanced.costed_rank and loads[at.rank] == max(loads)
    assert at.layers == rank_layers(HEAVY_HEAD, lay, balanced.pp_layers)[at.rank]
    assert at.with_head == float(step.schedule.ends(at.rank, lay.pp)[1])
    # Given as the config's split, the balanced one predicts the same step.
    again = predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers=balanced.pp_layers)
    assert again.step_time_s == pytest.approx(balanced.step_time_s, rel=1e-12)
    # A split that piles the layers on the head's rank is costed there, and slower.
    stages = lay.pp * v
    piled = [1] * stages
    piled[-1 if schedule == "1f1b" else 0] += HEAVY_HEAD.num_layers - stages
    worse = predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers=piled)
    assert worse.costed_rank == engine.costed_rank
    assert worse.step_time_s > engine.step_time_s


def test_a_split_that_does_not_fit_the_stages_is_refused():
    lay = _layout()
    with pytest.raises(ValueError, match="pp_layers"):
        predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers=[4, 4, 4])
    with pytest.raises(ValueError, match="pp_layers"):
        predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers=[0, 5, 4, 4])
    with pytest.raises(ValueError, match="balanced"):
        predict(HEAVY_HEAD, lay, H100, memory=False, pp_layers="even")


def test_dualpipev_ranks_hold_the_two_ends_of_the_v():
    """Rank r holds stages r and 2pp - 1 - r: with 5 layers over 4 stages ([1, 1, 1, 2], the
    last stage taking the extra one) rank 0 holds 3 and rank 1 2 (a loop would say 2 and 3)."""
    model = ModelConfig(preset="llama3-8b", num_layers=5)
    assert rank_layers(model, _layout("dualpipev", pp=2, v=2)) == [3, 2]
    assert rank_layers(model, _layout("interleaved", pp=2, v=2)) == [2, 3]


def _fill_gain_cases():
    """Hand-picked loads (one heavy rank first, last, in the middle; both ends heavy) and a
    seeded sample of loads from 1 to 2, on 4 and 8 ranks with 2pp and 4pp micro-batches."""
    picked = [(1, 1, 1, 1, 1, 1, 1, 2), (2, 1, 1, 1, 1, 1, 1, 1), (1.5, 1, 1, 1, 1, 1, 1, 1.5),
              (1, 1, 1.3, 1, 1, 1, 1, 1), (1, 1.2, 1.1, 1, 1.4, 1, 1, 1.05)]
    cases = [(w, 32) for w in picked]
    rng = random.Random(0)
    for _ in range(12):
        pp = rng.choice([4, 8])
        cases.append((tuple(round(rng.uniform(1, 2), 2) for _ in range(pp)),
                      rng.choice([2 * pp, 4 * pp])))
    return cases


# (schedule, virtual stages, the closed form's error bounds against the replay: below, above)
FILL_GAIN_BOUNDS = {"1f1b": (1, 0.0, 0.11), "dualpipev": (2, 0.05, 0.06),
                    "zero_bubble": (1, 0.03, 0.03), "interleaved": (2, 0.07, 0.09)}


@pytest.mark.parametrize("works,m", _fill_gain_cases())
@pytest.mark.parametrize("schedule", list(FILL_GAIN_BOUNDS))
def test_the_fill_gain_tracks_the_schedule_run_with_each_ranks_own_work(works, m, schedule):
    """The closed form `placement` uses (the schedule at the busiest rank's pace, less the share
    `Schedule.fill_gain_share` of what the lighter ranks gain in the fill and drain) against the
    simulator replaying every rank with its own stage times. The form is first-order: under 1F1B it never undercuts the replay and is at most ~10% above it
    (a heavy first rank, whose lighter successors cannot hand their slack back: 2, 1, ..., 1 is 7%
    above). On 150 seeded loads from 1 to 2 (`python benchmarks/fill_gain_vs_replay.py`): 1F1B 0 to
    +10.3%, DualPipeV -4.0% to +5.3%, zero bubble with half the slack -2.1% to +2.1% (all of it: up
    to 8.3% too fast), interleaved -6.0% to +8.2%. It is never above the uniform schedule at the
    busiest pace, which the planner costed before."""
    from ultrascale.theory.terms import schedule_of

    v, below, above = FILL_GAIN_BOUNDS[schedule]
    pp = len(works)
    f = tuple(float(w) for w in works)
    b = tuple(2 * w for w in f)
    per_chunk = (lambda x: tuple((w / 2, w / 2) for w in x)) if v == 2 else (lambda x: x)
    simulated = shared_pipeline_time(schedule, pp, m, v, per_chunk(f), per_chunk(b),
                                     cores=pp, threads=1)
    t = max(f)
    uniform = (dualpipev_time(pp, m, t, 2 * t) if schedule == "dualpipev"
               else pipeline_time(schedule, pp, m, v, t, 2 * t))
    share = schedule_of(Layout(pp=pp, pp_virtual_stages=v, pp_schedule=schedule)).fill_gain_share
    closed = max(m * 3 * t, uniform - share * (pp * 3 * t - 3 * sum(f)))
    assert closed <= uniform * (1 + 1e-12)
    assert simulated * (1 - below - 1e-12) <= closed <= (1 + above) * simulated


def test_plan_costs_the_configs_split_and_balances_on_request(tmp_path, capsys):
    """`ultrascale plan --config` costs the config's `parallel.pp_layers`; `--pp-layers balanced`
    the balanced split, which the layout's written config then carries; refused in a search."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"preset": "llama3-8b", "num_layers": 13, "vocab_size": 512_000},
        "parallel": {"pp": 4, "pp_layers": [4, 4, 4, 1]},
        "training": {"seq_len": 4096, "micro_batch_size": 1, "grad_accum_steps": 16},
        "device": "cuda"}))
    base = ["--config", str(config), "--gpu", "h100", "--json"]
    assert plan_main(base) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["pp_layers"] == [4, 4, 4, 1]
    assert plan_main(base + ["--pp-layers", "balanced"]) == 0
    balanced = json.loads(capsys.readouterr().out)
    cfg = load_config(str(config), cuda=True)
    want = predict(cfg.model, cfg.layout(), H100, memory=False, pp_layers="balanced")
    assert balanced["pp_layers"] == want.pp_layers
    assert balanced["step_time_s"] == pytest.approx(want.step_time_s, rel=1e-9)
    args = argparse.Namespace(config=str(config), preset=None, hf_config=None, gpu="h100",
                              gpus=None, layout="pp=4", pp_layers="balanced", seq_len=None,
                              global_batch_tokens=None, dtype=None, optimizer=None,
                              fp8_cache=None, fp8_experts=None)
    written = yaml.safe_load(layout_config(args))
    assert written["parallel"]["pp_layers"] == want.pp_layers
    assert plan_main(["--preset", "llama3-8b", "--gpus", "16", "--pp-layers", "balanced"]) == 2
    assert "--pp-layers applies to one layout" in capsys.readouterr().err
    assert plan_main(base + ["--pp-layers", "4,four,4,1"]) == 2
    assert "give the layers of each pipeline stage (4,4,4,1) or 'balanced'" in \
        capsys.readouterr().err
    assert plan_main(base + ["--pp-layers", "4,4,5"]) == 2
    assert "must list pp x pp_virtual_stages = 4 positive layer counts" in capsys.readouterr().err


def test_the_search_ranks_a_pipeline_with_its_layers_balanced(tmp_path, capsys):
    """`ultrascale plan --gpus N` costs each pipelined layout with the engine's split and with
    the balanced one, ranks the faster that fits, marks it `+`, and writes its split."""
    from ultrascale.config import build_config
    from ultrascale.planner.search import SearchSpace, plan

    space = SearchSpace(pp=[4], tp=[1], cp=[1], zero=[0], recompute=["none"],
                        schedules=["1f1b"])
    tokens = 16 * 4096
    result = plan(HEAVY_HEAD, 4, tokens, H100, space=space, top=3)
    best = result.ranked[0]
    engine = predict(HEAVY_HEAD, best.layout, H100, memory=False)
    assert best.split_given and best.step_time_s < engine.step_time_s
    assert best.pp_layers == predict(HEAVY_HEAD, best.layout, H100, memory=False,
                                     pp_layers="balanced").pp_layers
    assert "balanced" in result.why
    unbalanced = plan(HEAVY_HEAD, 4, tokens, H100, space=SearchSpace(
        **{**vars(space), "balance_stages": False}), top=3)
    assert all(not p.split_given for p in unbalanced.ranked + [unbalanced.smallest]
               if p is not None)
    out = tmp_path / "plan.yaml"
    assert plan_main(["--preset", "llama3-8b", "--gpus", "4", "--search-pp", "4",
                      "--search-tp", "1", "--search-zero", "0", "--search-schedules", "1f1b",
                      "--search-recompute", "none", "--global-batch-tokens", str(tokens),
                      "--config-out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = yaml.safe_load(out.read_text())
    cfg = build_config(data)
    # llama3-8b's 128K-word head outweighs a layer: its rank takes fewer of the 32 layers
    assert "-1f1b+ " in printed and "+ its layers split" in printed
    assert cfg.parallel.pp_layers[-1] < max(cfg.parallel.pp_layers)
    assert sum(cfg.parallel.pp_layers) == 32
