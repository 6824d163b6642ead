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
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token. Its attention has head_dim 128 (q and o
    # project 2048 <-> 4096); ours is hidden / heads = 64, so q, k, v and o count half their
    # weights (about 0.5B of 30.5B parameters).
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_hidden_size=6144,
        vocab_size=151936, tie_embeddings=False, rope_theta=1000000.0, num_experts=128,
        experts_top_k=8, moe_ffn_hidden_size=768, router="softmax", balance="aux_loss",
        aux_loss_coeff=0.001,
    ),
    # DeepSeek-V3 (671B, 37B active): 3 dense layers, then 256 routed experts of 2048 (8 per
    # token, sigmoid scores, the auxiliary-loss-free bias) and 1 shared expert. Its multi-head
    # latent attention (MLA) is approximated here by multi-head attention of the same width
    # (128 heads of 56): 206M attention weights per layer against MLA's 187M, and k, v kept per
    # head where MLA keeps a 512-wide latent. The estimator and the planner see this shape.
    "deepseek-v3": dict(
        hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128, ffn_hidden_size=18432,
        vocab_size=129280, tie_embeddings=False, rope_theta=10000.0, num_experts=256,
        experts_top_k=8, shared_experts=1, moe_ffn_hidden_size=2048, first_k_dense=3,
        router="sigmoid", balance="aux_free", bias_update_rate=0.001,
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
