"""Published model shapes. A preset only supplies defaults: explicit `model.*` keys override them,
as they do a Hugging Face config's (`model_defaults`, which the config's `model` section asks)."""

from __future__ import annotations

from ultrascale import hf_arch
from ultrascale.config_fields import ConfigError

# Model keys that a preset or a Hugging Face config fills (the rest have their own defaults).
SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "vocab_size", "tie_embeddings", "rope_theta")

# Llama 3.x shapes as published by Meta (config.json of each release). `tiny` is ours: small enough
# to train on two CPU cores in a couple of minutes, with a byte-level vocabulary.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=384,
        vocab_size=256, tie_embeddings=True, rope_theta=10000.0,
    ),
    "llama3-1b": dict(  # Llama 3.2 1B
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192,
        vocab_size=128256, tie_embeddings=True, rope_theta=500000.0,
    ),
    "llama3-3b": dict(  # Llama 3.2 3B
        hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, ffn_hidden_size=8192,
        vocab_size=128256, tie_embeddings=True, rope_theta=500000.0,
    ),
    "llama3-8b": dict(  # Llama 3.1 8B
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
    "llama3-70b": dict(  # Llama 3.1 70B
        hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
    "llama3-405b": dict(  # Llama 3.1 405B
        hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
    # Mixtures of experts (docs/moe.md). `tiny-moe` is ours: `tiny` with 8 experts of width 128,
    # two per token, sigmoid scores balanced by the auxiliary-loss-free bias (its rate is ten
    # times DeepSeek-V3's, for a run of 200 steps); it trains on two CPU cores.
    "tiny-moe": dict(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=384,
        vocab_size=256, tie_embeddings=True, rope_theta=10000.0, num_experts=8, experts_top_k=2,
        moe_ffn_hidden_size=128, router="sigmoid", balance="aux_free", bias_update_rate=0.01,
    ),
    "mixtral-8x7b": dict(  # Mixtral 8x7B (46.7B parameters, 12.9B active)
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
        vocab_size=32000, tie_embeddings=False, rope_theta=1000000.0, num_experts=8,
        experts_top_k=2, router="softmax", balance="aux_loss", aux_loss_coeff=0.02,
    ),
    # Qwen3-30B-A3B as published: 128 experts of 768, 8 per token; 32 query heads of 128 (q and o
    # project 2048 <-> 4096) with RMSNorms over each query and key head.
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
        ffn_hidden_size=6144, vocab_size=151936, tie_embeddings=False, rope_theta=1000000.0,
        num_experts=128, experts_top_k=8, moe_ffn_hidden_size=768, router="softmax",
        balance="aux_loss", aux_loss_coeff=0.001,
    ),
    # DeepSeek-V3 as published (config.json of deepseek-ai/DeepSeek-V3; 671B parameters, 37B
    # active, and one MTP module of 11.5B besides the shared embedding and head): 3 dense layers,
    # then 256 routed experts of 2048 in 8 groups (8 per token among the best 4 groups, sigmoid
    # scores scaled by 2.5, the auxiliary-loss-free bias with a sequence-wise auxiliary loss of
    # 1e-4) and 1 shared expert; multi-head latent attention (a 1536-wide query latent, a
    # 512-wide key-value latent, 128 heads of 128 + 64 rotary query-key and 128 value
    # dimensions, DeepSeek's interleaved rotary layout and YaRN scaling 40x from 4096 tokens).
    "deepseek-v3": dict(
        hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128, ffn_hidden_size=18432,
        vocab_size=129280, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6,
        num_experts=256, experts_top_k=8, shared_experts=1, moe_ffn_hidden_size=2048,
        first_k_dense=3, router="sigmoid", balance="aux_free_and_aux_loss", aux_loss_coeff=1e-4,
        bias_update_rate=0.001, router_groups=8, router_topk_groups=4,
        routed_scaling_factor=2.5, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_positions=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        mtp_layers=1,
    ),
    # `tiny-deepseek` is ours: DeepSeek-V3's architecture at `tiny`'s size, for CPUs. Every
    # feature is on and every split applies (4 heads, 8 experts in 4 groups, 4 layers): MLA with
    # values narrower than queries and keys (16 against 16 + 8), YaRN (4x from 16 tokens, so that
    # its softmax correction counts), the first layer dense, 2 of 8 experts among the best 2 of 4
    # groups, one shared expert, the bias at ten times DeepSeek-V3's rate with a sequence-wise
    # auxiliary loss, and one MTP module.
    "tiny-deepseek": dict(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
        vocab_size=256, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6,
        num_experts=8, experts_top_k=2, shared_experts=1, moe_ffn_hidden_size=32, first_k_dense=1,
        router="sigmoid", balance="aux_free_and_aux_loss", aux_loss_coeff=1e-3,
        bias_update_rate=0.01, router_groups=4, router_topk_groups=2, routed_scaling_factor=2.5,
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_positions=16, beta_fast=32.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        mtp_layers=1,
    ),
}


def model_defaults(data: dict) -> dict:
    """The `model` section's keys with a preset's (or a Hugging Face config's) values as their
    defaults, and the defaults that follow from other keys; explicit keys win."""
    hf_source = data.get("from_hf") or data.get("hf_config")
    if hf_source is not None:
        return _fill_from_hf(data, hf_source)
    preset = data.get("preset", "tiny")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(
            f"model.preset={preset!r} is not a known preset. Choose one of "
            f"{', '.join(PRESETS)}, or set model.preset=null and give the shape keys "
            "(hidden_size, num_layers, num_heads, ...) yourself."
        )
    merged = dict(PRESETS[preset]) if preset is not None else {}
    merged.update({k: v for k, v in data.items() if v is not None or k == "preset"})
    return _derived_defaults(merged)


def _fill_from_hf(data: dict, source: str) -> dict:
    """A Hugging Face config's values are the defaults, as a preset's are. A config resolved before
    (a run's config.yaml, a checkpoint's meta.json) names every key: then the folder need not
    exist any more (export and generate read such configs)."""
    key = "from_hf" if data.get("from_hf") else "hf_config"
    if data.get("from_hf") and data.get("hf_config"):
        raise ConfigError("model.from_hf and model.hf_config are both given: from_hf already "
                          "takes the architecture from the folder's config.json. Keep one.")
    if data.get("preset"):
        raise ConfigError(f"model.preset={data['preset']!r} and model.{key}={source!r} both "
                          "give the model's shape. Set model.preset=null (or leave it out).")
    given = {k: v for k, v in data.items() if v is not None}
    try:
        merged = hf_arch.model_keys(source)
    except hf_arch.HFConfigError as exc:
        if not all(k in given for k in SHAPE_KEYS):
            raise ConfigError(f"model.{key}: {exc}") from None
        merged = {}
    merged.update(given)
    merged["preset"] = None
    return _derived_defaults(merged)


def _derived_defaults(merged: dict) -> dict:
    """Defaults that follow from other keys."""
    h, heads = merged.get("hidden_size") or 0, merged.get("num_heads") or 0
    if not merged.get("num_kv_heads"):
        merged["num_kv_heads"] = heads
    merged.setdefault("tie_embeddings", False)
    if not merged.get("rope_theta"):
        merged["rope_theta"] = 10000.0
    if not merged.get("head_dim") and heads and h % heads == 0:
        merged["head_dim"] = h // heads  # (left 0 otherwise: the rules say why)
    return merged
