"""The estimator and the planner on DeepSeek-V3's architecture (theory/mla.py, theory/mtp.py):
multi-head latent attention's and multi-token prediction's saved activations against the
engine's, measured on one CPU process under each recompute policy (DeepSeek-V3's
norms_and_mla_up included); the parameters counted on the head's stage; the h800 profile; the
planner on DeepSeek-V3's layout; the refusals before any process starts.

Tolerance: the issue's 5% on the saved activations. The estimate lands within 0.1% of the meter
on every policy here (the residue: a few bool masks of 64 tokens), and the effects it must tell
apart are far larger: the same model estimated as multi-head attention was 20% short under none,
its attention counted at the padded width (values zero-padded to the query-key width, the
output projection's input a copy) 7.3% over, and norms_and_mla_up saves 34% less than none.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from ultrascale.config import build_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.memory.estimator import LayoutError, estimate
from ultrascale.memory.measure import SavedActivationMeter
from ultrascale.models.llama import build_model
from ultrascale.parallel.apply import parallelize
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import get_hardware
from ultrascale.theory.terms import attention_of
from ultrascale.theory.shape import model_shape

TOLERANCE = 0.05  # the acceptance
SEQ, BATCH = 32, 2

# (name, model keys over tiny-deepseek, recompute): every policy with the MTP module on, and
# one projection for the queries (no q_lora_rank) under DeepSeek-V3's policy and none.
CASES = [
    ("none", {}, "none"),
    ("selective", {}, "selective"),
    ("full", {}, "full"),
    ("norms_and_mla_up", {}, "norms_and_mla_up"),
    ("no-q-latent-none", {"q_lora_rank": 0, "mtp_layers": 0}, "none"),
    ("no-q-latent-norms_and_mla_up", {"q_lora_rank": 0, "mtp_layers": 0}, "norms_and_mla_up"),
]


def _config(model: dict, recompute: str):
    return build_config({"model": {"preset": "tiny-deepseek", **model}, "parallel": {"dp": 1},
                         "device": "cpu", "precision": {"dtype": "fp32"},
                         "training": {"seq_len": SEQ, "micro_batch_size": BATCH,
                                      "recompute": recompute}})


def _measure(cfg) -> tuple[int, dict]:
    """The meter's peak over one micro-batch's forward and backward, and the runtime's counted
    parameter bytes."""
    ctx = ParallelContext.without_mesh("cpu")
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    with SavedActivationMeter(rt.module) as meter:
        rt.forward_backward([(tokens[:, :-1], tokens[:, 1:])], 1.0 / (BATCH * SEQ))
    return meter.peak_bytes, rt.memory_report()


@pytest.mark.parametrize("name,model,recompute", CASES, ids=[c[0] for c in CASES])
def test_mla_and_mtp_saved_activations_match_the_meter(name, model, recompute):
    cfg = _config(model, recompute)
    assert attention_of(model_shape(cfg.model)).name == "mla"
    measured, report = _measure(cfg)
    est = estimate(cfg.model, cfg.layout())
    assert abs(est.saved_activations - measured) <= TOLERANCE * measured, (
        f"{name}: estimated {est.saved_activations} B, measured {measured} B "
        f"({est.activation_parts})")
    # The MTP module's parameters (and its norms, projection and block) are on this stage.
    assert est.params == report["params_bytes"]


def test_norms_and_mla_up_keeps_only_the_latents_and_the_norms_inputs():
    """The policy's parts: no q, k, v; the latents kept; each norm its input only."""
    none = estimate(_config({}, "none").model, _config({}, "none").layout())
    policy_cfg = _config({}, "norms_and_mla_up")
    policy = estimate(policy_cfg.model, policy_cfg.layout())
    assert "q, k, v" in none.activation_parts and "q, k, v" not in policy.activation_parts
    assert policy.activation_parts["MLA latents"] < none.activation_parts["MLA latents"]
    assert policy.activation_parts["MLP norm"] < none.activation_parts["MLP norm"]
    assert policy.saved_activations < 0.7 * none.saved_activations


