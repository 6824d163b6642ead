"""The planner: enumeration, ranking with memory, explanations, the CLI and its bad inputs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import replace
from pathlib import Path

import pytest

from ultrascale.config import ModelConfig, load_config
from ultrascale.layout import Layout
from ultrascale.planner.command import main as plan_main
from ultrascale.planner.command import parse_tokens, train_config
from ultrascale.planner.cost import estimate_memory
from ultrascale.planner import fit as playbook_fit
from ultrascale.planner import playbook, playbook_report
from ultrascale.planner import sweep_compare as sc
from ultrascale.planner.hardware import H100, H100_PLAYBOOK, H100_PLAYBOOK_NVLS
from ultrascale.planner.search import PlanError, SearchSpace, enumerate_layouts, plan
from ultrascale.theory.pipeline import busiest_stage_layers

ROOT = Path(__file__).resolve().parents[1]

M8B = ModelConfig(preset="llama3-8b")


def test_every_enumerated_layout_uses_all_devices_and_the_exact_batch():
    layouts = enumerate_layouts(M8B, 64, 4 * 2**20, 4096, H100)
    assert len(layouts) > 100
    for lay in layouts:
        assert lay.world_size == 64
        assert lay.global_batch_tokens == 4 * 2**20
        assert lay.tp <= 8  # tp stays inside a node
        assert M8B.num_layers % (lay.pp * lay.pp_virtual_stages) == 0
        assert not (lay.pp > 1 and lay.zero > 1)
    dims = {(lay.tp, lay.pp, lay.zero, lay.recompute, lay.pp_schedule) for lay in layouts}
    assert {d[0] for d in dims} == {1, 2, 4, 8}
    assert {d[4] for d in dims} == {"1f1b", "interleaved", "zero_bubble", "dualpipev"}
    assert {lay.zero3_gather for lay in layouts} == {"auto"}  # ZeRO-3 under pp: asked for


def test_asked_for_zero3_under_pp_is_tried_both_ways():
    """`--search-zero` names the stages to try with pp too; ZeRO-3 under pp then comes in both
    gathering modes, each named in the layout's short name."""
    space = SearchSpace(zero=[1, 3], zero_with_pp=True, pp=[2], recompute=["none"],
                        schedules=["1f1b"])
    layouts = enumerate_layouts(M8B, 64, 4 * 2**20, 4096, H100, space)
    gathers = {(lay.zero, lay.zero3_gather) for lay in layouts}
    assert gathers == {(1, "auto"), (3, "step"), (3, "micro_batch")}
    names = {lay.short() for lay in layouts if lay.zero == 3}
    assert any("zero3-gstep" in n for n in names) and any("zero3-gmb" in n for n in names)


def test_pipelines_need_not_divide_the_layers():
    """Llama 3 405B's 126 layers on 16 stages: the search tries every pp that divides the devices,
    the stages then differ by one layer (the busiest is costed), and the written config lists them
    as the engine splits them (the first stages take the smaller shares)."""
    m = ModelConfig(preset="llama3-405b")
    kw = dict(tp=[8], zero=[1], recompute=["full"], mbs=[1], schedules=["1f1b"])
    pps = {lay.pp for lay in enumerate_layouts(m, 16384, 16 * 2**20, 4096, H100, SearchSpace(**kw))}
    assert pps == {1, 2, 4, 8, 16}
    even = SearchSpace(**kw, uneven_pp=False)
    assert {lay.pp for lay in enumerate_layouts(m, 16384, 16 * 2**20, 4096, H100, even)} == {1, 2}
    lay = Layout(dp=128, tp=8, pp=16, zero=1, mbs=1, grad_accum=32, recompute="full",
                 sequence_parallel=True)
    assert busiest_stage_layers(m, lay) == 8
    assert train_config(m, lay)["parallel"]["pp_layers"] == [7] * 2 + [8] * 14
    inter = lay.with_(pp_schedule="interleaved", pp_virtual_stages=4)  # 64 stages of 2 or 1
    assert busiest_stage_layers(m, inter) == 8
    assert sum(train_config(m, inter)["parallel"]["pp_layers"]) == 126


def test_search_space_restricts_the_dimensions():
    space = SearchSpace(tp=[1, 2], pp=[1], zero=[1], recompute=["none"], mbs=[1, 2])
    layouts = enumerate_layouts(M8B, 16, 2**20, 4096, H100, space)
    assert {(lay.tp, lay.pp, lay.zero) for lay in layouts} == {(1, 1, 1), (2, 1, 1)}
    assert {lay.mbs for lay in layouts} == {1, 2}


def test_plan_ranks_fitting_layouts_and_explains_the_winner():
    result = plan(M8B, 64, 4 * 2**20, H100, top=5)
    assert len(result.ranked) == 5
    speeds = [p.tokens_per_s for p in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.fits and p.memory_bytes <= H100.usable_memory_bytes for p in result.ranked)
    assert result.best.layout.short() in result.why and "beats" in result.why


