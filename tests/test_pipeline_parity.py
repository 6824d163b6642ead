"""Pipeline parallel against one process: every schedule, pp 2 and 4, tied and untied embeddings.

Each pipeline size is spawned once and trains every configuration in turn (process start-up is
the expensive part on two shared cores). Parity: per-step losses and final weights within 1e-5 of
the single-process run with the same global batch; the bytes sent between stages each step equal
the theory (one activation and one gradient per micro-batch across every stage boundary, plus the
tied embedding's gradient exchanged between the first and last stage).
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from distributed import run_ranks
from parity import (assert_parity, assert_step_grads_match, make_config, shared, spawn_cases,
                    step_grads_config, step_grads_rank, train_rank)

STEPS = 10


def _overrides(pp: int, schedule: str, m: int, v: int, tied: bool) -> list[str]:
    layers = max(4, pp * v)  # at least one layer per virtual stage
    return [f"model.num_layers={layers}", f"model.tie_embeddings={str(tied).lower()}",
            f"training.grad_accum_steps={m}", f"training.steps={STEPS}",
            f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
            f"parallel.pp_virtual_stages={v}"]


def _cases(pp: int) -> list[tuple]:
    out = []
    for tied in (True, False):
        for schedule in ("afab", "1f1b", "zero_bubble"):
            for m in (pp, 2 * pp + 1):
                out.append((pp, schedule, m, 1, tied))
        for m in (pp, 2 * pp):  # interleaved needs m divisible by pp
            out.append((pp, "interleaved", m, 2, tied))
    return out


CASES = _cases(2) + _cases(4)


def train_cases(config_dicts: list[dict]) -> list[dict]:
    """Runs in every rank: train each configuration, with the pipeline's sent bytes counted."""
    from ultrascale.distributed import comm

    reports = []
    for data in config_dicts:
        with comm.counting() as traffic:
            report = train_rank(data)
        report["sent_bytes"] = traffic.total("send", "pp", "bytes")
        report["received_bytes"] = traffic.total("recv", "pp", "bytes")
        reports.append(report)
    return reports


@shared
def _pipeline_runs(pp: int) -> dict[tuple, list[dict]]:
    cases = _cases(pp)
    dicts = [make_config(_overrides(*c)).model_dump(mode="json") for c in cases]
    per_rank = run_ranks(pp, train_cases, dicts, timeout=540.0)
    return {case: [per_rank[r][i] for r in range(pp)] for i, case in enumerate(cases)}


def _reference(pp: int, m: int, v: int, tied: bool) -> dict:
    """The same model and global batch on one process."""
    return _one_process(tuple(_overrides(pp, "1f1b", m, v, tied)[:4]))


@lru_cache(maxsize=None)
def _one_process(overrides: tuple[str, ...]) -> dict:
    return train_rank(make_config(list(overrides)).model_dump(mode="json"))


@pytest.mark.slow
@pytest.mark.parametrize("pp,schedule,m,v,tied", CASES,
                         ids=[f"pp{c[0]}-{c[1]}-m{c[2]}-v{c[3]}-{'tied' if c[4] else 'untied'}"
                              for c in CASES])
def test_pipeline_matches_one_process(pp, schedule, m, v, tied):
    results = _pipeline_runs(pp)[(pp, schedule, m, v, tied)]
    reference = _reference(pp, m, v, tied)
    for r in results:
        assert_parity(reference, r)

    cfg = make_config(_overrides(pp, schedule, m, v, tied))
    act = cfg.training.micro_batch_size * cfg.training.seq_len * cfg.model.hidden_size * 4
    embed = cfg.model.vocab_size * cfg.model.hidden_size * 4
    last = pp * v - 1
    for rank, r in enumerate(results):
        stages = [c * pp + rank for c in range(v)]
        tensors_out = sum((s < last) + (s > 0) for s in stages) * m
        tied_exchange = embed if tied and rank in (0, pp - 1) else 0
        assert r["sent_bytes"] == STEPS * (tensors_out * act + tied_exchange)
    # Every boundary carries one activation and one gradient per micro-batch, and all is received.
    sent = sum(r["sent_bytes"] for r in results)
    assert sent == STEPS * (2 * m * last * act + (2 * embed if tied else 0))
    assert sum(r["received_bytes"] for r in results) == sent


# dp 2 x pp 2: each pipeline gets half of the global batch, with every ZeRO stage. The
# data-parallel reduction runs from autograd hooks, which zero_bubble's W passes (weight gradients
# added by hand) must not outrun.
DP_CASES = [("1f1b", 3, 1, False, 0), ("zero_bubble", 3, 1, False, 0), ("zero_bubble", 3, 1, True, 0),
            ("interleaved", 2, 2, False, 0), ("1f1b", 3, 1, True, 1), ("zero_bubble", 2, 1, False, 2),
            # ZeRO-3: blocks gathered from module hooks inside the stages; the last stage's head
            # stays gathered over the step (afab runs its backwards back to back).
            ("afab", 3, 1, True, 3), ("interleaved", 2, 2, False, 3), ("zero_bubble", 3, 1, True, 3)]


