"""Calibration: the efficiency-curve fit, and a measured profile the planner can plan with."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import yaml

from cli_helpers import ultrascale

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner import calibrate as cal
from ultrascale.planner import probes
from ultrascale.planner.calibrate import fit_efficiency_curve, main as calibrate_main
from ultrascale.planner.cost import block_times, predict
from ultrascale.planner.hardware import GPU_OUTSIDE_ALLOCATOR, Hardware, Link, get_hardware
from ultrascale.theory.rates import cast_time, collective_time


def test_efficiency_curve_recovers_peak_and_half_size():
    peak, half = 50e9, 3e7
    pts = [(f, peak * f / (f + half)) for f in (1e5, 1e6, 1e7, 1e8, 1e9)]
    got_peak, got_half = fit_efficiency_curve(pts)
    assert got_peak == pytest.approx(peak, rel=1e-3)
    assert got_half == pytest.approx(half, rel=1e-3)


def test_efficiency_curve_without_saturation_takes_the_best_rate():
    pts = [(1e6, 1e8), (1e7, 1e9), (1e8, 1e10)]  # still rising tenfold per size
    peak, half = fit_efficiency_curve(pts)
    assert peak == 1e10 and half == 0.0


def test_efficiency_curve_matches_scipys_least_squares_on_noisy_points():
    """The numpy fit (planner/curves.py) finds the least-squares optimum that scipy's solver found:
    no larger error in log space on 50 noisy curves (scipy stays a test requirement)."""
    import numpy as np
    from scipy.optimize import least_squares

    rng = np.random.default_rng(0)
    f = np.array([2.0 * n**3 for n in probes.MATMUL_SIZES])
    for _ in range(50):
        peak, half = 10 ** rng.uniform(9, 12), 10 ** rng.uniform(4, 9)
        r = peak * f / (f + half) * np.exp(rng.normal(0, 0.05, len(f)))

        def err(z):
            return np.log(np.exp(z[0]) * f / (f + np.exp(z[1]))) - np.log(r)

        ours = fit_efficiency_curve(list(zip(f, r)))
        ref = least_squares(err, np.log([r.max(), np.median(f)])).x
        if ours[1] == 0.0:  # not identified: scipy's peak runs off as well
            assert np.exp(ref[0]) > 4 * r.max()
            continue
        assert np.sum(err(np.log(ours)) ** 2) <= np.sum(err(ref) ** 2) * (1 + 1e-6) + 1e-15


def test_spearman_is_scipys_with_ties():
    import numpy as np
    from scipy.stats import spearmanr

    from ultrascale.planner.curves import spearman

    rng = np.random.default_rng(1)
    for _ in range(20):
        x, y = list(rng.integers(0, 4, 12).astype(float)), list(rng.normal(size=12))
        assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)


def _synthetic_figures(ranks: int, share: float) -> tuple[dict, dict]:
    """What `ranks` processes would measure on a machine with known per-core figures, each rank
    running on `share` of a core."""
    true = dict(peak=50e9, half=2e6, half_dim={"fp32": 20.0, "bf16": 60.0},
                half_bf16=8e6, attention_eff=0.3, attention_eff_bf16=0.08,
                attention_by_dim={"fp32": {32: 0.2, 64: 0.3, 128: 0.35},
                                  "bf16": {32: 0.05, 64: 0.08, 128: 0.1}},
                hbm=12e9, hbm_eff=0.4, overhead=1e-3, overhead_bf16=1.2e-3,
                update_s_per_param=12e-9, lat=2e-3, busbw=0.5e9, wakeup=4e-3,
                cache_bytes=2 * 2**20, cached_eff=0.7, hbm_eff_bf16=0.2, cached_eff_bf16=0.3)
    comp = {}
    peaks = {"fp32": true["peak"], "bf16": 2 * true["peak"]}
    halves = {"fp32": true["half"], "bf16": true["half_bf16"]}
    shapes = [(n, n, n) for n in probes.MATMUL_SIZES] + probes.NARROW_GEMMS
    for dtype in probes.DTYPES:
        for tokens, d_in, d_out in shapes:
            f, d = 2.0 * tokens * d_in * d_out, min(tokens, d_in, d_out)
            rate = peaks[dtype] * f / (f + halves[dtype]) * d / (d + true["half_dim"][dtype])
            comp[probes.matmul_probe(dtype, tokens, d_in, d_out)] = 3 * f / rate / share
        a = probes.ATTENTION
        for dim, eff in true["attention_by_dim"][dtype].items():
            comp[probes.attention_probe(dtype, dim)] = (
                3.5 * probes.attention_flops(a["seq"], a["heads"], dim, a["batch"])
                / (peaks[dtype] * eff) / share)
    comp["copy"] = 2 * 16 * 2**20 * 4 / true["hbm"] / share
    comp["overhead"] = true["overhead"] / min(1.0, share)
    comp["overhead/bf16"] = true["overhead_bf16"] / min(1.0, share)
    # The elementwise work of a block at both probe sizes, the bytes the cost model counts at the
    # true rates in and out of a core's cache.
    hw = Hardware(name="t", peak_flops={"fp32": true["peak"], "bf16": 2 * true["peak"]},
                  memory_bytes=1e9,
                  hbm_bw=true["hbm"], devices_per_node=ranks, intra=Link({"all_reduce": 1.0}, 0),
                  inter=Link({"all_reduce": 1.0}, 0), matmul_eff_max=1.0,
                  matmul_half_flops=true["half"], attention_eff=true["attention_eff"],
                  hbm_eff=true["hbm_eff"], cache_bytes=true["cache_bytes"],
                  cached_eff=true["cached_eff"],
                  hbm_eff_by_dtype={"bf16": true["hbm_eff_bf16"]},
                  cached_eff_by_dtype={"bf16": true["cached_eff_bf16"]})
    for dtype in probes.DTYPES:
        for big, b in ((False, probes.BLOCK), (True, probes.BLOCK_OUT_OF_CACHE)):
            cfg = ModelConfig(preset=None, hidden_size=b["hidden"], num_layers=1,
                              num_heads=b["heads"], num_kv_heads=b["kv_heads"],
                              ffn_hidden_size=b["ffn"], vocab_size=16)
            parts = block_times(cfg, Layout(seq_len=b["tokens"], dtype=dtype), hw)
            comp[probes.elementwise_probe_name(dtype, big)] = (
                parts["elementwise_f"] + parts["elementwise_b"]) / share
    comp["update"] = true["update_s_per_param"] * probes.UPDATE_NUMEL / share
    coll = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        factor = {"all_reduce": 2.0 * (ranks - 1) / ranks, "p2p": 1.0}.get(kind,
                                                                           (ranks - 1) / ranks)
        coll[kind] = tuple(true["lat"] + factor * nb / true["busbw"]
                           for nb in (cal.SMALL, cal.LARGE))
    coll["reduce_scatter"] = None  # a backend without it
    wakeup = (0.3e-3, 0.3e-3 + true["wakeup"])  # the ping-pong idle, then between busy ranks
    return {"compute": comp, "collectives": coll, "wakeup": wakeup}, true


@pytest.mark.parametrize("ranks, cores, share", [(4, 2, 0.5), (2, 2, 1.0), (2, 4, 2.0)])
def test_profile_from_figures_recovers_the_per_core_machine(ranks, cores, share):
    fig, true = _synthetic_figures(ranks, share)
    per_rank = [fig, fig]
    hw = cal.profile_from_figures(cal.median_over_ranks(
        [{"compute": f["compute"], "collectives": f["collectives"], "wakeup": f["wakeup"]}
         for f in per_rank]),
        ranks, cores, "gloo", 8e9, log=lambda *a: None, cache_bytes=true["cache_bytes"])
    assert hw.host_cores == cores and hw.dp_overlap == 0.0
    assert hw.peak("fp32") == pytest.approx(true["peak"], rel=1e-3)
    assert hw.peak("bf16") == pytest.approx(2 * true["peak"], rel=1e-3)
    assert hw.matmul_half_flops == pytest.approx(true["half"], rel=1e-2)
    for dtype, half in (("fp32", true["half"]), ("bf16", true["half_bf16"])):
        # Each dtype's own curve, and the narrow layers' second factor (the fit's grid step).
        assert hw.matmul_curve(dtype)[0] == pytest.approx(half, rel=0.1)
        assert hw.matmul_curve(dtype)[1] == pytest.approx(true["half_dim"][dtype], rel=0.1)
        for dim, eff in true["attention_by_dim"][dtype].items():
            assert hw.attention_eff_at(dtype, dim) == pytest.approx(eff, rel=1e-3)
    assert hw.attention_eff == pytest.approx(true["attention_eff"], rel=1e-3)
    assert hw.attention_eff_by_dtype["bf16"] == pytest.approx(true["attention_eff_bf16"], rel=1e-3)
    assert hw.hbm_bw == pytest.approx(true["hbm"], rel=1e-6)
    assert hw.layer_overhead_s == pytest.approx(true["overhead"], rel=1e-6)
    assert hw.layer_overhead("bf16") == pytest.approx(true["overhead_bf16"], rel=1e-6)
    assert hw.hbm_eff == pytest.approx(true["hbm_eff"], rel=1e-3)
    assert hw.cached_eff == pytest.approx(true["cached_eff"], rel=1e-3)
    assert hw.cache_bytes == true["cache_bytes"]
    assert hw.elementwise_effs("fp32") == pytest.approx((true["hbm_eff"], true["cached_eff"]))
    assert hw.elementwise_effs("bf16") == pytest.approx(
        (true["hbm_eff_bf16"], true["cached_eff_bf16"]), rel=1e-3)
    # The update's bytes, at the elementwise rate, give back its time per parameter.
    assert hw.optimizer_bytes_per_param / (hw.hbm_bw * hw.hbm_eff) == pytest.approx(
        true["update_s_per_param"], rel=1e-6)
    assert hw.intra.bw("all_reduce") == pytest.approx(true["busbw"], rel=1e-6)
    assert hw.intra.bw("reduce_scatter") == hw.intra.bw("all_gather")  # missing: all-gather's
    assert hw.intra.latency_s * max(1, math.log2(ranks)) == pytest.approx(true["lat"], rel=1e-6)
    assert hw.wakeup_s == pytest.approx(true["wakeup"], rel=1e-6)


def test_without_a_cache_size_the_elementwise_rate_is_the_out_of_cache_one():
    """No L2 size known (or the two probe sizes not told apart): one efficiency, the one measured out of
    the cache, which the copy bandwidth and most training steps' activations share."""
    fig, true = _synthetic_figures(2, 1.0)
    hw = cal.profile_from_figures(cal.median_over_ranks([fig]), 2, 2, "gloo", 8e9,
                                  log=lambda *a: None, cache_bytes=None)
    assert hw.cache_bytes is None and hw.cached_eff is None
    assert true["hbm_eff"] < hw.hbm_eff < true["cached_eff"]  # the 2048-token probe's mix
    bf16, in_cache = hw.elementwise_effs("bf16")  # every dtype: its 2048-token probe alone
    assert true["hbm_eff_bf16"] < bf16 < true["cached_eff_bf16"] and in_cache is None
    assert probes.cache_efficiencies(0.5, 0.5, 2 * 2**20) == (0.5, None)  # sizes not told apart
    assert probes.cache_efficiencies(0.4, 0.6, 2 * 2**20) == (0.6, None)  # larger faster: noise
    # A 512 KiB L2 does not hold the small probe (1.5 MiB): its in-cache rate is not measured.
    assert probes.cache_efficiencies(0.52, 0.45, 512 * 2**10) == (0.45, None)