def test_the_planner_keeps_memory_for_the_cuda_context_and_nccl():
    # 3.57B at dp 32, tp 2, micro-batch 4, ZeRO-0: its tensors (77 GiB reserved) fit in 80 GiB,
    # but the playbook's run of it went out of memory; with the 5 GiB the GPU profiles keep
    # outside the allocator it is refused.
    model = ModelConfig(preset=None, hidden_size=3072, num_layers=28, num_heads=32,
                        num_kv_heads=32, ffn_hidden_size=8192, vocab_size=131072,
                        tie_embeddings=True)
    lay = Layout(dp=32, tp=2, mbs=4, grad_accum=2, seq_len=4096, sequence_parallel=True,
                 grad_accum_dtype="fp32")
    assert H100.usable_memory_bytes == H100.memory_bytes - 5 * 2**30
    est = estimate_memory(model, lay, H100, "nanotron")
    assert H100.usable_memory_bytes < est.reserved <= H100.memory_bytes and not est.fits
    assert estimate_memory(model, lay, H100.with_(outside_allocator_bytes=0), "nanotron").fits
    space = SearchSpace(tp=[2], pp=[1], zero=[0], mbs=[4], recompute=["none"],
                        grad_accum_dtype="fp32")
    assert plan(model, 64, 256 * 4096, H100, space=space, runtime="nanotron").best is None


def test_bad_sizes_are_refused_with_the_fix():
    with pytest.raises(PlanError, match="multiple of 4096"):
        plan(M8B, 8, 1000, H100)
    with pytest.raises(PlanError, match="dp the batch"):
        plan(M8B, 3, 4096 * 4, H100, space=SearchSpace(tp=[1], pp=[1]))
    # Sizes that split, refused by the rules: the rule is named, not the sizes.
    with pytest.raises(PlanError, match="does not divide model.num_heads"):
        plan(M8B, 12, 4096 * 12, H100, space=SearchSpace(tp=[3]))


def test_a_model_that_fits_nowhere_gets_its_smallest_footprint_and_advice():
    result = plan(ModelConfig(preset="llama3-70b"), 1, 2**20, H100)
    assert result.best is None
    assert result.smallest.memory_bytes > H100.memory_bytes
    text = " ".join(result.advice)
    assert "devices" in text and "GiB" in text


def test_405b_on_16k_gpus_answers_in_seconds(tmp_path, capsys):
    # CPU time, not wall time: the test machine is shared, and the bound is on our work.
    start = time.process_time()
    rc = plan_main(["--preset", "llama3-405b", "--gpus", "16384", "--gpu", "h100",
                    "--global-batch-tokens", "16M", "--config-out", str(tmp_path / "w.yaml")])
    assert time.process_time() - start < 10
    out = capsys.readouterr().out
    assert rc == 0 and "Why:" in out
    cfg = load_config(tmp_path / "w.yaml")  # the written config is a valid training config
    assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 16384
    if cfg.parallel.pp_layers:  # 126 layers: stages of 8 and 7 where pp does not divide them
        assert sum(cfg.parallel.pp_layers) == cfg.model.num_layers == 126
        assert "of the 126 layers" in out  # and the explanation says how they are split
    assert cfg.global_batch_size * cfg.training.seq_len == 16 * 2**20


def test_cli_json_and_one_layout(capsys):
    assert plan_main(["--preset", "llama3-1b", "--gpus", "8", "--global-batch-tokens", "1M",
                      "--json", "--config-out", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranked"][0]["tokens_per_s_per_device"] > 0 and data["config"] is None
    assert plan_main(["--preset", "llama3-1b", "--gpus", "8", "--layout",
                      "dp=4,tp=1,pp=2,zero=1,mbs=2,acc=32", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["layout"] == Layout(dp=4, pp=2, zero=1, mbs=2, grad_accum=32).short()
    assert one["fits"] is True and one["breakdown_s"]["pp_bubble"] > 0


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "8", "--global-batch-tokens", "lots"], "not a number of tokens"),
    (["--gpus", "8", "--layout", "dp=8,tp=3"], "tp"),
    (["--gpus", "16", "--layout", "dp=8"], "--gpus is 16"),
    (["--gpus", "8", "--gpu", "tpu"], "unknown hardware"),
    (["--preset", "gpt5", "--gpus", "8"], "not a known preset"),
    (["--global-batch-tokens", "1M"], "--gpus"),
    (["--preset", "tiny", "--gpus", "8", "--layout", "dp=1,pp=8"], "every stage needs a layer"),
    # The search's own values, refused before any layout is enumerated (by the layout rules).
    (["--gpus", "8", "--search-mbs", "0"], "micro_batch_size=0 must be at least 1"),
    (["--gpus", "8", "--search-pp", "2,0"], "parallel.pp=0 must be at least 1"),
    (["--gpus", "8", "--search-mbs", "one"], "--search-mbs 'one' is not a list"),
    (["--gpus", "8", "--search-schedules", "gpipe"], "pp_schedule='gpipe' is unknown"),
    (["--gpus", "8", "--search-gathering", "never"], "zero3_gather='never' is unknown"),
    (["--gpus", "8", "--seq-len", "1"], "training.seq_len=1 must be at least 2"),
    (["--gpus", "8", "--top", "0"], "rank at least 1 layout"),
    (["--gpus", "8", "--dtype", "fp8", "--fp8-experts"], "no routed experts"),
])
def test_bad_input_is_one_paragraph_and_exit_2(argv, words, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_hf_config_is_read(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": 8,
                                "num_attention_heads": 16, "num_key_value_heads": 4,
                                "intermediate_size": 4096, "vocab_size": 32000,
                                "tie_word_embeddings": True}))
    assert plan_main(["--hf-config", str(path), "--gpus", "4", "--global-batch-tokens", "256K",
                      "--seq-len", "2048", "--config-out", "none"]) == 0
    assert "4 x h100" in capsys.readouterr().out


