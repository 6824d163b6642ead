"""The cost model: collectives on the links they cross, size-dependent matmul efficiency, pipeline
bubble from the simulator, and a step whose parts add up."""

from __future__ import annotations

import math

import pytest

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.parallel.pipeline.simulator import simulate
from ultrascale.planner.cost import (
    busiest_stage_layers, collective_time, gemm_time, pipeline_time, predict, split_layers,
)
from ultrascale.planner.hardware import H100, H100_PLAYBOOK, Hardware, get_hardware

MODEL = ModelConfig(preset="llama3-8b")


def test_collective_crossing_nodes_is_slower_and_all_reduce_moves_twice():
    nbytes = 256 * 2**20
    inside = collective_time(H100, "all_gather", nbytes, 8)
    across = collective_time(H100, "all_gather", nbytes, 16)
    assert across > inside
    # Same 8 ranks, but spaced one node apart: every hop crosses nodes.
    assert collective_time(H100, "all_gather", nbytes, 8, stride=8) > inside
    ag = collective_time(H100, "all_gather", nbytes, 4) - H100.intra.latency_s * 2
    ar = collective_time(H100, "all_reduce", nbytes, 4) - H100.intra.latency_s * 2
    bw_ratio = H100.intra.bw("all_gather") / H100.intra.bw("all_reduce")
    assert ar == pytest.approx(2 * ag * bw_ratio)
    assert collective_time(H100, "all_reduce", nbytes, 1) == 0.0


def test_shared_fabric_slows_wide_collectives():
    nbytes = 1 << 30
    per_node = [collective_time(H100_PLAYBOOK, "all_reduce", nbytes, 8 * k, 1) for k in (2, 8, 64)]
    assert per_node[0] < per_node[1] < per_node[2]
    # A non-blocking fabric (plain h100) keeps the bus bandwidth: only latency grows.
    wide = collective_time(H100, "all_reduce", nbytes, 512)
    assert wide < per_node[2] / 5


def test_matmul_efficiency_grows_with_size():
    small = gemm_time(H100, 256, 256, 256, "bf16")
    big = gemm_time(H100, 8192, 8192, 8192, "bf16")
    rate_small = 2 * 256**3 / small
    rate_big = 2 * 8192**3 / big
    assert rate_small < 0.2 * rate_big
    assert rate_big == pytest.approx(H100.peak("bf16") * H100.matmul_eff_max, rel=0.02)


def test_pipeline_time_matches_simulator_including_extrapolated_runs():
    assert pipeline_time("1f1b", 4, 8, 1, 1.0, 2.0) == pytest.approx((8 + 3) * 3.0)
    for sched, pp, m, v in [("1f1b", 4, 301, 1), ("interleaved", 4, 160, 2),
                            ("zero_bubble", 8, 200, 1)]:
        direct = simulate(sched, pp, m, v=v, t_f=0.5, t_b=1.0).total_time
        assert pipeline_time(sched, pp, m, v, 0.5, 1.0) == pytest.approx(direct, rel=1e-6)


def test_uneven_split_puts_the_extra_layers_on_the_busiest_rank():
    assert split_layers(28, 8) == [4, 4, 4, 4, 3, 3, 3, 3]
    assert busiest_stage_layers(ModelConfig(preset="llama3-3b"), Layout(pp=8)) == 4


def test_step_parts_add_up_and_throughput_is_consistent():
    lay = Layout(dp=4, tp=2, pp=2, zero=1, mbs=1, grad_accum=8, seq_len=4096,
                 sequence_parallel=True)
    p = predict(MODEL, lay, H100, memory=False)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)
    assert p.tokens_per_s * p.step_time_s == pytest.approx(lay.global_batch_tokens)
    assert p.tokens_per_s_per_device == pytest.approx(p.tokens_per_s / 16)
    assert p.mfu == pytest.approx(p.tokens_per_s_per_device * MODEL.flops_per_token(4096)
                                  / H100.peak("bf16"))
    for part in ("matmul", "attention", "tp_comm", "pp_bubble", "dp_comm", "zero_gather"):
        assert p.breakdown[part] > 0, part
    assert 0.2 < p.mfu < 0.8


def test_bubble_shrinks_with_micro_batches_and_interleaving():
    base = Layout(dp=1, tp=1, pp=4, mbs=1, grad_accum=8, seq_len=2048)
    few = predict(MODEL, base, H100, memory=False)
    many = predict(MODEL, base.with_(grad_accum=32), H100, memory=False)
    inter = predict(MODEL, base.with_(pp_schedule="interleaved", pp_virtual_stages=2), H100,
                    memory=False)
    share = lambda p: p.breakdown["pp_bubble"] / p.step_time_s  # noqa: E731
    assert share(many) < share(few) / 2
    assert inter.breakdown["pp_bubble"] < few.breakdown["pp_bubble"]


def test_each_knob_moves_the_cost_it_should():
    lay = Layout(dp=8, mbs=1, grad_accum=4, seq_len=4096)
    plain = predict(MODEL, lay, H100, memory=False)
    assert predict(MODEL, lay.with_(recompute="full"), H100, memory=False).breakdown[
        "recompute"] > 0.2 * plain.breakdown["matmul"] / 3
    z3 = predict(MODEL, lay.with_(zero=3), H100, memory=False)
    assert z3.breakdown.get("optimizer") < plain.breakdown["optimizer"]
    # Eight tp ranks inside a node beat sixteen spread over two.
    tp8 = predict(MODEL, Layout(dp=2, tp=8, mbs=1, grad_accum=4, sequence_parallel=True), H100,
                  memory=False)
    tp16 = predict(MODEL, Layout(dp=1, tp=16, mbs=1, grad_accum=8, sequence_parallel=True), H100,
                   memory=False)
    assert tp16.breakdown["tp_comm"] > 2 * tp8.breakdown["tp_comm"]
    cp = predict(MODEL, Layout(dp=1, cp=8, mbs=1, grad_accum=8, seq_len=32768), H100,
                 memory=False)
    assert cp.breakdown["attention"] > 0 and cp.step_time_s > 0


def test_moe_pays_the_all_to_all():
    moe = ModelConfig(preset=None, hidden_size=2048, num_layers=8, num_heads=16,
                      ffn_hidden_size=1024, vocab_size=32000, num_experts=16, experts_top_k=2)
    p = predict(moe, Layout(dp=8, ep=8, mbs=2, grad_accum=2, seq_len=4096), H100, memory=False)
    assert p.breakdown["ep_comm"] > 0
    assert math.isfinite(p.mfu)


def test_prediction_attaches_memory_and_checks_nodes():
    p = predict(MODEL, Layout(dp=8, zero=1, mbs=1, grad_accum=4, recompute="full"), H100, nodes=1)
    assert p.memory_bytes > 16e9 and p.fits is True
    with pytest.raises(ValueError, match="needs 16 devices"):
        predict(MODEL, Layout(dp=16), H100, nodes=1)


def test_hardware_profiles_round_trip_through_yaml(tmp_path):
    path = H100_PLAYBOOK.save(tmp_path / "hw.yaml")
    back = Hardware.load(path)
    assert back == H100_PLAYBOOK
    assert get_hardware(str(path)) == H100_PLAYBOOK
    for name in ("h100", "h200", "a100", "b200", "H100-SXM"):
        hw = get_hardware(name)
        assert hw.peak("bf16") > 1e14 and hw.memory_bytes > 7e10 and hw.devices_per_node == 8
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")
