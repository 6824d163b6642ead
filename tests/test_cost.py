"""The cost model: collectives on the links they cross, size-dependent matmul efficiency, pipeline
bubble from the simulator, and a step whose parts add up."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.parallel.pipeline.simulator import simulate
from ultrascale.planner.cost import predict, tp_block_collectives
from ultrascale.theory.context import cp_layer_comm, cp_layer_transfers, moe_cp_layer_comm
from ultrascale.theory.pipeline import (
    busiest_params, busiest_stage_layers, pipeline_time, rank_layers, shared_pipeline_time,
)
from ultrascale.theory.rates import (
    collective_parts, collective_time, gemm_time, hidden_share, memory_time, rank_hardware,
    rank_share, tp_collective_parts,
)
from ultrascale.planner.hardware import (
    COLLECTIVES, H100, H100_PLAYBOOK, Hardware, Link, get_hardware,
)
from ultrascale.theory.shape import Shape, model_shape
from ultrascale.theory.terms import attention_of

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


def test_groups_crossing_nodes_share_the_nodes_links():
    """A data-parallel ring with one GPU per node (tp 8) runs on one GPU's share of the node's
    network, because the node's eight such rings reduce at once; a ring with all eight GPUs of
    each node in it gets the whole node's bus bandwidth."""
    nbytes = 1 << 30
    node_bw = H100.inter.bw("all_reduce")
    _, one_per_node = collective_parts(H100, "all_reduce", nbytes, 4, stride=8)
    assert one_per_node == pytest.approx(2 * 3 / 4 * nbytes / (node_bw / 8))
    _, whole_nodes = collective_parts(H100, "all_reduce", nbytes, 32, stride=1)
    assert whole_nodes == pytest.approx(2 * 31 / 32 * nbytes / node_bw)
    # Inside a node the switch gives every GPU its own links: no sharing.
    _, inside = collective_parts(H100, "all_reduce", nbytes, 4, stride=2)
    assert inside == pytest.approx(2 * 3 / 4 * nbytes / H100.intra.bw("all_reduce"))


def test_shared_fabric_slows_wide_collectives():
    nbytes = 1 << 30
    per_node = [collective_time(H100_PLAYBOOK, "all_reduce", nbytes, 8 * k, 1) for k in (2, 8, 64)]
    assert per_node[0] < per_node[1] < per_node[2]
    # A non-blocking fabric (plain h100) keeps the bus bandwidth: only latency grows.
    wide = collective_time(H100, "all_reduce", nbytes, 512)
    assert wide < per_node[2] / 5


def test_matmul_efficiency_grows_with_size():
    rates = [2 * n**3 / gemm_time(H100, n, n, n, "bf16") for n in (256, 1024, 4096, 32768)]
    assert rates == sorted(rates) and rates[0] < 0.2 * rates[-1]
    assert rates[-1] == pytest.approx(H100.peak("bf16") * H100.matmul_eff_max, rel=0.02)


def test_pipeline_time_matches_simulator_including_extrapolated_runs():
    assert pipeline_time("1f1b", 4, 8, 1, 1.0, 2.0) == pytest.approx((8 + 3) * 3.0)
    for sched, pp, m, v in [("1f1b", 4, 301, 1), ("interleaved", 4, 160, 2),
                            ("zero_bubble", 8, 200, 1)]:
        direct = simulate(sched, pp, m, v=v, t_f=0.5, t_b=1.0).total_time
        assert pipeline_time(sched, pp, m, v, 0.5, 1.0) == pytest.approx(direct, rel=1e-6)


def test_uneven_split_puts_the_extra_layers_on_the_busiest_rank():
    """The engine's split (rules.layers_per_stage): the last ranks, which hold the output head,
    take the extra layers, so the rank the prediction costs (the most layers and the head) is
    one rank."""
    model = ModelConfig(preset="llama3-3b")  # 28 layers
    assert rank_layers(model, Layout(pp=8)) == [3, 3, 3, 3, 4, 4, 4, 4]
    assert rank_layers(model, Layout(pp=3, pp_virtual_stages=2, pp_schedule="interleaved")) == [
        9, 9, 10]  # stages of 4, 4, 5, 5, 5, 5: rank r holds stages r and r + 3
    assert busiest_stage_layers(model, Layout(pp=8)) == 4


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


