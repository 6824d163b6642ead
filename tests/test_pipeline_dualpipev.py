"""DualPipeV, zero bubble under tensor parallel, and ZeRO-3's two gathering modes under pp, against
one process at the same global batch, fp32.

One 4-rank spawn trains every case for 2 steps: dualpipev on pp4; on pp2 with dp2 ZeRO-1, with tp2
and sequence parallel, with dp2 x ep2 experts (whose paired forward and backward take turns at the
all-to-alls), also under full recomputation; zero_bubble with tp2 and sequence parallel (the column matmuls' weight gradients
deferred to W); ZeRO-3 on dp2 x pp2 under 1F1B, interleaved, zero_bubble and dualpipev,
gathering once a step and for each forward and backward. Parity: per-step losses within 1e-5, gradient norms (step 1 within
1e-5: the same sums reassociated; step 2 within 1e-4: Adam turns the round-off of near-zero
gradients into visible weight differences), and, without ZeRO, every weight's first-step gradient
within 1e-5 of the tensor's largest element (a W pass whose gradients were 1 + 1e-4 times too
large failed the step-1 norms of every split-backward case: checked once). Traffic: the
activations and gradients each rank sends equal `executor.p2p_bytes_per_step` and the theory's
(none across dualpipev's turn on the last rank, none for a tied embedding whose two ends share
rank 0); ZeRO-3's all-gathers equal each unit's bytes once a step, or 2m times (the head, used
outside a module call, once) under 1F1B and interleaved, and under every schedule the replay of
theory/gathering.py, which also gives the peak held gathered.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest
import torch

from distributed import run_ranks
from parity import TINY, make_config

STEPS = 2
MOE = copy.deepcopy(TINY)
MOE["model"].update(num_experts=8, experts_top_k=2, moe_ffn_hidden_size=32, first_k_dense=1,
                    z_loss_coeff=1e-3)
DUALPIPEV = ["parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2"]

# name -> (base, layout, one-process reference: (layers, micro-batches))
CASES = {
    "dualpipev-pp4": (TINY, ["parallel.pp=4", "parallel.dp=1", "model.num_layers=8",
                             "training.grad_accum_steps=8"] + DUALPIPEV, (8, 8)),
    "dualpipev-pp2-dp2-zero1": (TINY, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1",
                                       "training.grad_accum_steps=4"] + DUALPIPEV, (4, 8)),
    "dualpipev-pp2-tp2-sp": (TINY, ["parallel.pp=2", "parallel.dp=1", "parallel.tp=2",
                                    "parallel.sequence_parallel=true",
                                    "training.grad_accum_steps=4"] + DUALPIPEV, (4, 4)),
    "dualpipev-pp2-dp2-ep2-moe": (MOE, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                                        "training.grad_accum_steps=4"] + DUALPIPEV, (4, 8)),
    # Full recomputation repeats each forward inside its backward, which must take the branch
    # (split or not) the forward took, in the helper thread of a paired backward too.
    "dualpipev-pp2-dp2-ep2-moe-full": (MOE, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                                             "training.recompute=full",
                                             "training.grad_accum_steps=4"] + DUALPIPEV, (4, 8)),
    "zero_bubble-pp2-tp2-sp": (TINY, ["parallel.pp=2", "parallel.dp=1", "parallel.tp=2",
                                      "parallel.sequence_parallel=true",
                                      "parallel.pp_schedule=zero_bubble",
                                      "training.grad_accum_steps=4"], (4, 4)),
}
for _schedule, _v, _m in (("1f1b", 1, 2), ("interleaved", 2, 2), ("zero_bubble", 1, 2),
                          ("dualpipev", 2, 4)):
    for _mode in ("step", "micro_batch"):
        CASES[f"zero3-{_schedule}-{_mode}"] = (
            TINY, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
                   f"training.grad_accum_steps={_m}", f"parallel.pp_schedule={_schedule}",
                   f"parallel.pp_virtual_stages={_v}", f"parallel.zero3_gather={_mode}"],
            (4, 2 * _m))


def _config(base: dict, overrides: list[str]):
    return make_config(overrides + [f"training.steps={STEPS}"], base=base)


def train_case(data: dict) -> dict:
    """Runs in each rank: train; the losses, gradient norms, the first step's gradients (whole,
    by plain name; without ZeRO), the bytes sent between stages, ZeRO-3's gathers and units, and
    how often paired chunks handed the turn over."""
    import ultrascale.train.trainer as trainer
    from ultrascale.config import Config
    from ultrascale.distributed import comm

    cfg = Config.model_validate(data)
    runtimes, first = [], {}
    real = trainer.parallelize

    def keep(*args, **kwargs):
        rt = real(*args, **kwargs)
        runtimes.append(rt)
        clip = rt.clip_grad_norm

        def clip_and_keep(max_norm):  # the reduced gradients of step 1, before clipping
            if not first and cfg.parallel.zero == 0:
                first.update(rt.gather_full({n: p.grad.detach().clone()
                                             for n, p in rt.named_parameters()}))
            return clip(max_norm)

        rt.clip_grad_norm = clip_and_keep
        return rt

    trainer.parallelize = keep
    try:
        with comm.counting() as traffic:
            result = trainer.train(cfg, generate_sample=False)
    finally:
        trainer.parallelize = real
    rt = runtimes[0]
    out = {"losses": result.losses, "grad_norms": result.grad_norms, "grads": first,
           "sent": traffic.total("send", "pp"), "received": traffic.total("recv", "pp"),
           "gathered": traffic.total("all_gather", "dp"), "pp_rank": rt.ctx.coord("pp"),
           "handovers": getattr(rt.schedule, "executor", None) and rt.schedule.executor.handovers}
    if cfg.parallel.zero == 3:
        owner = rt.data_parallel
        out["units"] = [(sum(b.padded * b.flat_param.element_size() for b in u.buckets),
                         u.covered) for u in owner.units]
        out["peak_gathered"] = owner.peak_gathered_bytes
    return out


def run_cases(dicts: list[dict]) -> list[dict]:
    return [train_case(d) for d in dicts]


@lru_cache(maxsize=None)
def _runs() -> dict[str, list[dict]]:
    dicts = [_config(base, layout).model_dump(mode="json") for base, layout, _ in CASES.values()]
    per_rank = run_ranks(4, run_cases, dicts, timeout=1500.0)
    return {name: [per_rank[r][i] for r in range(4)] for i, name in enumerate(CASES)}


@lru_cache(maxsize=None)
def _reference(moe: bool, layers: int, m: int) -> dict:
    cfg = _config(MOE if moe else TINY, [f"model.num_layers={layers}",
                                         f"training.grad_accum_steps={m}"])
    return train_case(cfg.model_dump(mode="json"))


def _assert_matches(ref: dict, r: dict) -> None:
    torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
    norms, ref_norms = r["grad_norms"], ref["grad_norms"]
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5)
    assert norms[1:] == pytest.approx(ref_norms[1:], rel=1e-4)
    for name, g in r["grads"].items():  # this rank's stage
        want = ref["grads"][name]
        assert (g - want).abs().max() <= 1e-5 * want.abs().max(), name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(name):
    base, layout, (layers, m) = CASES[name]
    reference = _reference(base is MOE, layers, m)
    results = _runs()[name]
    for r in results:
        _assert_matches(reference, r)
    if _config(base, layout).parallel.zero == 0:
        held = set().union(*(r["grads"] for r in results))
        assert held == set(reference["grads"])  # every weight's gradient was compared


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("zero3")])
def test_stages_send_what_the_schedule_says(name):
    """The counted point-to-point bytes of each rank: the executor's and the theory's figure
    (theory/pipeline.py `p2p_bytes_per_step`, whose transfers the planner charges), plus a tied
    embedding's gradient where its two copies sit on two ranks."""
    from ultrascale.parallel.pipeline.executor import p2p_bytes_per_step
    from ultrascale.parallel.pipeline.schedules import placement_of
    from ultrascale.parallel.pipeline.stage import tied_peer
    from ultrascale.theory import pipeline as theory

    cfg = _config(*CASES[name][:2])
    p, t, mc = cfg.parallel, cfg.training, cfg.model
    where = placement_of(p.pp_schedule)
    shards = p.tp if p.sequence_parallel else 1
    activation = t.micro_batch_size * t.seq_len * mc.hidden_size * 4 // shards
    embedding = mc.vocab_size * mc.hidden_size * 4 // p.tp  # this tp rank's rows
    for r in _runs()[name]:
        expected = p2p_bytes_per_step(p.pp, p.pp_virtual_stages, t.grad_accum_steps, r["pp_rank"],
                                      activation, where)
        assert theory.p2p_bytes_per_step(cfg.layout(), r["pp_rank"], activation) == expected
        # The tied embedding's gradient goes to its other copy, unless (dualpipev) both ends of
        # the model share rank 0 and hold one copy.
        if tied_peer(r["pp_rank"], p.pp, mc.tie_embeddings, where, p.pp_virtual_stages) is not None:
            expected += embedding
        assert r["sent"] == STEPS * expected
    assert sum(r["sent"] for r in _runs()[name]) == sum(r["received"] for r in _runs()[name])


