"""Writing a Hugging Face config.json (`ultrascale export --to-hf`): which class holds our model
exactly, and its keys. Torch-free; the architectures' tables are hf_arch.py's (hf_deepseek.py's
for DeepSeek's classes)."""

from __future__ import annotations

from ultrascale import hf_deepseek
from ultrascale.hf_arch import (
    ARCHITECTURES, BY_TYPE, HFConfigError, balance_export, class_name, router_renormalizes,
)


def export_class(model) -> str:
    """The Hugging Face class that holds our `model` (a ModelConfig) exactly: its architecture's,
    or for a dense family trained with experts, that family's mixture-of-experts class.
    HFConfigError naming the key of a feature the class has no place for."""
    name = BY_TYPE[model.architecture]
    if model.attention == "mla" and ARCHITECTURES[name].deepseek is None:
        # multi-head latent attention is DeepSeek's: V3 for sigmoid scores, V2 for a softmax
        name = hf_deepseek.V3 if model.router == "sigmoid" else hf_deepseek.V2
    if ARCHITECTURES[name].deepseek is not None:
        return _deepseek_class(model, name)
    if model.mtp_layers:
        raise HFConfigError(f"model.mtp_layers={model.mtp_layers} cannot be written as a {name}: "
                            "it has no multi-token prediction (DeepSeek-V3 has)")
    if model.num_experts and ARCHITECTURES[name].moe is None:
        if ARCHITECTURES[name].with_experts is None:
            raise HFConfigError(f"model.architecture={model.architecture!r} has no "
                                "mixture-of-experts class to write experts into")
        name = ARCHITECTURES[name].with_experts
    arch = ARCHITECTURES[name]

    def refuse(key: str, value, why: str):
        raise HFConfigError(f"model.{key}={value!r} cannot be written as a {name}: {why}")

    if model.qk_norm != arch.qk_norm:
        refuse("qk_norm", model.qk_norm, "it has q/k norms" if arch.qk_norm else
               "it has no q/k norms")
    if model.attention_bias and arch.qkv_bias == "never":
        refuse("attention_bias", True, "it has no q, k, v biases")
    if not model.attention_bias and arch.qkv_bias == "always":
        refuse("attention_bias", False, "it always has q, k, v biases")
    written = arch.export_keys(model)
    if model.sliding_window is not None and "sliding_window" not in written:
        refuse("sliding_window", model.sliding_window, "it has no sliding window (write it as "
               "model.architecture=mistral, or qwen2 / qwen3)")
    if model.sliding_window_layers is not None and "layer_types" not in written:
        refuse("sliding_window_layers", model.sliding_window_layers, "its window slides over "
               "every layer (Qwen's layer_types name the layers: model.architecture=qwen2)")
    if arch.moe is None:
        return name
    if not model.num_experts:
        refuse("num_experts", 0, "it is a mixture of experts; write a dense model as "
               "model.architecture=llama (or the dense family)")
    if model.router != "softmax":
        refuse("router", model.router, "its router is a softmax over the experts")
    if arch.shared_expert_gate and not (model.shared_experts and model.shared_expert_gate):
        refuse("shared_expert_gate", model.shared_expert_gate,
               "every layer has a shared expert scaled by a sigmoid gate (shared_experts >= 1 "
               "and shared_expert_gate=true)")
    if not arch.shared_expert_gate and model.shared_experts:
        refuse("shared_experts", model.shared_experts, "it has no shared experts")
    if arch.model_type == "mixtral":
        if model.first_k_dense:
            refuse("first_k_dense", model.first_k_dense, "every layer is a mixture of experts")
        if model.moe_ffn_hidden_size not in (0, model.ffn_hidden_size):
            refuse("moe_ffn_hidden_size", model.moe_ffn_hidden_size,
                   "its experts are as wide as intermediate_size (ffn_hidden_size)")
        if not router_renormalizes(model):
            refuse("router_renormalize", model.router_renormalize,
                   "its router always renormalises the top-k weights")
    return name


def _deepseek_class(model, name: str) -> str:
    v3 = ARCHITECTURES[name].deepseek == "v3"
    try:
        hf_deepseek.export_keys(model, v3)
    except hf_deepseek.DeepseekConfigError as exc:
        key = "attention" if model.attention != "mla" else "num_experts"
        raise HFConfigError(f"model.{key}={getattr(model, key)!r} cannot be written as a "
                            f"{name}: {exc}") from None
    refused = hf_deepseek.check_export(model, v3)
    if refused is not None:
        key, value, why = refused
        raise HFConfigError(f"model.{key}={value!r} cannot be written as a {name}: {why}")
    return name


def _rope_parameters(model) -> dict:
    s = model.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": model.rope_theta}
    if s.type == "linear":
        return {"rope_type": "linear", "rope_theta": model.rope_theta, "factor": s.factor}
    if s.type == "yarn":
        # What transformers' defaults already say is left out, as the imported configs have it.
        given = {**({} if s.attention_factor is None else {"attention_factor": s.attention_factor}),
                 **({} if s.truncate else {"truncate": False})}
        return {"rope_type": "yarn", "rope_theta": model.rope_theta, "factor": s.factor,
                "original_max_position_embeddings": s.original_max_positions,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                "mscale_all_dim": s.mscale_all_dim, **given}
    return {"rope_type": "llama3", "rope_theta": model.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_positions}


def export_config(model, base: dict | None, *, max_positions: int,
                  bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The config.json of our `model` (a ModelConfig). `base`: the config.json it was imported
    from, whose other settings (token ids, max_position_embeddings, ...) are kept."""
    name = export_class(model)
    arch = ARCHITECTURES[name]
    out = dict(base) if base and class_name(base) == name else {
        "architectures": [name], "model_type": arch.model_type, "hidden_act": "silu",
        "max_position_embeddings": max_positions, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True, "bos_token_id": bos_id,
        "eos_token_id": eos_id}
    for key in ("rope_scaling", "rope_parameters", "rope_theta", "layer_types", "dtype",
                "torch_dtype", "transformers_version", "_name_or_path"):
        out.pop(key, None)
    rope = _rope_parameters(model)
    out.update({
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "vocab_size": model.vocab_size, "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings, "rope_parameters": rope,
        "dtype": "float32",
    })
    out.update(arch.export_keys(model))
    if arch.deepseek is not None:
        out.update(hf_deepseek.export_keys(model, arch.deepseek == "v3"))
        if model.balance == "aux_free_and_aux_loss":  # DeepSeek's own keys for it
            out.update(aux_loss_alpha=model.aux_loss_coeff, seq_aux=True)
    if arch.moe_export is not None:
        had = set(out)
        out.update(arch.moe_export(model))
        if "num_local_experts" in had and "num_experts" not in had and "num_experts" in out:
            # transformers 5 writes Qwen-MoE's count under Mixtral's name: keep the file's key
            out["num_local_experts"] = out.pop("num_experts")
        out.update(balance_export(model, base or {}))
    return out
