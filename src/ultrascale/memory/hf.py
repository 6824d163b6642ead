"""A ModelConfig from a Hugging Face `config.json` (Llama, Mistral, Qwen, Mixtral-style MoE, ...)."""

from __future__ import annotations

import json
from pathlib import Path

from ultrascale.config import ConfigError, ModelConfig


def _first(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def from_hf_config(path: str | Path) -> ModelConfig:
    """Read the shape keys of a Hugging Face decoder config; raise ConfigError if unusable."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"Hugging Face config {str(path)!r} does not exist. Give the path of a "
                          "config.json (or of the folder that holds it).")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object of model settings.")
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the decoder under text_config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ConfigError(f"{str(path)!r} lacks {', '.join(missing)}: it does not look like the "
                          "config.json of a decoder-only transformer.")
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    ffn = _first(cfg, "intermediate_size", "ffn_hidden_size", default=0)
    shared = moe_ffn = first_k = 0
    router = "softmax"
    if experts:
        # MoE configs give the expert width separately when it differs from the dense MLP's
        # (Qwen-MoE, DeepSeek), whose width the first dense layers keep (DeepSeek).
        moe_ffn = int(_first(cfg, "moe_intermediate_size", default=0))
        shared = int(_first(cfg, "n_shared_experts", "num_shared_experts", default=0))
        if not shared and cfg.get("shared_expert_intermediate_size"):
            shared = max(1, round(cfg["shared_expert_intermediate_size"] / (moe_ffn or ffn)))
        first_k = int(_first(cfg, "first_k_dense_replace", default=0))
        router = "sigmoid" if cfg.get("scoring_func") == "sigmoid" else "softmax"
    data = dict(
        preset=None, hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(_first(cfg, "num_key_value_heads", default=cfg["num_attention_heads"])),
        ffn_hidden_size=int(ffn), vocab_size=int(cfg["vocab_size"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(cfg.get("rope_theta") or 10000.0),
        norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-5)),
        num_experts=experts,
        experts_top_k=int(_first(cfg, "num_experts_per_tok", "moe_topk", default=0)) if experts else 0,
        shared_experts=shared, moe_ffn_hidden_size=moe_ffn, first_k_dense=first_k, router=router,
    )
    from pydantic import ValidationError

    try:
        return ModelConfig(**data)
    except ValidationError as err:
        inner = [str((e.get("ctx") or {}).get("error") or e["msg"]) for e in err.errors()]
        raise ConfigError(f"{str(path)!r}: {' '.join(inner)}") from None