@pytest.mark.slow
def test_paired_chunks_take_turns_at_the_expert_all_to_alls():
    for r in _runs()["dualpipev-pp2-dp2-ep2-moe"]:
        assert r["handovers"] > 0
    assert _runs()["dualpipev-pp4"][0]["handovers"] == 0  # dense: nothing to overlap


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("zero3")])
def test_zero3_gathering_is_the_theorys(name):
    """Each rank's counted all-gathers and its most parameter bytes held gathered at once
    (`peak_gathered_bytes`) equal theory/gathering.py's replay of its program, exactly (every
    unit of this model is a whole number of shards: no padding); the memory estimate holds that
    peak, and the planner's costed rank (the head's) gathers what the engine counted there."""
    from ultrascale.memory.estimator import estimate
    from ultrascale.planner.cost import setup
    from ultrascale.planner.hardware import H100
    from ultrascale.theory import data

    cfg = _config(*CASES[name][:2])
    lay = cfg.layout()
    step = setup(cfg.model, lay, H100)
    costed = data.costed_gathering(step)
    for r in _runs()[name]:
        est = estimate(cfg.model, lay, stage=r["pp_rank"])
        stage = est.stage
        layers = cfg.model.num_layers // lay.pp
        g = data.gathering_of(step.model, lay, stage, layers, layers * stage,
                              *step.schedule.ends(stage, lay.pp), False)
        assert r["gathered"] == STEPS * g.total, r["pp_rank"]
        assert r["peak_gathered"] == g.peak == est.comm_parts["ZeRO-3 gathered parameters"]
        if step.schedule.ends(stage, lay.pp)[1]:
            assert r["gathered"] == STEPS * costed.total


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_zero3_gathers_once_a_step_or_for_every_use(schedule):
    m = 2
    for mode in ("step", "micro_batch"):
        for r in _runs()[f"zero3-{schedule}-{mode}"]:
            per_step = sum(nbytes * (1 if mode == "step" or not covered else 2 * m)
                           for nbytes, covered in r["units"])
            assert r["gathered"] == STEPS * per_step, (mode, r["pp_rank"])
    step, each = (_runs()[f"zero3-{schedule}-{mode}"] for mode in ("step", "micro_batch"))
    assert all(a["gathered"] < b["gathered"] for a, b in zip(step, each))


