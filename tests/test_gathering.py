"""theory/gathering.py: ZeRO-3's gathering replayed over a pipeline rank's program, its shortcuts
against the full replay, and what the estimator and the planner make of it. (The replay against
the engine's counted all-gathers and `peak_gathered_bytes`: tests/test_pipeline_dualpipev.py.)"""

from __future__ import annotations

import pytest

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.memory.estimator import estimate
from ultrascale.parallel.pipeline.schedules import build_schedule
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import H100
from ultrascale.theory.gathering import Unit, gathering, replay

# A layer whose gradients wait for W, an MoE layer (its experts' bucket gets its gradients in I),
# the embedding, and the head (used outside its first module: kept gathered on a stage).
LAYER, MOE = Unit(((10.0, True),)), Unit(((6.0, True), (9.0, False)))
EMBEDDING, HEAD = Unit(((7.0, False),)), Unit(((13.0, False),), covered=False)


def _rank(pp: int, v: int, rank: int, pattern: int) -> tuple[tuple, tuple]:
    """Two layers a chunk (dense or MoE by `pattern`), the embedding on rank 0's first chunk, the
    head on the last rank's last chunk."""
    units, chunks = [], []
    for c in range(v):
        chain = []
        if c == 0 and rank == 0:
            units.append(EMBEDDING)
            chain.append(len(units) - 1)
        for i in range(2):
            units.append((LAYER, MOE, LAYER)[(i + pattern) % 3])
            chain.append(len(units) - 1)
        if c == v - 1 and rank == pp - 1:
            units.append(HEAD)
            chain.append(len(units) - 1)
        chunks.append(tuple(chain))
    return tuple(units), tuple(chunks)


def _cases():
    for name in ("afab", "1f1b", "interleaved", "zero_bubble", "dualpipev"):
        v = 2 if name in ("interleaved", "dualpipev") else 1
        for pp in (2, 3, 4):
            for m in range(1, 6 * pp + 2):
                try:
                    build_schedule(name, pp, m, v)
                except ValueError:  # sizes the schedule refuses
                    continue
                yield name, pp, m, v


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved", "zero_bubble", "dualpipev"])
def test_the_steady_state_extension_is_the_full_replay(name):
    """Past 3pp micro-batches `gathering` replays two short runs and extends them: the peak, the
    bytes and the calls equal the full replay's; gathered once a step, every bucket once and the
    whole stage held."""
    for sched, pp, m, v in _cases():
        if sched != name:
            continue
        for rank in range(pp):
            for pattern in range(3):
                units, chunks = _rank(pp, v, rank, pattern)
                assert gathering(sched, pp, m, v, rank, units, chunks, False) == \
                    replay(sched, pp, m, v, rank, units, chunks, False), (pp, m, rank, pattern)
                once = replay(sched, pp, m, v, rank, units, chunks, True)
                assert gathering(sched, pp, m, v, rank, units, chunks, True) == once
                stage = sum(b for u in set(u for c in chunks for u in c)
                            for b, _ in units[u].buckets)
                assert once.peak == once.total == stage and once.backward == 0


def test_gathering_for_every_use_moves_2m_times_what_a_step_gathers():
    """1F1B frees every unit after each use: each covered unit twice a micro-batch, the head
    once; a split backward leaves the layers gathered from I to W, so zero bubble's last rank
    gathers less, and holds more."""
    pp, m = 2, 4
    units, chunks = _rank(pp, 1, pp - 1, 0)
    covered = sum(b for u in units if u.covered for b, _ in u.buckets)
    head = sum(b for b, _ in HEAD.buckets)
    one = replay("1f1b", pp, m, 1, pp - 1, units, chunks, False)
    assert one.total == 2 * m * covered + head
    zb = replay("zero_bubble", pp, m, 1, pp - 1, units, chunks, False)
    assert zb.total < one.total
    first = _rank(pp, 1, 0, 2)  # the embedding and two layers: 1F1B holds two units at most
    assert replay("1f1b", pp, m, 1, 0, *first, False).peak == 10 + 10
    assert replay("zero_bubble", pp, m, 1, 0, *first, False).peak == 7 + 10 + 10