def test_dualpipev_pairs_hide_their_all_to_alls():
    """theory/dualpipev.py: each F&B pair hides its two chunks' expert all-to-alls under their
    compute (here A < C: all of them), so the step's `ep_comm` is 1F1B's less the costed rank's
    pairs' share, and the parts still add up to the step; on a CPU profile nothing hides, and a
    dense model has nothing to hide."""
    from ultrascale.theory.dualpipev import paired_forwards

    moe = ModelConfig(preset=None, hidden_size=2048, num_layers=8, num_heads=16,
                      ffn_hidden_size=1024, vocab_size=32000, num_experts=16, experts_top_k=2)
    lay = Layout(pp=2, dp=8, ep=8, mbs=2, grad_accum=8, seq_len=4096)
    dpv = replace(lay, pp_schedule="dualpipev", pp_virtual_stages=2)
    one, v = (predict(moe, x, H100, memory=False) for x in (lay, dpv))
    pairs = paired_forwards(2, 8, 0)
    assert pairs == 11  # of its 16 chunk forwards: the warm-up's five run alone
    assert v.breakdown["ep_comm"] == pytest.approx(one.breakdown["ep_comm"] * (1 - pairs / 16))
    assert sum(v.breakdown.values()) == pytest.approx(v.step_time_s)
    cpu, fp32 = _cpu(devices_per_node=32), {"dtype": "fp32"}
    # (A time-shared pipeline scales every part alike: the all-to-alls keep their share.)
    shares = [p.breakdown["ep_comm"] / p.breakdown["matmul"]
              for p in (predict(moe, replace(x, **fp32), cpu, memory=False) for x in (lay, dpv))]
    assert shares[1] == pytest.approx(shares[0])
    dense = predict(MODEL, replace(dpv, ep=1), H100, memory=False)
    assert "ep_comm" not in dense.breakdown