def test_dualpipev_and_zero3_gather_refusals():
    from ultrascale.config import ConfigError
    from ultrascale.parallel.support import check_supported

    with pytest.raises(ConfigError, match="dualpipev.*at least 2 x pp = 4 micro-batches"):
        check_supported(make_config(["parallel.pp=2", "parallel.dp=1",
                                     "training.grad_accum_steps=3"] + DUALPIPEV))
    named = ["parallel.pp=2", "parallel.dp=1", "training.grad_accum_steps=4",
             "parallel.pp_schedule=dualpipev"]
    with pytest.raises(ConfigError, match="two chunks per rank.*pp_virtual_stages=2"):
        check_supported(make_config(named + ["parallel.pp_virtual_stages=1"]))
    # Named without a chunk count, the schedule takes its V's two, in a config, `--layout` and
    # the memory command's flags alike.
    assert make_config(named).parallel.pp_virtual_stages == 2
    from ultrascale.layout import parse_layout
    assert parse_layout("pp=2,schedule=dualpipev").pp_virtual_stages == 2
    assert parse_layout("pp=2,schedule=dualpipev,vpp=1").pp_virtual_stages == 1
    from test_cli_user import run_cli
    code, out, err = run_cli("memory", "--preset", "tiny", "--pp", "2", "--dp", "1",
                             "--pp-schedule", "dualpipev", "--grad-accum", "4")
    assert code == 0, err
    check_supported(make_config(["parallel.pp=2", "parallel.tp=2", "parallel.dp=1",
                                 "parallel.pp_schedule=zero_bubble"]))
    with pytest.raises(ConfigError, match="zero3_gather"):
        make_config(["parallel.zero3_gather=sometimes"])