def _deepseek_v3(schedule: str):
    """DeepSeek-V3 on its published layout (configs/deepseek-v3.yaml): 2,048 GPUs, pp16 x ep64,
    ZeRO-1 over dp128, no tp, 4,096-token sequences, its recompute policy and FP8."""
    par = {"dp": 128, "ep": 64, "pp": 16, "zero": 1, "tp": 1}
    if schedule == "dualpipev":
        par.update(pp_schedule="dualpipev", pp_virtual_stages=2,
                   pp_layers=[2] * 29 + [1, 1, 1])
    else:
        par["pp_layers"] = [4] * 15 + [1]
    return build_config({"model": {"preset": "deepseek-v3"}, "parallel": par, "device": "cuda",
                         "precision": {"dtype": "fp8", "fp8_recipe": "blockwise"},
                         "training": {"seq_len": 4096, "micro_batch_size": 1,
                                      "grad_accum_steps": 120, "recompute": "norms_and_mla_up",
                                      "mtp_loss_weight": 0.3}})


def test_h800_is_an_h100_with_slower_nvlink():
    h100, h800 = get_hardware("h100"), get_hardware("h800")
    assert h800.peak_flops == h100.peak_flops and h800.memory_bytes == h100.memory_bytes
    assert h800.inter == h100.inter  # 8 x 400 Gb/s InfiniBand per node, as the H100's
    for kind, bw in h100.intra.busbw.items():
        assert h800.intra.busbw[kind] == pytest.approx(bw * 400 / 900, abs=1e9)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_planner_predicts_deepseek_v3_on_its_layout(schedule):
    """The planner runs DeepSeek-V3's layout on H800s under 1F1B and DualPipeV: MLA's core at
    its two head widths, the recompute policy's rebuild, the MTP module on the head's rank and the
    expert all-to-alls all show in the step (docs/planner.md holds the figure)."""
    cfg = _deepseek_v3(schedule)
    pred = predict(cfg.model, cfg.layout(), get_hardware("h800"))
    parts = pred.breakdown
    assert parts["recompute"] > 0 and parts["ep_comm"] > 0 and parts["attention"] > 0
    faster_links = predict(cfg.model, cfg.layout(), get_hardware("h100"))
    assert faster_links.tokens_per_s_per_device >= pred.tokens_per_s_per_device


def test_mla_layouts_are_refused_with_the_fix():
    cfg = _config({}, "none")
    lay = replace(cfg.layout(), tp=3)
    with pytest.raises(LayoutError, match="MLA's up-projections"):
        estimate(cfg.model, lay)
    with pytest.raises((LayoutError, ValueError), match="Choose tp among"):
        predict(cfg.model, lay, get_hardware("h800"))


def test_the_planner_puts_deepseek_v3_within_20_percent_of_its_published_throughput():
    """Issue 45's acceptance, on configs/deepseek-v3.yaml as written (DualPipeV, the layers split
    as `--pp-layers balanced` gives): DeepSeek reports 180K H800 GPU-hours per trillion tokens,
    1e12 / (180e3 x 3600) = 1,543 tokens/s per GPU (docs/planner.md: 1,454 predicted). The split
    it writes is the balanced one, and the step is costed on the busiest rank, rank 0 with the
    head and the MTP module."""
    data = yaml.safe_load((Path(__file__).parents[1] / "configs/deepseek-v3.yaml").read_text())
    data.pop("data", None)
    cfg = build_config(data)
    hw = get_hardware("h800")
    pred = predict(cfg.model, cfg.layout(), hw, pp_layers=cfg.parallel.pp_layers)
    published = 1e12 / (180e3 * 3600)
    assert abs(pred.tokens_per_s_per_device / published - 1) <= 0.20
    balanced = predict(cfg.model, cfg.layout(), hw, memory=False, pp_layers="balanced")
    assert balanced.pp_layers == list(cfg.parallel.pp_layers)
    assert pred.costed_rank == 0 and pred.fits