def test_ulysses_prices_mla_queries_keys_values_and_output_at_their_own_widths():
    """DeepSeek-V3's MLA under Ulysses (cp2 x tp2): per token a rank sends 64 heads of queries
    and keys 192 wide and of values and output 128 wide, not the hidden size (7,168) that a
    Llama's heads x head_dim equals; each pass's four all-to-alls priced as one message, the
    forward's twice under full recomputation. (The engine's own count equals
    `cp_layer_transfers`: tests/test_context_parallel_parity.py.)"""
    mla = ModelConfig(preset="deepseek-v3")
    lay = Layout(tp=2, cp=2, cp_mode="ulysses", mbs=1, seq_len=4096)
    m = model_shape(mla)
    sh, attention = Shape.of(m, lay), attention_of(m)
    tok, heads = 4096 // 2, 128 // 2
    q = k = tok * heads * (128 + 64) * 2  # bf16
    v = out = tok * heads * 128 * 2
    moved = cp_layer_transfers(lay, sh, attention)
    assert {tag: b for (_, tag), (_, b) in moved.items()} == {
        "cp_q": q, "cp_k": k, "cp_v": v, "cp_out": out,
        "cp_q_bwd": q, "cp_k_bwd": k, "cp_v_bwd": v, "cp_out_bwd": out}
    one_pass = collective_time(H100, "all_to_all", q + k + v + out, 2, stride=2)
    assert cp_layer_comm(lay, H100, sh, attention, 1.0, 1.0) == pytest.approx(2 * one_pass)
    full = replace(lay, recompute="full")
    assert cp_layer_comm(full, H100, Shape.of(m, full), attention, 1.0, 1.0) == pytest.approx(
        3 * one_pass)
    # The old price: queries and output at the hidden size (3,584 a rank, where it sends 12,288
    # of queries and 8,192 of output per token): 1.47 times less.
    old = 2 * collective_time(H100, "all_to_all", tok * (2 * 7168 // 2 + heads * 320) * 2, 2,
                              stride=2)
    assert cp_layer_comm(lay, H100, sh, attention, 1.0, 1.0) > 1.4 * old
    # A Llama (heads x head_dim = hidden): the same price as before, q and output at hidden.
    llama = model_shape(MODEL)
    lsh = Shape.of(llama, lay)
    kv = 2 * tok * 8 // 2 * 128 * 2
    assert cp_layer_comm(lay, H100, lsh, attention_of(llama), 1.0, 1.0) == pytest.approx(
        2 * collective_time(H100, "all_to_all", 2 * tok * 4096 // 2 * 2 + kv, 2, stride=2))


def test_moe_under_cp_pays_its_balance_statistics():
    """Under cp an MoE layer all-reduces its per-sequence expert counts (the auxiliary loss) and,
    with a capacity factor, all-gathers the choices, per forward: what parallel/context.py runs
    (tests/test_moe_context_parallel.py counts the bytes)."""
    moe = ModelConfig(preset=None, hidden_size=2048, num_layers=8, num_heads=16,
                      ffn_hidden_size=1024, vocab_size=32000, num_experts=16, experts_top_k=2,
                      first_k_dense=2)
    lay = Layout(dp=4, ep=4, cp=2, mbs=2, grad_accum=2, seq_len=16384)
    counts = collective_time(H100, "all_reduce", 2 * 16 * 4, 2)
    assert moe_cp_layer_comm(moe, lay, H100) == pytest.approx(6 / 8 * counts)
    assert moe_cp_layer_comm(moe, replace(lay, recompute="full"), H100) == pytest.approx(
        2 * 6 / 8 * counts)
    ids = collective_time(H100, "all_gather", 2 * 16384 * 2 * 8, 2)
    capped = moe.model_copy(update={"capacity_factor": 1.25})
    assert moe_cp_layer_comm(capped, lay, H100) == pytest.approx(6 / 8 * (counts + ids))
    for quiet, layout in ((moe.model_copy(update={"balance": "aux_free"}), lay),
                          (moe, replace(lay, cp=1)), (MODEL, lay)):
        assert moe_cp_layer_comm(quiet, layout, H100) == 0.0
    # In the step: the ring's shifts hide under attention at this length; the counts do not.
    with_stats = predict(moe, lay, H100, memory=False).breakdown["cp_comm"]
    without = predict(moe.model_copy(update={"balance": "none"}), lay, H100,
                      memory=False).breakdown.get("cp_comm", 0.0)
    assert with_stats > without


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
    # What the CUDA context and NCCL hold must leave the device some memory.
    assert get_hardware("h100").usable_memory_bytes == 75 * 2**30
    data = get_hardware("h100").to_dict()
    for bad in (-1, data["memory_bytes"]):
        with pytest.raises(ValueError, match="outside_allocator_bytes"):
            Hardware.from_dict(dict(data, outside_allocator_bytes=bad))
    # A fabric the whole job shares needs a capacity.
    inter = dict(data["inter"], job_fabric_bw={"all_gather": 0.0})
    with pytest.raises(ValueError, match="job_fabric_bw needs capacities above 0"):
        Hardware.from_dict(dict(data, inter=inter))


# ------------------------------------------------------------------------------------------------
# CPU profiles: ranks share the node's cores


def _cpu(**changes) -> Hardware:
    link = Link(busbw={k: 0.5e9 for k in COLLECTIVES}, latency_s=1e-3)
    hw = Hardware(name="cpu", peak_flops={"fp32": 60e9}, memory_bytes=8e9, hbm_bw=15e9,
                  devices_per_node=4, intra=link, inter=link, matmul_eff_max=1.0,
                  matmul_half_flops=1e6, attention_eff=0.3, hbm_eff=0.5, dp_overlap=0.0,
                  layer_overhead_s=1e-3, optimizer_bytes_per_param=100.0, host_cores=2)
    return hw.with_(**changes)


SMALL = ModelConfig(preset=None, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                    ffn_hidden_size=1536, vocab_size=4096)


def _cpu_layout(**kw) -> Layout:
    return Layout(seq_len=256, dtype="fp32", **kw)


def test_rank_share_of_the_cores():
    cpu = _cpu()
    assert rank_share(cpu, 4) == (0.5, 1.0)  # 4 ranks time-share 2 cores; alone, one thread
    assert rank_share(cpu, 2) == (1.0, 1.0)
    assert rank_share(cpu, 1) == (2.0, 2.0)  # one rank gets both cores as threads
    assert rank_share(cpu.with_(host_cores=None), 4) == (1.0, 1.0)  # a GPU computes on its own
    assert rank_share(H100, 8) == (1.0, 1.0)


def test_ranks_outnumbering_cores_slow_every_rank_down():
    cpu = _cpu()
    # Same work per rank (2 sequences each); twice the ranks on the same 2 cores.
    two = predict(SMALL, _cpu_layout(dp=2, mbs=2), cpu, memory=False)
    four = predict(SMALL, _cpu_layout(dp=4, mbs=2), cpu, memory=False)
    for part in ("matmul", "attention", "elementwise", "overhead"):
        assert four.breakdown[part] == pytest.approx(2 * two.breakdown[part]), part
    # The same profile read as GPUs (no shared cores) gives both the same compute.
    gpu = cpu.with_(host_cores=None)
    assert predict(SMALL, _cpu_layout(dp=4, mbs=2), gpu, memory=False).breakdown[
        "matmul"] == pytest.approx(two.breakdown["matmul"])


def test_elementwise_work_that_fits_in_a_core_cache_runs_at_the_cached_rate():
    """A CPU core's L2 holds a small micro-batch's activations: its elementwise work runs at
    `cached_eff`, a large one's mostly at `hbm_eff` (the share of the cache shrinks as 1/size);
    the gradient accumulation over the parameters stays out of the cache. Without a cache model
    (GPUs) the size does not matter."""
    cpu = _cpu(cache_bytes=2 * 2**20, cached_eff=0.8)  # hbm_eff 0.5 out of the cache
    # 256 tokens x 1536 x 4 B = 1.5 MiB fits; 2048 tokens = 12 MiB: 1/6 of it from the cache.
    assert memory_time(cpu, 1e6, working_set=1.5 * 2**20) == pytest.approx(1e6 / 15e9 / 0.8)
    assert memory_time(cpu, 1e6, working_set=12 * 2**20) == pytest.approx(
        1e6 / 15e9 * (1 / 6 / 0.8 + 5 / 6 / 0.5))
    assert memory_time(cpu, 1e6) == pytest.approx(1e6 / 15e9 / 0.5)  # parameters, logits
    assert memory_time(_cpu(), 1e6, working_set=1.5 * 2**20) == memory_time(_cpu(), 1e6)
    # In a step: the blocks' elementwise work of micro-batches of 1 sequence (256 tokens) saves
    # 1 - 0.5 / 0.8 of its time; at 8 sequences a sixth of that; the accumulation saves nothing.
    saved = {}
    for mbs in (1, 8):
        lay = _cpu_layout(dp=2, mbs=mbs, grad_accum=8 // mbs)
        flat, cached = (predict(SMALL, lay, hw, memory=False).breakdown["elementwise"]
                        for hw in (_cpu(), cpu))
        saved[mbs] = flat - cached
    assert saved[1] == pytest.approx(6 * saved[8], rel=0.05) and saved[8] > 0


def test_time_shared_pipeline_hands_idle_cores_to_busy_stages():
    lay = _cpu_layout(pp=4, mbs=1, grad_accum=8)
    shared = predict(SMALL, lay, _cpu(), memory=False)
    dedicated = predict(SMALL, lay, _cpu(host_cores=None, peak_flops={"fp32": 30e9},
                                         hbm_bw=7.5e9, layer_overhead_s=2e-3), memory=False)
    # Same per-rank speed while all four stages compute; without spare cores the bubble is the
    # schedule's (p-1)/m, with them it mostly disappears.
    assert dedicated.breakdown["pp_bubble"] > 0.2 * dedicated.step_time_s
    assert shared.breakdown.get("pp_bubble", 0.0) < dedicated.breakdown["pp_bubble"] / 2
    assert sum(shared.breakdown.values()) == pytest.approx(shared.step_time_s)
    # Never faster than the node's work over its cores: the mean stage, all ranks busy.
    one_stage = predict(SMALL, _cpu_layout(dp=4, mbs=1, grad_accum=2), _cpu(), memory=False)
    assert shared.step_time_s > 0.5 * (one_stage.breakdown["matmul"] + one_stage.breakdown[
        "attention"])


def test_no_overlap_on_a_cpu_exposes_the_whole_reduction():
    lay = _cpu_layout(dp=4, mbs=2)
    exposed = predict(SMALL, lay, _cpu(), memory=False).breakdown["dp_comm"]
    hidden = predict(SMALL, lay, _cpu(dp_overlap=1.0), memory=False).breakdown["dp_comm"]
    assert exposed > 2 * hidden
    n_params = SMALL.num_params()
    assert exposed == pytest.approx(collective_time(_cpu(), "all_reduce", 4 * n_params, 4),
                                    rel=0.02)


def test_zero3_gathers_every_micro_batch_and_reduces_once():
    one = predict(SMALL, _cpu_layout(dp=4, zero=3, mbs=1, grad_accum=2), _cpu(), memory=False)
    two = predict(SMALL, _cpu_layout(dp=4, zero=3, mbs=1, grad_accum=4), _cpu(), memory=False)
    assert two.breakdown["zero_gather"] == pytest.approx(2 * one.breakdown["zero_gather"])
    assert two.breakdown["dp_comm"] == pytest.approx(one.breakdown["dp_comm"])
    assert one.breakdown["dp_comm"] > 0


def test_optimizer_traffic_follows_the_profile_and_the_shard():
    lay = _cpu_layout(dp=4, mbs=2)
    base = predict(SMALL, lay, _cpu(), memory=False).breakdown["optimizer"]
    assert predict(SMALL, lay, _cpu(optimizer_bytes_per_param=200.0), memory=False).breakdown[
        "optimizer"] == pytest.approx(2 * base)
    assert predict(SMALL, lay.with_(zero=1), _cpu(), memory=False).breakdown[
        "optimizer"] == pytest.approx(base / 4)


def test_same_dtype_gradient_accumulation_adds_in_place():
    cpu = _cpu()
    single = predict(SMALL, _cpu_layout(tp=4, mbs=8), cpu, memory=False)  # no grad buffer, m=1
    accum = predict(SMALL, _cpu_layout(tp=4, mbs=2, grad_accum=4), cpu, memory=False)
    per_mb = lambda p, m: p.breakdown["elementwise"] / m  # noqa: E731
    # Four micro-batches of a quarter of the tokens: the token-proportional part is the same in
    # total, the in-place additions of 3 of the 4 gradients come on top.
    params = busiest_params(SMALL, _cpu_layout(tp=4))
    extra = 3 * (3 * 4 * params) / (cpu.hbm_bw * 0.5 * cpu.hbm_eff)
    assert accum.breakdown["elementwise"] - single.breakdown["elementwise"] == pytest.approx(
        extra, rel=1e-6)
    assert per_mb(accum, 4) < per_mb(single, 1)


def test_cpu_profile_round_trips_through_yaml(tmp_path):
    cpu = _cpu()
    assert Hardware.load(cpu.save(tmp_path / "cpu.yaml")) == cpu


def test_shared_pipeline_with_a_core_per_rank_is_the_schedule_simulator():
    for sched, pp, m, v in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zero_bubble", 4, 8, 1),
                            ("afab", 2, 4, 1), ("dualpipev", 4, 8, 2), ("dualpipev", 3, 7, 2)]:
        direct = simulate(sched, pp, m, v=v, t_f=1.0, t_b=2.0, t_comm=0.1).total_time
        shared = shared_pipeline_time(sched, pp, m, v, (1.0,) * pp, (2.0,) * pp, float(pp), 1.0,
                                      1, 0.1)
        assert shared == pytest.approx(direct, rel=1e-9)
        # Each chunk's own work given (dualpipev's V: a chunk is a stage) is the same here.
        halves = shared_pipeline_time(sched, pp, m, v, ((1.0 / v,) * v,) * pp,
                                      ((2.0 / v,) * v,) * pp, float(pp), 1.0, 1, 0.1)
        assert halves == pytest.approx(direct, rel=1e-9)


def test_a_time_shared_dualpipev_runs_each_chunks_own_stage():
    """On a CPU profile dualpipev is the processor-sharing replay of its V: rank 0 holds the
    embedding and the head; lighter idle ranks hand it their cores, so the bubble is below the
    dedicated simulation's."""
    lay = _cpu_layout(pp=4, mbs=1, grad_accum=8, pp_schedule="dualpipev", pp_virtual_stages=2)
    shared = predict(SMALL, lay, _cpu(), memory=False)
    dedicated = predict(SMALL, lay, _cpu(host_cores=None, peak_flops={"fp32": 30e9},
                                         hbm_bw=7.5e9, layer_overhead_s=2e-3), memory=False)
    assert shared.breakdown.get("pp_bubble", 0.0) < dedicated.breakdown["pp_bubble"] / 2
    assert sum(shared.breakdown.values()) == pytest.approx(shared.step_time_s)


def test_shared_pipeline_on_half_the_cores_is_bounded_by_the_work():
    pp, m = 4, 8
    t = shared_pipeline_time("1f1b", pp, m, 1, (1.0,) * pp, (2.0,) * pp, 2.0, 1.0)
    work = pp * m * 3.0 / 2.0  # core-seconds over 2 cores
    dedicated = simulate("1f1b", pp, m, t_f=2.0, t_b=4.0).total_time  # half a core each, always
    assert work <= t < dedicated
    # An unbalanced last stage: the others hand it their cores while they wait.
    heavy = shared_pipeline_time("1f1b", pp, m, 1, (1.0, 1.0, 1.0, 2.0), (2.0, 2.0, 2.0, 4.0), 2.0,
                                 1.0)
    assert heavy < simulate("1f1b", pp, m, t_f=4.0, t_b=8.0).total_time


def test_waiting_for_a_time_slice_only_when_ranks_outnumber_cores():
    cpu = _cpu(wakeup_s=4e-3)
    crowded = rank_hardware(cpu, *rank_share(cpu, 4))
    roomy = rank_hardware(cpu, *rank_share(cpu, 2))
    assert crowded.wakeup_s == 4e-3 and roomy.wakeup_s == 0.0
    assert collective_time(crowded, "all_reduce", 1e6, 2) == pytest.approx(
        collective_time(roomy, "all_reduce", 1e6, 2) + 4e-3)
    # tp=4 with 8 micro-batches pays the wait at each of its blocking collectives.
    lay = _cpu_layout(tp=4, mbs=1, grad_accum=8)
    slow = predict(SMALL, lay, cpu, memory=False).breakdown["tp_comm"]
    base = predict(SMALL, lay, _cpu(), memory=False).breakdown["tp_comm"]
    # Per micro-batch: 4 all-reduces per block (a CPU hides none under its GEMMs); the head's
    # input gradient, the cross-entropy's two and the embedding's one.
    per_step = 8 * (4 * SMALL.num_layers + 1 + 2 + 1)
    assert slow - base == pytest.approx(per_step * 4e-3, rel=1e-6)
    assert rank_hardware(H100, 1.0, 1.0) is H100


def _layout(**kw) -> Layout:
    base = dict(seq_len=4096, dtype="bf16", grad_accum_dtype="fp32")
    return Layout(**{**base, **kw})


def test_host_work_hides_under_device_work_as_the_profile_says():
    """Per micro-batch, the longer of device work and waits (host work per layer, collective
    latencies) counts in full and `host_overlap` of the shorter hides: small micro-batches are
    host-bound (the same time whatever their size), large ones device-bound."""
    serial = H100.with_(host_overlap=0.0)
    full = H100.with_(host_overlap=1.0, layer_overhead_s=20e-3)  # host-bound at mbs 1 and 2
    # One node, no data parallelism: the gradient reduction after the last micro-batch would hide
    # under that micro-batch's backward by an amount that depends on its size.
    lay = _layout(dp=1, tp=8, mbs=1, grad_accum=8, sequence_parallel=True)
    small, bigger = (predict(MODEL, lay.with_(mbs=m), full, memory=False) for m in (1, 2))
    # (Only the tp collectives beside the column-parallel GEMMs hide a little more at 2.)
    assert small.step_time_s == pytest.approx(bigger.step_time_s, rel=1e-3)
    assert small.dominant == "overhead"
    huge = predict(MODEL, lay.with_(mbs=64), full, memory=False)
    assert huge.breakdown.get("overhead", 0.0) == 0.0  # device-bound: the host work is hidden
    # No overlap: waits and device work add up, and the parts still sum to the step.
    p_serial = predict(MODEL, lay, serial, memory=False)
    p_half = predict(MODEL, lay, serial.with_(host_overlap=0.5), memory=False)
    assert p_half.step_time_s < p_serial.step_time_s
    for p in (p_serial, p_half, small, huge):
        assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)


def test_tp_ring_steps_wait_in_a_cluster_state_that_has_such_a_wait():
    """The playbook cluster without NVLink SHARP: every ring step of a tensor-parallel collective
    waits `tp_step_wait_s`. With a wait long enough that no GEMM hides a collective, a micro-batch
    pays it on 10 (tp - 1) steps per block, 3 (tp - 1) for the head's input, 4 (tp - 1) for the
    cross-entropy's two all-reduces, and, on the stage with the embedding, 2 (tp - 1): a cost that
    grows with tp - 1, not with the micro-batch, and the same on one node as across nodes, with or
    without pipeline parallelism."""
    wait = H100_PLAYBOOK.with_(host_overlap=0.0, tp_step_wait_s=1.0)
    healthy = wait.with_(tp_step_wait_s=0.0)
    assert H100_PLAYBOOK.tp_step_wait_s > 0 and H100.tp_step_wait_s == 0.0
    m = 4

    def tp_comm(profile: Hardware, **kw) -> float:
        lay = _layout(grad_accum=m, sequence_parallel=True, **kw)
        return predict(MODEL, lay, profile, memory=False).breakdown["tp_comm"]

    for tp, pp in ((2, 1), (8, 1), (4, 2), (8, 4)):
        for mbs in (1, 4):
            kw = dict(dp=64 // (tp * pp), tp=tp, pp=pp, mbs=mbs)
            layers = busiest_stage_layers(MODEL, _layout(**kw))
            steps = (10 * layers + 3 + 4 + (2 if pp == 1 else 0)) * (tp - 1)
            extra = tp_comm(wait, **kw) - tp_comm(healthy, **kw)
            assert extra == pytest.approx(steps * m * wait.tp_step_wait_s, rel=1e-3)
    one_node = dict(dp=1, tp=8, mbs=1)
    assert tp_comm(wait, **one_node) - tp_comm(healthy, **one_node) == pytest.approx(
        (10 * MODEL.num_layers + 9) * 7 * m * wait.tp_step_wait_s, rel=1e-3)


def test_column_parallel_backward_gathers_again_and_hides_beside_its_gemms():
    """A column-parallel linear under sequence parallelism keeps only its sharded input: backward
    gathers it again beside the input-gradient GEMM and reduce-scatters the input gradient beside
    the weight-gradient GEMM (parallel/tensor_layers.py). A block thus shows 6 collectives when its
    GEMMs outlast them and 10 when they are short against them; without sequence parallelism 2 and
    4 all-reduces. A CPU, whose cores do both, hides none."""
    model, lay = MODEL, _layout(dp=1, tp=8, mbs=1, grad_accum=1)

    def block(hw: Hardware, sp: bool, mbs: int = 1) -> tuple[float, float]:
        """(gathers, scatters) of one block that show; (all-reduces, 0) without SP."""
        lay_ = lay.with_(sequence_parallel=sp, mbs=mbs)
        return tp_block_collectives(model, lay_, hw)

    # NVLink as fast as the GEMMs allow: every collective beside a GEMM hides.
    fast = H100.with_(intra=replace(H100.intra, busbw={k: 1e15 for k in COLLECTIVES}))
    assert block(fast, sp=True, mbs=4) == (4, 2)
    assert block(fast, sp=False, mbs=4) == (2, 0)
    # On an H100 node the qkv GEMM is too short to hide its collectives, the gate/up GEMM is not.
    gathers, scatters = block(H100, sp=True, mbs=4)
    assert 4.5 < gathers < 5 and 2.5 < scatters < 3
    # Collectives stalled far beyond their GEMMs: all show.
    stalled = H100.with_(tp_step_wait_s=1.0)
    gathers, scatters = block(stalled, sp=True)
    assert gathers == pytest.approx(6, rel=1e-3) and scatters == pytest.approx(4, rel=1e-3)
    assert block(stalled, sp=False)[0] == pytest.approx(4, rel=1e-3)
    cpu = _cpu(peak_flops={"fp32": 60e9, "bf16": 60e9})
    assert block(cpu, sp=True, mbs=4) == (6, 4) and block(cpu, sp=False, mbs=4) == (4, 0)
    # The share hidden is the GEMM's length against the collective's.
    assert hidden_share((1e-3, 1e-3), 1e-3, H100) == 0.5
    assert hidden_share((1e-3, 1e-3), 5e-3, H100) == 1.0
    assert hidden_share(tp_collective_parts(H100, "all_gather", 1e6, 8), 1.0, cpu) == 0.0


def test_each_gradient_bucket_pays_the_ring_steps():
    """The gradient reduction runs one collective per bucket, and each pays the ring's per-step
    latency: 2 (n - 1) steps for ZeRO-0's all-reduce, n - 1 for ZeRO-1's reduce-scatter."""
    hw = H100.with_(dp_overlap=0.0)
    flat = hw.with_(ring_step_s=0.0)
    for zero, steps in ((0, 2 * 63), (1, 63)):
        lay = _layout(dp=64, tp=1, zero=zero, mbs=1, grad_accum=1, grad_accum_dtype="fp32",
                      bucket_mb=25.0)
        buckets = math.ceil(busiest_params(MODEL, lay) * 4 / (25 * 2**20))
        extra = (predict(MODEL, lay, hw, memory=False).breakdown["dp_comm"]
                 - predict(MODEL, lay, flat, memory=False).breakdown["dp_comm"])
        assert extra == pytest.approx(buckets * steps * hw.ring_step_s, rel=1e-9)


def test_nanotrons_zero_reduce_scatter_holds_the_backward_up():
    """Ours reduce-scatters ZeRO's gradients under the last backward, as far as `dp_overlap`
    lets; nanotron's hook waits for each bucket's reduce-scatter before the backward goes on, so
    the whole reduction shows. Its ZeRO-0 all-reduce overlaps like ours."""
    hw = H100.with_(dp_overlap=1.0)
    for zero in (0, 1):
        lay = _layout(dp=64, tp=1, zero=zero, mbs=4, grad_accum=1, grad_accum_dtype="fp32",
                      bucket_mb=25.0)
        ours = predict(MODEL, lay, hw, memory=False).breakdown["dp_comm"]
        theirs = predict(MODEL, lay, hw, memory=False, runtime="nanotron").breakdown["dp_comm"]
        exposed = predict(MODEL, lay, hw.with_(dp_overlap=0.0), memory=False).breakdown["dp_comm"]
        assert ours < 0.5 * exposed
        assert theirs == pytest.approx(exposed if zero else ours, rel=1e-9)


def test_nanotrons_pipeline_split_balances_block_costs():
    """nanotron hands blocks to pipeline ranks by cumulative cost (layers at 4 h^2 + 3 f h, the
    head at vocab x h): the 1.34B model's head weighs 4 layers, so on pp 8 it gets a rank of its
    own and the last rank holds nothing; the cost model then prices the busiest rank, not an even
    split with the head on top."""
    from ultrascale.theory.pipeline import cost_balanced_ranks

    model = ModelConfig(preset=None, hidden_size=2048, num_layers=16, num_heads=32,
                        num_kv_heads=32, ffn_hidden_size=8192, vocab_size=131072,
                        tie_embeddings=True)
    assert cost_balanced_ranks(model, 2) == [(11, False), (5, True)]
    assert cost_balanced_ranks(model, 4) == [(6, False), (5, False), (5, False), (0, True)]
    assert cost_balanced_ranks(model, 8) == [(3, False), (3, False), (2, False), (3, False),
                                             (2, False), (3, False), (0, True), (0, False)]
    lay = Layout(dp=8, pp=8, mbs=1, grad_accum=32, seq_len=4096)
    even = predict(model, lay, H100, memory=False, runtime="nanotron")
    balanced = predict(model, lay, H100, memory=False, runtime="nanotron-balanced")
    # The busiest rank holds the head alone (4 layers' worth), not 2 layers plus the head.
    assert balanced.step_time_s < 0.8 * even.step_time_s
    flat = Layout(dp=64, mbs=1, grad_accum=4, seq_len=4096)
    assert predict(model, flat, H100, memory=False, runtime="nanotron-balanced").step_time_s == (
        predict(model, flat, H100, memory=False, runtime="nanotron").step_time_s)


def test_tied_embedding_gradients_cross_between_the_first_and_last_stage():
    """With pp > 1 the first and last stage each hold the tied embedding and add each other's
    gradient after the backward: an all-reduce of the vocabulary shard's accumulation buffer over
    those two ranks, on different nodes once a stage fills a node. Untied or without a pipeline
    there is nothing to exchange."""
    tied = ModelConfig(preset="llama3-1b")
    assert tied.tie_embeddings
    lay = _layout(dp=8, tp=2, pp=2, zero=1, mbs=1, grad_accum=8, grad_accum_dtype="fp32")
    grad_bytes = tied.vocab_size * tied.hidden_size / 2 * 4
    hw = H100_PLAYBOOK.for_job(4)
    got = predict(tied, lay, H100_PLAYBOOK, memory=False).breakdown["tied_grads"]
    assert got == pytest.approx(collective_time(hw, "all_reduce", grad_bytes, 2, 16), rel=1e-9)
    # two ranks 16 apart: one GPU on each of two nodes, on its share of the node's links
    assert got > grad_bytes / hw.inter.busbw["all_reduce"] * 8 * 0.99
    untied = ModelConfig(preset="llama3-1b", tie_embeddings=False)
    assert "tied_grads" not in predict(untied, lay, H100_PLAYBOOK, memory=False).breakdown
    flat = _layout(dp=16, tp=2, pp=1, zero=1, mbs=1, grad_accum=8, grad_accum_dtype="fp32")
    assert "tied_grads" not in predict(tied, flat, H100_PLAYBOOK, memory=False).breakdown