def test_core_cache_size_is_read_where_the_system_tells_it():
    size = probes.core_cache_bytes()
    assert size is None or 32 * 2**10 <= size <= 1 * 2**30


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_the_cost_model_reads(tmp_path):
    """The README's `ultrascale calibrate` (quick), run with requirements.txt's packages alone:
    it once measured for 31 s and then needed scipy, a test requirement (issue 50)."""
    out = tmp_path / "local.yaml"
    proc = ultrascale("calibrate", "--out", str(out), "--quick", runtime_only=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hw = Hardware.load(out)
    assert hw.peak("fp32") > 1e8 and hw.hbm_bw > 1e8 and 0 < hw.layer_overhead_s < 1
    # A CPU profile: per-core rates, the cores the ranks share, nothing overlapped.
    assert hw.host_cores >= 1 and hw.dp_overlap == 0.0
    assert 0.05 <= hw.hbm_eff <= 1.0 and 0 < hw.attention_eff <= 1.0
    assert set(hw.hbm_eff_by_dtype) == {"fp32", "bf16"}  # the elementwise work in each dtype
    assert hw.hbm_eff_by_dtype["fp32"] == hw.hbm_eff
    assert hw.optimizer_bytes_per_param > 16  # at least AdamW's param, grad, m, v reads
    for kind in ("all_reduce", "all_gather", "all_to_all", "p2p"):
        assert hw.intra.bw(kind) > 1e6, kind
    p = predict(ModelConfig(preset="tiny"), Layout(dp=2, mbs=4, seq_len=128), hw, memory=False)
    assert p.step_time_s > 0 and p.breakdown["dp_comm"] > 0
    assert "wrote" in proc.stdout


def test_calibrate_refuses_one_rank(capsys):
    assert calibrate_main(["--ranks", "1", "--out", "unused.yaml"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_the_cli_does_not_import_torch_to_register_its_commands():
    # `ultrascale memory` must answer in well under a second: registering `calibrate` (and the
    # other feature commands) must not import torch or numpy.
    code = ("import sys; from ultrascale.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_steady_allocator_keeps_freed_memory_on_glibc():
    """The calibration measures with freed memory kept in the process, as a trainer's allocator
    is after its first step (a fresh process pays page faults on every large temporary)."""
    import platform

    applied = probes.steady_allocator()
    assert isinstance(applied, bool)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert applied


def test_elementwise_efficiency_ignores_the_profiles_own_cache_model():
    """The probe's efficiency is against the full copy bandwidth: a profile that already has a
    cache model (benchmarks/step_profile_cpu.py reads one) gives the same figure as one without."""
    from ultrascale.planner.hardware import get_hardware

    flat = get_hardware("h100").with_(hbm_bw=15e9, cache_bytes=None, cached_eff=None)
    cached = flat.with_(hbm_eff=0.4, cache_bytes=2 * 2**20, cached_eff=0.7)
    eff = probes.elementwise_efficiency(flat, 0.1, **probes.BLOCK)
    assert eff < 0.5  # not clamped at 1
    assert probes.elementwise_efficiency(cached, 0.1, **probes.BLOCK) == pytest.approx(eff)


def test_device_memory_is_the_gpus_less_what_the_cuda_context_and_nccl_hold():
    gib = 2**30
    # CPU ranks report nothing: the host's memory shared by the ranks, nothing kept.
    assert cal.device_memory([{}, {}], 16 * gib) == (8 * gib, 0.0, "")
    # GPU ranks: the smallest capacity; what was in use outside the allocator, at least the GPU
    # profiles' figure (a training job opens more communicators than the calibration's one).
    total, outside, note = cal.device_memory(
        [{"device_memory": (80 * gib, 1.2 * gib)}, {"device_memory": (79 * gib, 0.9 * gib)}],
        1e12)
    assert total == 79 * gib and outside == GPU_OUTSIDE_ALLOCATOR and "1.20 GiB" in note
    _, outside, _ = cal.device_memory([{"device_memory": (80 * gib, 7 * gib)}] * 2, 1e12)
    assert outside == 7 * gib


def test_a_cpu_plan_prices_attention_in_its_dtype_and_the_steps_all_reduces():
    """Issue 50, item 9: `plan --gpu local` put the tiny preset's default run (bf16, dp2) at 0.45x
    its measured step: it priced bf16 attention at the bf16 GEMMs' peak times the fp32 attention
    probe's efficiency (a CPU's bf16 attention kernel reaches 9% of that peak here, fp32's 41%),
    and left out the two all-reduces over every rank each step makes (gradient norm, loss)."""
    fig, _ = _synthetic_figures(2, 1.0)
    hw = cal.profile_from_figures(cal.median_over_ranks([fig]), 2, 2, "gloo", 8e9,
                                  log=lambda *a: None, cache_bytes=None)
    model, lay = ModelConfig(preset="tiny"), Layout(dp=2, mbs=8, seq_len=128, dtype="bf16")
    ours = predict(model, lay, hw, memory=False).breakdown
    one_efficiency = hw.with_(attention_eff_by_dtype={}, attention_eff_by_head_dim={})
    before = predict(model, lay, one_efficiency, memory=False).breakdown
    bf16, fp32 = hw.attention_eff_at("bf16", 32), hw.attention_eff  # tiny's head dimension
    assert ours["attention"] == pytest.approx(before["attention"] * fp32 / bf16, rel=1e-9)
    # Two ranks on two cores take no time slices: no wake-up wait (theory/rates.py's rank share).
    sync = 2 * collective_time(hw.with_(wakeup_s=0.0), "all_reduce", 16, 2)
    assert ours["step_sync"] == pytest.approx(sync) and sync > 0
    assert predict(model, Layout(dp=1, mbs=8, seq_len=128, dtype="bf16"), hw,
                   memory=False).breakdown.get("step_sync", 0.0) == 0.0
    # GPU profiles' constants were fitted on whole steps that hold these all-reduces already.
    gpu = predict(model, lay, get_hardware("h100"), memory=False).breakdown
    assert gpu.get("step_sync", 0.0) == 0.0


def test_a_cpu_plan_prices_elementwise_work_in_its_dtype(tmp_path):
    """Issue 50, item 9: a CPU's bf16 norms, rotary, SwiGLU and casts take about as long per
    element as fp32's, so per byte they reach a smaller share of the copy bandwidth; the profile
    priced them at the fp32 probe's efficiency, half the time of fp32's work. A profile with a bf16
    elementwise efficiency below fp32's prices a bf16 layout's elementwise work slower by that
    ratio and an fp32 layout's as before; a profile written before the field loads and prices
    every dtype at `hbm_eff`."""
    fig, true = _synthetic_figures(2, 1.0)
    hw = cal.profile_from_figures(cal.median_over_ranks([fig]), 2, 2, "gloo", 8e9,
                                  log=lambda *a: None, cache_bytes=None)
    one_efficiency = hw.with_(hbm_eff_by_dtype={}, cached_eff_by_dtype={})
    model = ModelConfig(preset="tiny")
    parts = {}
    for dtype in ("bf16", "fp32"):
        lay = Layout(dp=2, mbs=8, seq_len=128, dtype=dtype)
        parts[dtype] = [predict(model, lay, h, memory=False).breakdown
                        for h in (hw, one_efficiency)]
    bf16, fp32 = hw.elementwise_effs("bf16")[0], hw.elementwise_effs("fp32")[0]
    assert bf16 < fp32 == hw.hbm_eff
    # The blocks' elementwise work and the logits' casts at bf16's efficiency; the rest (the loss
    # on fp32 logits, the gradients accumulated in fp32) as before.
    ours, before = parts["bf16"]
    rest = before["elementwise"] - 4 * sum(
        block_times(model, Layout(mbs=8, seq_len=128, dtype="bf16"), one_efficiency)[k]
        for k in ("elementwise_f", "elementwise_b")) - cast_time(
            one_efficiency, 8 * 128 * model.vocab_size, "bf16")
    assert ours["elementwise"] - rest == pytest.approx((before["elementwise"] - rest) * fp32 / bf16)
    assert ours["elementwise"] > before["elementwise"] and ours["matmul"] == before["matmul"]
    assert parts["fp32"][0] == parts["fp32"][1]
    # A profile written before per-dtype efficiencies: loads, one efficiency for every dtype.
    data = one_efficiency.to_dict()
    del data["hbm_eff_by_dtype"], data["cached_eff_by_dtype"]
    old = Hardware.from_dict(data)
    assert old.hbm_eff_by_dtype == {} and old.elementwise_effs("bf16") == (hw.hbm_eff, None)
    lay = Layout(dp=2, mbs=8, seq_len=128, dtype="bf16")
    assert predict(model, lay, old, memory=False).breakdown == before
    # Saved and loaded, the per-dtype efficiencies survive.
    assert Hardware.load(hw.save(tmp_path / "local.yaml")).elementwise_effs("bf16") == (bf16, None)


def test_calibrate_measures_the_elementwise_work_in_each_dtype(monkeypatch):
    """The compute probes at a tiny size, one round: the block's elementwise work runs, and is
    timed, in fp32 and in bf16 (its SwiGLU sees tensors of that dtype)."""
    import torch

    from ultrascale.models import ops

    seen, cores = [], set()
    swiglu, attention = ops.swiglu, ops.attention
    monkeypatch.setattr(ops, "swiglu", lambda g, u, w=None: seen.append(g.dtype) or swiglu(g, u, w))
    monkeypatch.setattr(ops, "attention", lambda q, k, v, **kw: cores.add(
        (q.dtype, q.shape[2], k.shape[2], q.shape[3])) or attention(q, k, v, **kw))
    small = dict(hidden=32, heads=2, kv_heads=1, ffn=64, tokens=8)
    monkeypatch.setattr(probes, "BLOCK", small)
    monkeypatch.setattr(probes, "BLOCK_OUT_OF_CACHE", dict(small, tokens=16))
    monkeypatch.setattr(probes, "QUICK_SIZES", [16])
    monkeypatch.setattr(probes, "QUICK_NARROW_GEMMS", [(32, 4, 16)])
    monkeypatch.setattr(probes, "ATTENTION", dict(batch=1, seq=8, heads=4, kv_heads=2))
    monkeypatch.setattr(probes, "ATTENTION_HEAD_DIMS", (4, 8))
    monkeypatch.setattr(probes, "UPDATE_NUMEL", 2**10)
    monkeypatch.setattr(probes, "MIN_SAMPLE_S", 1e-4)
    times = probes.measure_compute(quick=True, rounds=1)
    for dtype in probes.DTYPES:
        for big in (False, True):
            assert times[probes.elementwise_probe_name(dtype, big)] > 0
        # The narrow linear, attention at each head dimension, the block's host work: each dtype.
        assert times[f"matmul/{dtype}/32x4x16"] > 0 and times[probes.overhead_probe(dtype)] > 0
        assert times[f"attention/{dtype}/d4"] > 0 and times[f"attention/{dtype}/d8"] > 0
    assert {torch.float32, torch.bfloat16} <= set(seen)
    # Grouped kv heads at each head dimension in each dtype.
    for dt in (torch.float32, torch.bfloat16):
        assert {(dt, 4, 2, 4), (dt, 4, 2, 8)} <= cores
    assert probes.elementwise_probe_name("fp32") == "elementwise"  # older profiles' names


def test_a_cpu_plan_prices_narrow_gemms_head_dims_host_work_and_casts_in_its_dtype():
    """Issue 50, item 9: a bf16 run of a small model was priced with the fp32 block's host work,
    GEMMs at a square GEMM's rate for their FLOPs (a linear with a narrow inner dimension runs
    slower), attention at head dim 64 without grouped kv heads, and no casts (the loss's logits
    to fp32 and back, each gradient into its fp32 accumulator and each master weight back). Each
    is a measured constant now, and a GPU profile (fitted on whole steps) and a profile written
    before the fields price as before."""
    from ultrascale.theory.rates import gemm_time

    fig, true = _synthetic_figures(2, 1.0)
    hw = cal.profile_from_figures(cal.median_over_ranks([fig]), 2, 2, "gloo", 8e9,
                                  log=lambda *a: None, cache_bytes=None)
    model, lay = ModelConfig(preset="tiny"), Layout(dp=2, mbs=8, seq_len=128, dtype="bf16")
    ours = predict(model, lay, hw, memory=False).breakdown
    # A GEMM of one size: the narrower, the slower, by d / (d + half_dim) against a square one.
    half_dim = hw.matmul_curve("bf16")[1]
    square, narrow = gemm_time(hw, 256, 256, 256, "bf16"), gemm_time(hw, 1024, 128, 128, "bf16")
    assert narrow / square == pytest.approx((256 / (256 + half_dim)) / (128 / (128 + half_dim)))
    square_only = hw.with_(matmul_half_dim_by_dtype={})
    assert ours["matmul"] > predict(model, lay, square_only, memory=False).breakdown["matmul"]
    # The bf16 block's host work, per layer (4 layers, one micro-batch).
    assert ours["overhead"] == pytest.approx(4 * true["overhead_bf16"])
    fp32 = predict(model, Layout(dp=2, mbs=8, seq_len=128, dtype="fp32"), hw,
                   memory=False).breakdown
    assert fp32["overhead"] == pytest.approx(4 * true["overhead"])
    # Attention at tiny's head dimension 32; between measured ones linear in log(head_dim); the
    # nearest one's beyond.
    assert hw.attention_eff_at("bf16", 32) == pytest.approx(true["attention_by_dim"]["bf16"][32])
    assert hw.attention_eff_at("bf16", 45.254834) == pytest.approx(0.065, rel=1e-6)  # 2^5.5
    assert hw.attention_eff_at("bf16", 16) == hw.attention_eff_at("bf16", 32)
    # Casts in bf16 on a CPU profile: the logits' in the elementwise part, the parameters' with
    # the update; none in fp32, none on a GPU profile.
    logits, params = 8 * 128 * model.vocab_size, predict(model, lay, hw, memory=False)
    no_casts = hw.with_(host_cores=None)
    for h in (hw, no_casts):
        assert cast_time(h, 1e6, "fp32") == 0.0
    assert cast_time(no_casts, 1e6, "bf16") == 0.0 < cast_time(hw, 1e6, "bf16")
    from ultrascale.theory.ends import loss_traffic
    from ultrascale.theory.shape import Shape

    sh = Shape.of(model, lay)
    assert loss_traffic(model, hw, sh) - loss_traffic(model, no_casts, sh) == pytest.approx(
        cast_time(hw, logits, "bf16"), rel=1e-9) and params.breakdown["optimizer"] > 0
    gpu = get_hardware("h100")
    assert gpu.matmul_curve("bf16") == (gpu.matmul_half_flops, 0.0)
    assert gpu.layer_overhead("bf16") == gpu.layer_overhead_s
    assert gpu.attention_eff_at("bf16", 32) == gpu.attention_eff
    # A profile written before the fields loads and prices as before them.
    data = hw.to_dict()
    for key in ("matmul_half_flops_by_dtype", "matmul_half_dim_by_dtype",
                "attention_eff_by_head_dim", "layer_overhead_by_dtype"):
        del data[key]
    old = Hardware.from_dict(data)
    before = hw.with_(matmul_half_flops_by_dtype={}, matmul_half_dim_by_dtype={},
                      attention_eff_by_head_dim={}, layer_overhead_by_dtype={})
    assert predict(model, lay, old, memory=False).breakdown == predict(
        model, lay, before, memory=False).breakdown
    # Saved and loaded, the new fields survive (YAML keys of the head dimensions included).
    again = Hardware.from_dict(yaml.safe_load(yaml.safe_dump(hw.to_dict())))
    assert again.attention_eff_by_head_dim == hw.attention_eff_by_head_dim
    assert predict(model, lay, again, memory=False).breakdown == ours