def test_the_estimate_takes_a_split_per_stage_or_per_rank():
    """`parallel.pp_layers` lists the pp x v stages; the estimator sums them per rank as the
    schedule places them (dualpipev: stages r and 2pp - 1 - r)."""
    cfg = _deepseek_v3("dualpipev")
    stages = list(cfg.parallel.pp_layers)
    ranks = [stages[r] + stages[2 * 16 - 1 - r] for r in range(16)]
    assert estimate(cfg.model, cfg.layout(), pp_layers=stages).total == \
        estimate(cfg.model, cfg.layout(), pp_layers=ranks).total


def test_the_memory_command_takes_a_dualpipev_configs_split(capsys):
    """`ultrascale memory configs/deepseek-v3.yaml` (32 stages on 16 ranks) answers, fitting."""
    from ultrascale.memory.command import main as memory_main

    config = Path(__file__).parents[1] / "configs/deepseek-v3.yaml"
    assert memory_main([str(config), "--gpu", "h800"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "60.44" in out


def test_the_search_tries_deepseeks_recompute_policy_on_mla_models_only():
    """`ultrascale plan --gpus N` searches `norms_and_mla_up` beside none, selective and full for
    a model with multi-head latent attention (DeepSeek-V3's policy), not for a Llama; a
    `--search-recompute` list given wins."""
    from ultrascale.config import ModelConfig
    from ultrascale.planner.search import SearchSpace, enumerate_layouts

    hw = get_hardware("h800")

    def policies(preset, space=None):
        return {lay.recompute for lay in enumerate_layouts(ModelConfig(preset=preset), 16,
                                                           64 * 4096, 4096, hw, space)}

    assert policies("deepseek-v3") == {"none", "selective", "full", "norms_and_mla_up"}
    assert policies("llama3-8b") == {"none", "selective", "full"}
    assert policies("deepseek-v3", SearchSpace(recompute=["full"])) == {"full"}


def test_zero3_layer_backward_prefetches_the_unit_before_it():
    """ZeRO-3 without a pipeline (theory/data.py): a layer's backward holds it, the unit before
    it prefetched, its fp32 gradient and the one of the unit whose backward ran before it (its
    reduce-scatter in flight). deepseek-v3 cut to 4 layers has 3 dense ones and one MoE layer,
    so the MoE layer's backward prefetches a dense layer, not a second MoE one, and the head's
    gradient is the one in flight; multi-token prediction's block runs its backward first, with
    the head and the embedding it reads gathered beside it, and the embedding stays gathered,
    with the block's gradient for it, until its own backward, the last. (`ultrascale memory
    --preset deepseek-v3 --num-layers 4 --dp 16 --tp 2 --zero 3 --seq-len 4096 --mbs 1
    --measure`: +17.9% two sessions ago, +4.0% now; at 8 layers -18.3% before, +0.8% now.)"""
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import stage_view
    from ultrascale.params import layer_params, mtp_layer_params
    from ultrascale.theory.data import _layer_backward, _mtp_unit, _zero3_gathered

    m = model_shape(build_config({"model": {"preset": "deepseek-v3", "num_layers": 4}}).model)
    stage = stage_view(m, Layout(dp=16, tp=2, zero=3, seq_len=4096, mbs=1, dtype="bf16"))
    dense = layer_params(m, 2, 1, moe=False)[0]
    moe = sum(layer_params(m, 2, 1))
    vocab = -(-m.vocab_size // 2) * m.hidden_size
    assert stage.count == {"dense": 3, "moe": 1}
    assert _layer_backward(stage, 2, 4) == \
        2 * vocab * 2 + (moe + dense) * 2 + (moe + vocab + m.hidden_size) * 4
    assert _mtp_unit(stage) > 0 and mtp_layer_params(m) > _mtp_unit(stage)
    head = (vocab + m.hidden_size) * 2
    assert _zero3_gathered(stage, 2, 4) == {
        "ZeRO-3 gathered layers": head + (_mtp_unit(stage) + vocab) * 2}