def test_the_top_rows_differ_in_time_and_the_config_is_ready_to_run(tmp_path, capsys,
                                                                    monkeypatch):
    """Issue 50, item 9: the top 5 were often one layout re-split at the same step time ("beats by
    0.0%"); plan.yaml lacked the device, the data and the steps; `--config-out -` meant none."""
    import yaml

    from ultrascale.config import build_config
    from ultrascale.planner.hardware import get_hardware

    monkeypatch.chdir(tmp_path)
    # (The top 10: the pair sits 10th since pipelined layouts are ranked with their layers
    # balanced too.)
    result = plan(ModelConfig(preset="llama3-8b"), 64, 4 * 2**20, get_hardware("h100"), top=10)
    times = [p.step_time_s for p in result.ranked]
    assert len(times) == 10 and len({round(t, 9) for t in times}) == 10
    assert "by 0.0%" not in result.why
    twins = [(k, v) for k, v in result.same_time.items() if v]
    assert twins, "the issue's pair (zero1 and zero2 at one step time) is folded into one row"
    rc = plan_main(["--preset", "llama3-8b", "--gpus", "64", "--global-batch-tokens", "4M",
                    "--top", "10", "--config-out", "-"])
    out, err = capsys.readouterr()
    assert rc == 0 and "same time: " + twins[0][1][0] in err and "Why:" in err
    data = yaml.safe_load(out)  # stdout holds the config alone
    assert data["device"] == "cuda" and data["data"]["source"] == "builtin"
    assert data["training"]["steps"] == 200 and data["parallel"]["dp"] * data["parallel"][
        "tp"] * data["parallel"]["pp"] == 64
    assert out.startswith("# `ultrascale train THIS.yaml`")
    cfg = build_config(data)
    assert cfg.layout().short() == result.ranked[0].layout.short()
    rc = plan_main(["--preset", "llama3-8b", "--gpus", "8", "--config-out", "none"])
    assert rc == 0 and "Config for" not in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
    from ultrascale.cli import build_parser

    helps = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    zero = helps[helps.rindex("--search-zero"):helps.rindex("--search-mbs")]
    assert "e.g. 0,1" in zero and "1,2,4" not in zero


