"""A mixture of experts under context parallel against one process at the same global batch (8
sequences a step), fp32: the tiny MoE of tests/test_expert_parallel.py (8 experts of width 32,
top-2, the first layer dense), 10 steps, per-step losses within 1e-5 relative, final weights and
the expert bias within 1e-5, the step's expert figures (load, balancing losses, dropped tokens)
equal; the first step's gradients within 1e-5; what the cp reduction of the balance statistics
moves, counted; expert memory per rank against the estimator.

Under cp each rank routes its own chunks of every sequence. The sequence-wise auxiliary loss
needs each whole sequence's expert counts (summed over cp), a capacity factor the whole
micro-batch's token order (the choices gathered over cp); everything else is token-wise, and
expert gradients sum over edp x cp (parallel/context.py, distributed/mesh.py).

Two spawns, each rank running its cases in turn:
- 4 ranks: cp4 with the auxiliary loss, a z-loss and a capacity that drops tokens, under full
  recomputation (ring); dp2 x ep2 x cp2 with ZeRO-1 (Ulysses; edp = 1: expert gradients over cp,
  dense ones over ep x cp); pp2 x cp2 with the sigmoid router and the auxiliary-loss-free bias
  (all-gather, 1F1B); the first step's gradients of dp2 x ep2 x cp2; one step's cp traffic.
- 8 ranks: dp4 x ep2 x cp2 with ZeRO-3 (edp = 2: expert gradients and shards over the edp x cp
  view, which is not contiguous on the mesh: ep sits between edp and cp).
"""

from __future__ import annotations

import pytest
import torch

import test_expert_parallel as ep
from distributed import run_ranks
from parity import shared
from ultrascale.memory.estimator import estimate

FOUR_RANKS = {  # name -> (variant of tests/test_expert_parallel.py, layout)
    "cp4-capacity-full": ("capacity", ["parallel.cp=4", "training.grad_accum_steps=4",
                                       "training.recompute=full"]),
    "dp2-ep2-cp2-ulysses-zero1": ("base", ["parallel.dp=2", "parallel.ep=2", "parallel.cp=2",
                                           "parallel.cp_mode=ulysses", "parallel.zero=1",
                                           "training.grad_accum_steps=2"]),
    "pp2-cp2-aux_free-all_gather": ("sigmoid-aux_free", ["parallel.pp=2", "parallel.cp=2",
                                                         "parallel.cp_mode=all_gather",
                                                         "parallel.pp_schedule=1f1b",
                                                         "training.grad_accum_steps=4"]),
}
EIGHT_RANKS = {
    "dp4-ep2-cp2-zero3": ("base", ["parallel.dp=4", "parallel.ep=2", "parallel.cp=2",
                                   "parallel.zero=3"]),
}
# One forward/backward of the global batch: the gradients (without ZeRO, which only shards them),
# and the traffic over cp.
GRADS = ("base", ["parallel.dp=2", "parallel.ep=2", "parallel.cp=2",
                  "parallel.cp_mode=ulysses", "training.grad_accum_steps=2"])
TRAFFIC = FOUR_RANKS["cp4-capacity-full"]


def _data(case: tuple[str, list[str]]) -> dict:
    variant, layout = case
    return ep.config(variant, layout).model_dump(mode="json")


def cp_traffic(data: dict) -> list[tuple[str, str, int, float]]:
    """Every transfer over the cp view in one forward/backward: (kind, tag, payload, wire)."""
    from ultrascale.distributed import comm

    cfg, ctx, rt = ep.build(data)
    comm.stats.record_events = True
    try:
        with comm.counting() as c:
            rt.forward_backward(ep.my_micro_batches(cfg, ctx), 1.0 / (8 * cfg.training.seq_len))
    finally:
        comm.stats.record_events = False
    return [(e.kind, e.tag, e.bytes, e.wire) for e in c.events if e.dim == "cp"]


def run_jobs(jobs: list[tuple[str, dict]]) -> list:
    return [cp_traffic(data) if kind == "traffic" else ep.run_jobs([(kind, data)])[0]
            for kind, data in jobs]