def test_the_estimator_holds_the_stage_gathered_once_a_step():
    model = ModelConfig(preset="llama3-8b")
    base = Layout(dp=8, pp=4, zero=3, grad_accum=16, seq_len=4096)
    step = estimate(model, base.with_(zero3_gather="step"), stage=1)
    each = estimate(model, base.with_(zero3_gather="micro_batch"), stage=1)
    auto = estimate(model, base, stage=1)
    assert auto.comm_parts == step.comm_parts  # auto: step under pp
    held, layers = step.comm_parts["ZeRO-3 gathered parameters"], 32 // 4
    assert held == pytest.approx(layers * each.comm_parts["ZeRO-3 gathered parameters"] / 2)
    assert step.total > each.total
    # The gradients accumulate whole over the 16 micro-batches, in both modes.
    assert step.comm_parts["ZeRO-3 gradients before reduce-scatter"] == \
        each.comm_parts["ZeRO-3 gradients before reduce-scatter"] > held


def test_the_planner_pays_the_gathers_once_a_step_or_for_every_micro_batch():
    model = ModelConfig(preset="llama3-70b")
    lay = Layout(dp=8, tp=8, pp=4, zero=3, grad_accum=32, seq_len=4096, sequence_parallel=True)
    once = predict(model, lay.with_(zero3_gather="step"), H100, memory=False)
    each = predict(model, lay.with_(zero3_gather="micro_batch"), H100, memory=False)
    assert each.breakdown["zero_gather"] > 10 * once.breakdown.get("zero_gather", 0.0)
    assert each.step_time_s > once.step_time_s


def test_multi_token_prediction_is_gathered_with_the_head():
    """models/mtp.py's modules run outside module calls: ZeRO-3 gathers them with the head for
    the loss's backward, so the replay's head unit holds them (deepseek-v3 under pp2 zero bubble
    with ZeRO-3, cut to 4 layers: the estimate without them read 18.7% under the engine's step
    on fake tensors, -5.1% with them)."""
    from ultrascale.params import layer_params
    from ultrascale.theory.gathering import rank_units

    m = ModelConfig(preset="deepseek-v3", num_layers=4)
    lay = Layout(dp=16, tp=4, pp=2, zero=3, pp_schedule="zero_bubble", grad_accum=8)
    units, chunks = rank_units(m, lay, 1, 2, 2, False, True, False, 2)
    head = units[chunks[0][-1]]
    block, experts = layer_params(m, 4, 1, False, moe=True)
    vocab = -(-m.vocab_size // 4) * m.hidden_size
    h = m.hidden_size
    own = 3 * h + 2 * h * h + block + vocab  # the block's own embedding copy (rank 0 embeds)
    assert [b for b, _ in head.buckets] == [(vocab + h) * 2, own * 2, experts * 2]
    plain = rank_units(ModelConfig(preset="mixtral-8x7b", num_layers=4), lay, 1, 2, 2, False,
                       True, False, 2)
    assert len(plain[0][plain[1][0][-1]].buckets) == 1


def test_a_ranks_dense_layers_follow_its_chunks():
    """DualPipeV places stages r and 2pp - 1 - r on rank r: deepseek-v3 cut to 4 layers (3 dense)
    on pp2 puts layer 0 (dense) and layer 3 (MoE, with the head and MTP) on rank 0, layers 1 and
    2 (dense) on rank 1; taken as one run each, rank 1 held the MoE layer (the estimate read 24%
    under the engine's step on fake tensors, +1.9% now)."""
    from ultrascale.theory.shape import model_shape
    from ultrascale.theory.stages import rank_dense_layers

    m = ModelConfig(preset="deepseek-v3", num_layers=4)
    lay = Layout(dp=16, pp=2, ep=8, zero=3, pp_schedule="dualpipev", pp_virtual_stages=2,
                 grad_accum=8)
    assert rank_dense_layers(model_shape(m), lay, (1, 1, 1, 1)) == (1, 2)
    one_f_one_b = Layout(dp=16, pp=2, ep=8, zero=3, pp_schedule="1f1b", grad_accum=8)
    assert rank_dense_layers(model_shape(m), lay) == (1, 2)  # the engine's split, the same
    assert rank_dense_layers(model_shape(m), one_f_one_b) is None  # one run per rank: exact
    first, second = (estimate(m, lay, stage=s) for s in (0, 1))
    assert first.experts["grads"] > 0 and second.experts["grads"] == 0