def test_a_cpu_profile_predicts_the_dtype_the_cpu_run_computes_in(tmp_path, capsys):
    """Issue 50, item 9: `plan --config C --gpu local` planned a CPU run as for GPUs, where an fp32
    run computes in bf16: an fp32 run was predicted at the CPU's bf16 matmul rate."""
    from ultrascale.devices import resolve_dtype

    cpu = "benchmarks/data/planner_sweep_cpu_4ranks_xeon/local.yaml"
    profile = str(Path(__file__).resolve().parent.parent / cpu)
    config = tmp_path / "fp32.yaml"
    config.write_text("precision: {dtype: fp32}\ndevice: cpu\nparallel: {dp: 2}\n")
    assert plan_main(["--config", str(config), "--gpu", profile, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout_fields"]["dtype"] == "fp32"
    assert plan_main(["--config", str(config), "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout_fields"]["dtype"] == "bf16"  # on a GPU
    assert plan_main(["--preset", "tiny", "--gpus", "2", "--gpu", profile, "--seq-len", "256",
                      "--global-batch-tokens", "8K", "--json", "--config-out", "none"]) == 0
    best = json.loads(capsys.readouterr().out)["ranked"][0]["layout_fields"]
    assert best["dtype"] == resolve_dtype("auto", cuda=False)  # what `auto` trains in here


def test_parse_tokens():
    assert parse_tokens("16M") == 16 * 2**20
    assert parse_tokens("4096") == 4096
    assert parse_tokens("0.5K") == 512


def test_cost_model_against_the_playbook_h100_runs():
    """Regression guard on benchmarks/planner_vs_playbook.py (figures in
    benchmarks/planner_notes.md): 878
    measured layouts in 14 (model, nodes) cells, each run on the profile of the cluster state its
    own job measured (h100-playbook-nvls or h100-playbook); with one profile for every run the
    same model does much worse, which is why the states are told apart."""
    runs = playbook.load_runs()
    s = playbook.evaluate(runs)["summary"]
    assert s["runs"] == 878 and s["cells"] == 14
    # The targets, per cell: median error at most 15% (13.5% at worst), Spearman 0.8.
    assert s["median_rel_error_all_runs"] <= 0.11
    assert s["cells_error_le_15pct"] == 14
    assert s["cells_spearman_ge_0.8"] == 14
    # The target: 80% of the cells (12 of 14).
    assert s["cells_best_in_top5"] >= 12
    assert s["cells_first_within_5pct"] == 14
    # Layouts the runs saw run out of memory: 1 of the 70 in the planners' top 5 (3 when the
    # profiles keep nothing for the CUDA context and NCCL).
    assert s["planner_top5_oom_in_runs"] <= 1
    # ... at the cost of 11 measured layouts (of 878) the estimator calls too big (6 keeping none).
    assert s["measured_called_too_big"] <= 11
    one = playbook.ClusterStates(nvls=H100_PLAYBOOK, no_nvls=H100_PLAYBOOK)
    single = playbook.evaluate(runs, one)["summary"]
    assert single["median_rel_error_all_runs"] > 0.15 and single["cells_spearman_ge_0.8"] <= 10
    # The state with NVLink SHARP keeps the inter-node all-reduce its jobs measured.
    measured = playbook.nvls_inter_all_reduce_gbs(runs)
    assert H100_PLAYBOOK_NVLS.inter.busbw["all_reduce"] == pytest.approx(
        round(measured) * 1e9)
    # ZeRO-1 against ZeRO-0 of the same layout: faster without SHARP, slower with it on 16-32
    # nodes (nanotron's reduce-scatter holds the backward up), as measured.
    pairs = playbook.zero_pairs(runs, playbook.PLAYBOOK_STATES)
    for nodes in (8, 16, 32):
        meas, pred, _ = pairs[(False, nodes)]
        assert meas > 1.1 and pred > 1.1
    for nodes in (16, 32):
        meas, pred, _ = pairs[(True, nodes)]
        assert meas < 0.97 and pred < 0.99 and pred == pytest.approx(meas, abs=0.06)


def test_the_playbook_profiles_hold_the_worst_cell_calibration():
    """The constants in the H100 profiles minimise the worst-cell objective (`fit_worst_cell`:
    the worst cell's median error plus half the median over all runs): moving any one of them
    by 2% either way (within its bounds) lowers the objective by at most 0.05 points, their
    rounding. (Refitting from scratch is `python -m ultrascale.planner.fit`, 2-3 minutes of
    Nelder-Mead; a constant moved off its minimum fails here: see the last assert.) The
    least-squares fit of every run leaves one cell above 15%."""
    every = playbook.load_runs()
    runs = [r for r in every if playbook.usable(r) and r.nodes <= 64]  # what the fit reads
    shipped = playbook_fit.params_of(playbook.PLAYBOOK_STATES)
    lo, hi, _ = playbook_fit.fit_bounds()

    def objective(x):
        medians, overall = playbook.cell_errors(runs, playbook_fit.apply(playbook.PLAYBOOK_STATES,
                                                                         x))
        return max(medians.values()) + 0.5 * overall

    def moved(i, factor):
        x = shipped.copy()
        x[i] = min(max(x[i] * factor, lo[i]), hi[i])
        return x

    at_shipped = objective(shipped)
    for i, name in enumerate(playbook_fit.FIT_FIELDS):
        for factor in (0.98, 1.02):
            assert objective(moved(i, factor)) >= at_shipped - 5e-4, (name, factor)
    # The check sees a constant off its minimum: the start-up latency 10% up is such a point.
    latency = playbook_fit.FIT_FIELDS.index("inter_latency_s")
    off = moved(latency, 1.1)
    assert objective(moved(latency, 1.1 * 0.98)) < objective(off) - 5e-4
    squares = playbook_fit.fit(every)
    medians, _ = playbook.cell_errors(every, squares)
    assert max(medians.values()) > 0.15


def test_the_planner_held_out_on_the_other_model():
    """Held out: the H100 constants fitted (least squares, seconds) on the 1.34B runs only, and the
    3.57B cells judged on them, beside the 1.34B cells they were fitted on (`python -m
    ultrascale.planner.fit --hold-out 3.57G --objective least-squares`, docs/planner.md). Held
    out: 444 runs at 10.4% median error, each cell within 15.8% (7.2-15.8%), Spearman 0.83-0.95,
    the first measured choice at 100% of the best in 7 of 7 cells, the best measured in the top 5
    in 6 of 7; the fitted cells: 9.6%."""
    res = playbook_fit.held_out(playbook.load_runs(), "3.57G")
    held, fitted = res["held_out"], res["fitted"]
    assert [c["model"] for c in held["cells"]] == ["3.57G"] * 7
    assert held["summary"]["runs"] == 444 and fitted["summary"]["runs"] == 434
    assert held["summary"]["median_rel_error_all_runs"] <= 0.12
    assert max(c["median_rel_error"] for c in held["cells"]) <= 0.17
    assert held["summary"]["cells_spearman_ge_0.8"] == 7
    assert held["summary"]["cells_first_within_5pct"] >= 6
    assert held["summary"]["cells_best_in_top5"] >= 5
    # What the constants were not fitted on is predicted about as well as what they were.
    assert (held["summary"]["median_rel_error_all_runs"]
            <= fitted["summary"]["median_rel_error_all_runs"] + 0.02)


@pytest.mark.parametrize("argv, words", [
    (["--hold-out", "9G"], "--hold-out 9G: no such cells"),
    (["--bound", "no_such_constant=0:1"], "--bound: unknown constant"),
    (["--objective", "median"], "invalid choice: 'median'"),
])
def test_the_fit_command_refuses_bad_options(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        playbook_fit.main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--set", "no_such_field=1"], "--set: unknown field"),
    (["--fit", "--bound", "no_such_constant=0:1"], "--bound: unknown constant"),
    (["--cell", "9G:3"], "--cell 9G:3: no such cell"),
    (["--fit-on", "9G"], "--fit-on 9G: no such model"),
    (["--fit", "--objective", "median"], "invalid choice: 'median'"),
])
def test_the_playbook_comparison_refuses_bad_options(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        playbook_report.main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_with_sharp_the_playbook_jobs_gathers_share_a_fabric_with_the_whole_job():
    """`h100-playbook-nvls`: inter-node all-gather and reduce-scatter cross a fabric every node of
    the job loads, so their bus bandwidth over all of a job's nodes is
    1 / (1 / busbw + nodes / fabric), the law the jobs measured; a group gets its share of the
    node's links of it; a tp 32 group over 4 nodes of a 64-node job runs at the 64-node figure.
    The all-reduce (reduced in the switches), the links inside a node and the other state are
    untouched."""
    from ultrascale.planner.hardware import Hardware

    sharp = H100_PLAYBOOK_NVLS
    for kind, (busbw, fabric) in playbook.nvls_gather_scatter_law(playbook.load_runs()).items():
        assert sharp.inter.busbw[kind] == pytest.approx(busbw * 1e9, rel=0.01)
        assert sharp.inter.job_fabric_bw[kind] == pytest.approx(fabric * 1e9, rel=0.01)
    job64, job4 = sharp.for_job(64).inter, sharp.for_job(4).inter
    assert job64.bw("all_gather", 64) / 1e9 == pytest.approx(1 / (1 / 306 + 64 / 3300))  # ~44
    assert job64.bw("all_gather", 4) == job64.bw("all_gather", 64)  # tp 32 in a 64-node job
    assert job4.bw("all_gather", 4) / 1e9 == pytest.approx(1 / (1 / 306 + 4 / 3300))  # ~241
    assert job64.bw("all_gather", 64, 0.25) == pytest.approx(0.25 * job64.bw("all_gather", 64))
    assert job64.bw("all_reduce", 64) == sharp.inter.bw("all_reduce", 64) == 183e9
    assert job64.bw("all_gather", 1) == sharp.inter.bw("all_gather", 1)
    assert sharp.for_job(64).intra == sharp.intra
    assert H100_PLAYBOOK.for_job(64) is H100_PLAYBOOK
    assert Hardware.from_dict(sharp.for_job(64).to_dict()) == sharp.for_job(64)
    # predict() takes the job's node count from the layout: a tp 32 layout on 64 nodes is slower
    # than without the shared fabric, and a one-node layout does not see it.
    model = next(r.model for r in playbook.load_runs() if r.model_name == "1.34G")
    lay = Layout(dp=16, tp=32, pp=1, zero=0, mbs=16, grad_accum=1, seq_len=4096,
                 sequence_parallel=True)
    healthy = sharp.with_(inter=replace(sharp.inter, job_fabric_bw=None))
    assert playbook.predicted(model, lay, sharp) < 0.6 * playbook.predicted(model, lay, healthy)
    one_node = lay.with_(dp=1, tp=8, mbs=32, grad_accum=8)
    assert (playbook.predicted(model, one_node, sharp)
            == playbook.predicted(model, one_node, healthy))


def test_the_per_layer_split_shows_what_tp_32_pays_per_micro_batch():
    """`--per-layer-split` (benchmarks/planner_notes.md, why 1.34G on 64 nodes misses): at
    micro-batch 1 the
    step per micro-batch of a layout run on both models splits into a part per micro-batch and
    a part per layer. At tp 4-8 both parts are as predicted within a few ms; at tp 32 the runs
    pay ~120 ms per micro-batch that the model does not have, and less per layer than it says."""
    split = playbook.per_layer_split(playbook.load_runs(), playbook.PLAYBOOK_STATES)
    for tp in (4, 8):
        pairs, (fixed, per_layer), (p_fixed, p_per_layer) = split[tp]
        assert pairs >= 10 and abs(fixed - p_fixed) < 10 and abs(per_layer / p_per_layer - 1) < 0.2
    pairs, (fixed, per_layer), (p_fixed, p_per_layer) = split[32]
    assert pairs >= 5 and 100 < fixed < 140 and abs(p_fixed) < 10
    assert per_layer < 0.8 * p_per_layer


def test_cost_model_against_the_recorded_sweeps_of_this_machine():
    """Regression guard on benchmarks/planner_vs_sweep.py (figures in benchmarks/planner_notes.md):
    the
    calibrated CPU profile against the ten recorded sweeps of 30 layouts on 4 gloo ranks, each
    layout at its least disturbed sweep. The targets of the issue: Spearman >= 0.8, the planner's
    first choice within 10% of the best measured."""
    data = ROOT / "benchmarks" / "data" / "planner_sweep_cpu_4ranks"
    sweeps = sorted(data.glob("sweep*.csv"))
    assert len(sweeps) == 10
    res = sc.compare(sc.GRID, sweeps, str(data / "local.yaml"))
    assert res["runs"] == 30 and not res["failed"]
    assert res["spearman"] >= 0.8
    assert res["first_choice_gap"] <= 0.10
    # The same figures as the only set of all ten (`--best-of 10`).
    every = sc.best_of(sc.GRID, sc.read_sweeps(sweeps), str(data / "local.yaml"), 10)
    assert every["sets"] == 1 and every["spearman_median"] == res["spearman"]
    assert every["both_targets_met"] == 1


def test_cost_model_against_the_sweep_with_repeats_on_a_second_machine():
    """Regression guard on the out-of-sample record of benchmarks/planner_notes.md ("A second
    machine"): on a
    2-core Intel Xeon, `ultrascale calibrate --ranks 4` and one `ultrascale sweep --repeats 6` of
    the same 30 layouts, with the cost model unchanged since the AMD sweeps. Each layout at its
    fastest repeat meets both targets of the issue, and so does every repeat alone on the rank
    correlation (the repeats agree with each other at Spearman 0.93 or more)."""
    data = ROOT / "benchmarks" / "data" / "planner_sweep_cpu_4ranks_xeon"
    profile = str(data / "local.yaml")
    repeats = sc.read_sweeps([data / "results.csv"])
    assert len(repeats) == 6 and all(len(runs) == 30 for _, runs in repeats)
    res = sc.compare_sweeps(sc.GRID, repeats, profile)
    assert res["runs"] == 30 and not res["failed"]
    assert res["spearman"] >= 0.85
    assert res["first_choice_gap"] <= 0.10
    assert min(p["spearman"] for p in res["sweep_agreement"]) >= 0.9
    alone = sc.best_of(sc.GRID, repeats, profile, 1)
    assert alone["sets"] == 6 and alone["spearman_min"] >= 0.8
    assert alone["both_targets_met"] >= 4


def test_the_cache_model_against_a_sweep_it_had_not_seen():
    """Regression guard on benchmarks/planner_notes.md ("a cache model for elementwise work, and a
    second
    sweep"): on the Xeon, a calibration with the two-size elementwise probe and a second sweep of
    the 30 layouts (three repeats) run after the cache model was written. Both targets of the
    issue hold, and the cache model lowers the median error against the same calibration with one
    elementwise efficiency."""
    from ultrascale.planner.hardware import get_hardware

    data = ROOT / "benchmarks" / "data" / "planner_sweep_cpu_4ranks_xeon"
    hw = get_hardware(data / "local_2.yaml")
    assert hw.cache_bytes == 2 * 2**20 and 0 < hw.hbm_eff < hw.cached_eff <= 1
    repeats = sc.read_sweeps([data / "results_2.csv"])
    assert len(repeats) == 3 and all(len(runs) == 30 for _, runs in repeats)
    res = sc.compare_sweeps(sc.GRID, repeats, hw)
    flat = sc.compare_sweeps(sc.GRID, repeats, sc.without_cache_model(hw))
    assert res["runs"] == 30 and not res["failed"]
    assert res["spearman"] >= 0.9 and res["first_choice_gap"] <= 0.05
    assert res["median_error"] < flat["median_error"]
    assert sc.best_of(sc.GRID, repeats, hw, 1)["both_targets_met"] == 3


def test_cost_model_against_the_sweeps_on_a_third_machine():
    """Regression guard on benchmarks/planner_notes.md ("A second 2-core AMD EPYC"): out of sample,
    three
    repeats, then three more. With the first three the rank correlation meets the issue's target
    and the first choice, a near tie between ZeRO-1 and ZeRO-0 of the same layout (predicted 2%
    apart), misses it by the recorded 13.8%; with all six both hold. The profile has no cache
    model (a 512 KiB L2 does not hold the small elementwise probe)."""
    from ultrascale.planner.hardware import get_hardware

    data = ROOT / "benchmarks" / "data" / "planner_sweep_cpu_4ranks_epyc2"
    hw = get_hardware(data / "local.yaml")
    assert hw.cached_eff is None
    repeats = sc.read_sweeps([data / "results.csv"])
    assert len(repeats) == 3 and all(len(runs) == 30 for _, runs in repeats)
    res = sc.compare_sweeps(sc.GRID, repeats, hw)
    assert res["runs"] == 30 and not res["failed"]
    assert res["spearman"] >= 0.85
    assert res["first_choice"] == "dp2-tp1-pp2-zero1-mbs4-acc1"
    assert res["first_choice_gap"] == pytest.approx(0.138, abs=0.001)
    assert res["best_measured"] == "dp2-tp1-pp2-zero0-mbs4-acc1"
    # Three more repeats, nothing changed: over all six both targets hold.
    six = repeats + sc.read_sweeps([data / "results_repeats_4-6.csv"])
    assert len(six) == 6
    res6 = sc.compare_sweeps(sc.GRID, six, hw)
    assert res6["spearman"] >= 0.8 and res6["first_choice_gap"] <= 0.10
    assert res6["best_measured"] == "dp1-tp2-pp2-zero0-mbs4-acc2"


def test_the_comparison_without_the_cache_model_keeps_the_measured_update():
    """planner_vs_sweep --without-cache-model: one elementwise efficiency (the in-cache one), as
    calibrations gave before the two-size probe; the optimizer's predicted time is unchanged."""
    from ultrascale.planner.hardware import get_hardware
    from ultrascale.theory.rates import memory_time

    data = ROOT / "benchmarks" / "data"
    old = get_hardware(data / "planner_sweep_cpu_4ranks_xeon" / "local.yaml")
    assert sc.without_cache_model(old) is old  # calibrated before the cache model
    hw = old.with_(hbm_eff=0.4, cache_bytes=2 * 2**20, cached_eff=0.6)
    flat = sc.without_cache_model(hw)
    assert flat.cache_bytes is None and flat.hbm_eff == 0.6
    assert memory_time(flat, 1e6 * flat.optimizer_bytes_per_param) == pytest.approx(
        memory_time(hw, 1e6 * hw.optimizer_bytes_per_param))
    # Per dtype too: each dtype's in-cache efficiency, for all its work.
    per_dtype = sc.without_cache_model(hw.with_(hbm_eff_by_dtype={"fp32": 0.4, "bf16": 0.2},
                                                cached_eff_by_dtype={"fp32": 0.6, "bf16": 0.3}))
    assert per_dtype.elementwise_effs("bf16") == (0.3, None)
    assert per_dtype.elementwise_effs("fp32") == (0.6, None)


def test_a_sweep_with_repeats_counts_as_one_sweep_per_repeat(tmp_path):
    """planner_vs_sweep reads the `step_time_s_each` column of a sweep run with repeats: each
    layout's repeats are compared as separate sweeps, and its figure is its fastest repeat."""
    path = tmp_path / "results.csv"
    path.write_text("name,status,step_time_s,step_time_s_each,load_1min\n"
                    "a,ok,1.0,1.0;1.5;1.2,3\nb,ok,2.0,2.5;2.0;,4\nc,ok,3.0,3.0;3.5;3.1,2\n"
                    "d,failed,,,\n")
    sweeps = sc.read_sweeps([path])
    assert [label.split()[-1] for label, _ in sweeps] == ["1", "2", "3"]
    assert sweeps[2][1] == {"a": (1.2, None), "c": (3.1, None)}  # b's third repeat failed
    times = sc.measured_step_times(sweeps)
    assert min(t for t, _ in times["b"]) == 2.0 and "d" not in times
    agreement = sc.sweep_agreement(sweeps)
    # Repeats 1 and 2 share three layouts; pairs with the third share two, too few to rank.
    assert [(p["layouts"], p["spearman"]) for p in agreement] == [(3, 1.0)]


def test_pairs_of_layouts_differing_in_one_setting():
    """planner_vs_sweep --pair zero1 zero0: each ZeRO-1 layout over the same layout with ZeRO-0,
    measured and predicted (benchmarks/planner_notes.md, the second EPYC)."""
    data = ROOT / "benchmarks" / "data" / "planner_sweep_cpu_4ranks_epyc2"
    res = sc.compare(sc.GRID, [data / "results.csv"], str(data / "local.yaml"))
    pairs = sc.setting_pairs(res)
    # ZeRO-1 runs with dp2 x pp2 (3 micro-batch sizes), dp2 x tp2 (3) and dp4 (2).
    assert len(pairs) == 8
    rows = {r["layout"]: r for r in res["rows"]}
    first = pairs[0]
    assert first["measured"] == pytest.approx(
        rows[first["layout"]]["measured_s"]
        / rows[first["layout"].replace("zero1", "zero0")]["measured_s"])
    assert all(0.9 < q["predicted"] < 1.0 for q in pairs)  # the model favours ZeRO-1 slightly
    assert sc.setting_pairs(res, "zero3", "zero1") and not sc.setting_pairs(res, "tp8", "tp1")


@pytest.mark.parametrize("preset", ["llama3-8b", "deepseek-v3", "mixtral-8x7b"])
def test_a_block_costs_the_same_whatever_the_step_around_it(preset):
    """The planner costs one block once per layout of the fields it reads (`cost.STEP_FIELDS`
    are those it never reads: dp, pp, ZeRO, accumulation, schedule, ...): for every layout of a
    search, each step field set otherwise changes nothing of the block's times."""
    import random

    from ultrascale.planner.cost import STEP_FIELDS
    from ultrascale.theory import block
    from ultrascale.theory.shape import Shape, model_shape
    from ultrascale.theory.terms import attention_of

    model = ModelConfig(preset=preset)
    m = model_shape(model)
    layouts = enumerate_layouts(model, 256, 2**24, 8192, H100)
    others = dict(dp=7, pp=3, zero=3, zero3_gather="micro_batch", dp_shard=2, grad_accum=5,
                  pp_schedule="dualpipev", pp_virtual_stages=2, master_dtype="bf16",
                  grad_accum_dtype="bf16", bucket_mb=3.0, optimizer="muon")
    assert set(others) == set(STEP_FIELDS)

    def times(lay):
        return block.block_times(m, lay, H100, Shape.of(m, lay), attention_of(m))
    for lay in random.Random(0).sample(layouts, 60):
        base = times(lay)
        for name, value in others.items():
            assert times(replace(lay, **{name: value})) == base, name
        assert times(replace(lay, **STEP_FIELDS)) == base


def test_the_planners_shared_costing_is_predicts_own():
    """`cost.predict_both` (the planner's: one costing shared by the engine's split and the
    balanced one, block times shared between layouts) answers as `predict` does alone."""
    from ultrascale.planner.cost import predict, predict_both

    model = ModelConfig(preset="deepseek-v3")
    layouts = [lay for lay in enumerate_layouts(model, 256, 2**24, 8192, H100) if lay.pp > 1]
    blocks: dict = {}
    sample = layouts[:30] + layouts[::max(1, len(layouts) // 30)]  # neighbours, and far apart
    for lay in sample:
        plain, balanced = predict_both(model, lay, H100, blocks=blocks)
        assert plain.as_dict() == predict(model, lay, H100, memory=False).as_dict()
        assert balanced.as_dict() == predict(model, lay, H100, memory=False,
                                             pp_layers="balanced").as_dict()
    assert 0 < len(blocks) < len(sample)  # the neighbours (schedules, ZeRO) share their blocks


def test_a_plan_tells_how_far_it_is(monkeypatch):
    """`plan(progress=...)`: the costing, then the memory checks, counted up to their totals
    (`ultrascale plan` draws it as a bar on a terminal)."""
    from ultrascale.planner import search

    monkeypatch.setattr(search, "PROGRESS_EVERY", 100)
    told: list[tuple[str, int, int]] = []
    result = plan(M8B, 8, 2**20, H100, progress=lambda *t: told.append(t))
    costing = [t for t in told if t[0] == "costing layouts"]
    checking = [t for t in told if t[0] == "checking memory"]
    assert costing[0][1] == 0 and costing[-1][1] >= costing[-1][2] - 100
    assert costing[-1][2] == result.considered > 1000
    assert [t[1] for t in costing] == sorted(t[1] for t in costing) and checking
    assert told.index(checking[0]) > told.index(costing[-1])


@pytest.mark.parametrize("preset", ["llama3-405b", "deepseek-v3"])
def test_only_the_split_terms_read_the_split(preset):
    """A second split of a layout costs only `cost.SPLIT_TERMS` again: every other term's
    seconds are the same on the engine's split, the balanced one and one a layer apart."""
    import random

    from ultrascale.planner.cost import SPLIT_TERMS, _costed, balanced, setup, with_split

    model = ModelConfig(preset=preset)
    layouts = [lay for lay in enumerate_layouts(model, 256, 2**24, 8192, H100) if lay.pp > 1]
    for lay in random.Random(0).sample(layouts, 25):
        first = _costed(setup(model, lay, H100))
        split = list(first.step.split)
        if len(split) > 1 and split[0] > 1:
            split[0], split[1] = split[0] - 1, split[1] + 1
        for other in (balanced(first).step, with_split(first.step, split)):
            again = _costed(other)
            assert {k: v for k, v in again.by_term.items() if k not in SPLIT_TERMS} == \
                {k: v for k, v in first.by_term.items() if k not in SPLIT_TERMS}