@shared
def four_ranks() -> dict:
    jobs = [("train", _data(c)) for c in FOUR_RANKS.values()]
    jobs += [("grads", _data(GRADS)), ("traffic", _data(TRAFFIC))]
    results = run_ranks(4, run_jobs, jobs)
    out = {name: [r[i] for r in results] for i, name in enumerate(FOUR_RANKS)}
    out["grads"] = [r[-2] for r in results]
    out["traffic"] = [r[-1] for r in results]
    return out


@shared
def eight_ranks() -> dict:
    results = run_ranks(8, run_jobs, [("train", _data(c)) for c in EIGHT_RANKS.values()])
    return {name: [r[i] for r in results] for i, name in enumerate(EIGHT_RANKS)}


CASES = [(4, n) for n in FOUR_RANKS] + [(8, n) for n in EIGHT_RANKS]


def _case(world: int, name: str) -> tuple[tuple[str, list[str]], list[dict]]:
    if world == 4:
        return FOUR_RANKS[name], four_ranks()[name]
    return EIGHT_RANKS[name], eight_ranks()[name]


@pytest.mark.slow
@pytest.mark.parametrize("world,name", CASES, ids=[n for _, n in CASES])
def test_experts_under_context_parallel_train_like_one_process(world, name):
    """Losses, gradient norms, final weights and buffers (the expert bias) as on one process
    (`_check_layout`: 1e-5), and the last step's expert figures: the load of every expert, the
    auxiliary loss and z-loss, the dropped tokens."""
    (variant, _), results = _case(world, name)
    ep._check_layout(name, variant, results)
    ref = ep.reference_figures(variant)
    for r in results:
        assert r["moe"].keys() == ref.keys()
        for key, value in ref.items():
            assert r["moe"][key] == pytest.approx(value, rel=1e-5), (name, key)
    if variant != "sigmoid-aux_free":
        assert ref["aux_loss"] > 0


@pytest.mark.slow
def test_first_step_gradients_match_one_process():
    ref = ep.reference_gradients()
    for grads in four_ranks()["grads"]:
        assert grads.keys() == ref.keys()
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_the_balance_statistics_cross_cp_as_the_theory_says():
    """Per MoE layer and forward (full recomputation runs each forward twice): one all-reduce of
    the per-sequence expert counts, [micro-batch, E] fp32, 2 (cp-1)/cp of it on the wire; with a
    capacity factor one all-gather of the choices, micro-batch x seq_len x top_k int64 gathered,
    (cp-1)/cp of it on the wire. Beside them only ring attention's shifts cross cp."""
    cfg = ep.config(*TRAFFIC)
    m, t, cp = cfg.model, cfg.training, cfg.parallel.cp
    forwards = (m.num_layers - m.first_k_dense) * t.grad_accum_steps * 2
    counts = t.micro_batch_size * m.num_experts * 4
    ids = t.micro_batch_size * t.seq_len * m.experts_top_k * 8
    for events in four_ranks()["traffic"]:
        by_tag: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for kind, tag, payload, wire in events:
            by_tag.setdefault((kind, tag), []).append((payload, wire))
        assert by_tag.pop(("all_reduce", "moe_sequence_counts")) == \
            [(counts, 2 * (cp - 1) / cp * counts)] * forwards
        assert by_tag.pop(("all_gather", "moe_capacity_ids")) == \
            [(ids, (cp - 1) / cp * ids)] * forwards
        assert set(by_tag) == {("ring_shift", "cp_kv"), ("ring_shift", "cp_dkv")}


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(4, "dp2-ep2-cp2-ulysses-zero1"),
                                        (8, "dp4-ep2-cp2-zero3")])
def test_expert_memory_per_rank_matches_the_estimator(world, name):
    """The routed experts' parameters, gradients and optimizer state a rank holds: E / ep experts,
    ZeRO-sharded over edp x cp."""
    (variant, layout), results = _case(world, name)
    cfg = ep.config(variant, layout)
    est = estimate(cfg.model, cfg.layout()).experts
    for r in results:
        for key in ("params", "grads", "optimizer"):
            assert r["experts_memory"][f"{key}_bytes"] == pytest.approx(est[key], rel=0.05), key
    assert est["optimizer"] > 0
