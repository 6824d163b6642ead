"""Muon's pieces on one process: Newton-Schulz, which parameters it steps, and the counts the
estimator and the planner take from params.py (against the model's own parameters)."""

import json

import pytest
import torch

from parity import make_config
from ultrascale.layout import Layout
from ultrascale.memory.estimator import estimate
from ultrascale.optim.muon import is_matrix, newton_schulz, update_scale
from ultrascale.params import stage_matrix_params
from ultrascale.train.trainer import build_model


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (4, 24, 40)])
def test_newton_schulz_orthogonalises_each_matrix(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g)
    assert o.shape == g.shape and o.dtype == torch.float32
    # The quintic leaves every singular value in about [0.7, 1.2] (not exactly 1).
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25
    if len(shape) == 3:  # a stack of experts: each on its own
        for e in range(shape[0]):
            torch.testing.assert_close(o[e], newton_schulz(g[e]), rtol=1e-5, atol=1e-6)
    # Scale-free: the momentum's size does not matter, only its direction.
    torch.testing.assert_close(newton_schulz(1e3 * g), o, rtol=1e-4, atol=1e-5)
    assert update_scale(shape) == pytest.approx(0.2 * max(shape[-2:]) ** 0.5)


@pytest.mark.parametrize("overrides", [
    [],
    ["model.attention_bias=true", "model.qk_norm=true", "model.tie_embeddings=false"],
    ["model.num_experts=8", "model.experts_top_k=2", "model.moe_ffn_hidden_size=32",
     "model.first_k_dense=1", "model.shared_experts=1", "model.shared_expert_gate=true"],
], ids=["tiny", "bias-qknorm-untied", "moe-shared-gated"])
def test_matrix_count_matches_the_model(overrides):
    """params.py's count of Muon's matrices is the model's is_matrix parameters: the blocks'
    projections and experts, not the embedding, head, norms, biases, router or gates."""
    cfg = make_config(overrides)
    model = build_model(cfg.model, 1)
    muon = {n: p.numel() for n, p in model.named_parameters() if is_matrix(n, p.dim())}
    assert not any(k in n for n in muon for k in ("embed", "norm", "bias", "router", "gate."))
    assert any(n.endswith("q_proj.weight") for n in muon)
    dense, experts = stage_matrix_params(cfg.model, Layout(), cfg.model.num_layers, 0)
    assert dense + experts == sum(muon.values())


def test_the_estimate_counts_one_buffer_per_matrix():
    cfg = make_config([])
    adam = estimate(cfg.model, cfg.layout())
    muon = estimate(cfg.model, cfg.layout().with_(optimizer="muon"))
    matrices = sum(stage_matrix_params(cfg.model, Layout(), cfg.model.num_layers, 0))
    assert adam.optimizer - muon.optimizer == 4 * matrices
    assert (adam.params, adam.grads) == (muon.params, muon.grads)
    # ZeRO-1 over dp=2: each rank saves its half.
    lay = cfg.layout().with_(dp=2, zero=1)
    assert (estimate(cfg.model, lay).optimizer - estimate(cfg.model, lay.with_(optimizer="muon"))
            .optimizer) == 2 * matrices


def test_the_planner_costs_newton_schulz():
    from ultrascale.config import ModelConfig
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    model, hw = ModelConfig(preset="llama3-8b"), get_hardware("h100")

    def extra(lay: Layout) -> float:
        """Muon's optimizer term over AdamW's."""
        return (predict(model, lay.with_(optimizer="muon"), hw).breakdown["optimizer"]
                - predict(model, lay, hw).breakdown["optimizer"])

    one = extra(Layout(dp=1, mbs=1, grad_accum=64, seq_len=4096))
    assert one > 0  # one rank runs every matrix's Newton-Schulz
    for zero in (0, 1):  # dealt over 8 replicas or shards (plus the all-to-alls)
        assert 0 < extra(Layout(dp=8, zero=zero, mbs=1, grad_accum=8, seq_len=4096)) < one / 4


def test_the_config_takes_muon_and_nothing_else():
    assert make_config(["training.optimizer=muon"]).training.optimizer == "muon"
    with pytest.raises(Exception, match="optimizer"):
        make_config(["training.optimizer=sgd"])


def test_plan_ranks_layouts_for_muon(tmp_path, capsys):
    """`ultrascale plan --optimizer muon`: the same layouts fit in less memory, and the config it
    writes trains with Muon."""
    import yaml

    from ultrascale.cli import main

    plans = {}
    for opt in ("adamw", "muon"):
        out = tmp_path / f"{opt}.yaml"
        capsys.readouterr()
        assert main(["plan", "--preset", "llama3-8b", "--gpus", "8", "--optimizer", opt,
                     "--config-out", str(out), "--json"]) == 0
        plans[opt] = (json.loads(capsys.readouterr().out), yaml.safe_load(out.read_text()))
    adam, muon = plans["adamw"][0]["ranked"][0], plans["muon"][0]["ranked"][0]
    assert muon["layout_fields"]["optimizer"] == "muon"
    assert muon["layout"] == adam["layout"] and muon["memory_bytes"] < adam["memory_bytes"]
    assert plans["muon"][1]["training"]["optimizer"] == "muon"
