"""The plain model: shapes, parameter count, layout-independent initialisation, SDPA parity."""

import math

import torch
import torch.nn.functional as F

from ultrascale import params
from ultrascale.config import build_config
from ultrascale.models import ops
from ultrascale.models.llama import Llama, build_model
from ultrascale.presets import PRESETS


def test_forward_shapes_and_param_count():
    cfg = build_config().model
    model = build_model(cfg, seed=0)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_published_preset_sizes():
    # Parameter counts of the Llama 3.x releases (embedding included).
    expected = {"llama3-1b": 1.236e9, "llama3-3b": 3.213e9, "llama3-8b": 8.030e9,
                "llama3-70b": 70.55e9, "llama3-405b": 405.9e9}
    for name, count in expected.items():
        n = build_config(overrides=[f"model.preset={name}", "parallel.dp=1"]).model.num_params()
        assert math.isclose(n, count, rel_tol=2e-3), (name, n)
    # Mixtures of experts, total and active (the embedding included in both), with relative
    # tolerances: the shapes are exact (DeepSeek's published 671B and 37B leave its MTP module
    # out, as here); the published active counts are rounded (Qwen3's 3.35B to 3.3B).
    moe = {"mixtral-8x7b": (46.7e9, 12.9e9, 2e-3, 0.01),
           "qwen3-30b-a3b": (30.5e9, 3.3e9, 2e-3, 0.02),
           "deepseek-v3": (671e9, 37e9, 2e-3, 0.05)}
    for name, (total, active, tol, tol_active) in moe.items():
        m = build_config(overrides=[f"model.preset={name}", "parallel.dp=1"]).model
        main = m.model_copy(update={"mtp_layers": 0})
        emb = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
        assert math.isclose(main.num_params(), total, rel_tol=tol), (name, main.num_params())
        assert math.isclose(params.active_params(main) + emb, active, rel_tol=tol_active), name
    v3 = build_config(overrides=["model.preset=deepseek-v3", "parallel.dp=1"]).model
    mtp = v3.num_params() - v3.model_copy(update={"mtp_layers": 0}).num_params()
    assert math.isclose(mtp, 11.5e9, rel_tol=0.01)  # DeepSeek's 14B less the embedding and head
    assert set(expected) | set(moe) | {"tiny", "tiny-moe", "tiny-deepseek"} == set(PRESETS)


def test_init_depends_only_on_seed_and_name():
    cfg = build_config().model
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    c = build_model(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc)
    # A model with fewer layers draws the same numbers for the layers it shares; only the
    # residual-output projections differ, by their 1/sqrt(2L) scale (pipeline stages keep the
    # full model's L, so their weights are exactly those of the full model).
    small = build_model(cfg.model_copy(update={"num_layers": 2}), seed=7)
    big = dict(a.named_parameters())
    scale = math.sqrt(2 * cfg.num_layers) / math.sqrt(2 * 2)
    for name, p in small.named_parameters():
        if "layers." in name:
            ref = big[name] * scale if name.endswith(("o_proj.weight", "down_proj.weight")) \
                else big[name]
            torch.testing.assert_close(p, ref)


def test_untied_head_and_gqa_attention_matches_reference():
    cfg = build_config(overrides=["model.tie_embeddings=false"]).model
    model = build_model(cfg, seed=1)
    assert model.output is not None
    attn = model.layers["0"].attn
    x = torch.randn(2, 8, cfg.hidden_size)
    pos = torch.arange(8)
    # Reference: repeat kv heads explicitly and use a manual causal softmax.
    q = attn.q_proj(x).view(2, 8, cfg.num_heads, cfg.head_dim)
    k = attn.k_proj(x).view(2, 8, cfg.num_kv_heads, cfg.head_dim)
    v = attn.v_proj(x).view(2, 8, cfg.num_kv_heads, cfg.head_dim)
    rope = ops.rotary_tables(pos, cfg.head_dim, cfg.rope_theta)
    q, k = ops.rotary(q, rope), ops.rotary(k, rope)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    scores = scores.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, -1), v).reshape(2, 8, -1)
    torch.testing.assert_close(attn(x, rope), attn.o_proj(ref), rtol=1e-5, atol=1e-5)


def test_causal_no_future_leak():
    model = build_model(build_config().model, seed=3)
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(tokens)[0, :8], model(changed)[0, :8])


def test_flops_per_token_formula():
    cfg = build_config().model
    n = cfg.num_params(include_embedding=False) + cfg.vocab_size * cfg.hidden_size
    assert cfg.flops_per_token(128) == 6 * n + 12 * cfg.num_layers * cfg.hidden_size * 128


def test_stage_model_without_embed_or_head():
    model = build_model(build_config().model, seed=0)
    h = model.embed(torch.randint(0, 256, (1, 4)))
    model.embed = None
    model.norm, model.output = None, None
    assert model(h).shape == h.shape
    assert isinstance(model, Llama)