@shared
def _dp_runs() -> dict[tuple, list[dict]]:
    dicts = [make_config(_overrides(2, sched, m, v, tied) + ["parallel.dp=2", f"parallel.zero={z}"]
                         ).model_dump(mode="json") for sched, m, v, tied, z in DP_CASES]
    per_rank = run_ranks(4, train_cases, dicts, timeout=540.0)
    return {case: [per_rank[r][i] for r in range(4)] for i, case in enumerate(DP_CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("case", DP_CASES, ids=[f"dp2-pp2-{c[0]}-m{c[1]}-v{c[2]}-"
                                                f"{'tied' if c[3] else 'untied'}-zero{c[4]}"
                                                for c in DP_CASES])
def test_pipeline_with_data_parallel_matches_one_process(case):
    schedule, m, v, tied, zero = case
    reference = _reference(2, 2 * m, v, tied)
    for r in _dp_runs()[case]:
        assert_parity(reference, r)


# The first step's gradients as each stage's optimizer receives them (tied embedding: both stages'
# copies, bitwise equal), for each schedule, pp 2 and 4, with dp 2 and ZeRO's shards.
GRAD_CASES = {
    2: {f"pp2-{s}-m{m}-v{v}-{'tied' if t else 'untied'}": _overrides(2, s, m, v, t)
        for s, m, v, t in [("afab", 2, 1, True), ("1f1b", 3, 1, True), ("1f1b", 2, 1, False),
                           ("zero_bubble", 3, 1, True), ("interleaved", 4, 2, True)]},
    4: {**{f"pp4-{s}-m{m}-v{v}-tied": _overrides(4, s, m, v, True)
           for s, m, v in [("1f1b", 4, 1), ("interleaved", 4, 2)]},
        **{f"dp2-pp2-{s}-m{m}-tied-zero{z}": _overrides(2, s, m, 1, True)
           + ["parallel.dp=2", f"parallel.zero={z}"]
           for s, m, z in [("1f1b", 3, 1), ("zero_bubble", 3, 3)]}},
}
GRADS = [(world, name) for world, cases in GRAD_CASES.items() for name in cases]


@shared
def _grad_runs(world: int) -> dict[str, list[dict]]:
    return spawn_cases(world, {name: ("step_grads", step_grads_config(layout))
                               for name, layout in GRAD_CASES[world].items()})


@pytest.mark.slow
@pytest.mark.parametrize("world,name", GRADS, ids=[n for _, n in GRADS])
def test_pipeline_first_step_gradients_match_one_process(world, name):
    cfg = make_config(GRAD_CASES[world][name])
    micro = cfg.global_batch_size // cfg.training.micro_batch_size
    ref = _step_grads_reference(cfg.model.num_layers, micro, cfg.model.tie_embeddings)
    pp = cfg.parallel.pp
    assert_step_grads_match(ref, _grad_runs(world)[name],
                            tied_stages=(0, pp - 1) if cfg.model.tie_embeddings else None)


@lru_cache(maxsize=None)
def _step_grads_reference(layers: int, micro_batches: int, tied: bool) -> dict:
    return step_grads_rank(step_grads_config([f"model.num_layers={layers}",
                                              f"training.grad_accum_steps={micro_batches}",
                                              f"model.tie_embeddings={str(tied).lower()}"]))


# Stages that do not divide the layers, as `ultrascale plan` writes them (`rules.layers_per_stage`,
# the engine's split: the last stages take the extra layer): 5 layers on pp 2 (2 + 3), and on
# pp 2 x 2 virtual stages (1, 1, 1, 2).
UNEVEN_CASES = [("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]


@pytest.mark.slow
def test_uneven_stages_as_the_planner_writes_them_match_one_process():
    from ultrascale.rules import layers_per_stage

    base = ["model.num_layers=5", f"training.steps={STEPS}", "training.grad_accum_steps=4"]
    dicts = []
    for schedule, v in UNEVEN_CASES:
        stages = ",".join(str(n) for n in layers_per_stage(5, 2 * v))
        dicts.append(make_config(base + ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                         f"parallel.pp_virtual_stages={v}",
                                         f"parallel.pp_layers=[{stages}]"]).model_dump(mode="json"))
    per_rank = run_ranks(2, train_cases, dicts, timeout=540.0)
    reference = _one_process(tuple(base))
    for i in range(len(UNEVEN_CASES)):
        for rank in range(2):
            assert_parity(reference, per_rank[rank][i])


def test_pipeline_refuses_schedule_it_cannot_run():
    from ultrascale.config import ConfigError
    from ultrascale.parallel.support import check_supported

    cfg = make_config(_overrides(2, "interleaved", 3, 2, True))
    with pytest.raises(ConfigError, match="multiple of pp=2. Use 2 or 4 micro-batches"):
        check_supported(cfg)
    check_supported(make_config(_overrides(2, "interleaved", 4, 2, True)))
    check_supported(make_config(_overrides(2, "1f1b", 3, 1, True) + ["parallel.dp=2",
                                                                      "parallel.zero=2"]))
    check_supported(make_config(_overrides(2, "1f1b", 3, 1, True) + ["parallel.tp=2"]))
