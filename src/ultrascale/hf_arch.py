"""Hugging Face decoder architectures: how each one's `config.json` and tensor names map onto ours.

One `Architecture` entry per supported class; adding an architecture is adding an entry (its
config keys, its features, its table of tensor names). Torch-free and package-free: the config
tree reads `model.from_hf` / `model.hf_config` with it before any process starts, `checkpoint/hf.py`
moves the tensors with its name tables, and the estimator and the planner read any decoder's shape.

What our plain model has that some architectures need (model.* keys): `attention_bias` (biases on
the q, k, v projections: Qwen2), `qk_norm` (an RMSNorm over each query and key head before the
rotation: Qwen3), `head_dim` (when it is not hidden_size / num_heads: Qwen3), `rope_scaling`
(Llama 3.1's "llama3" frequencies), `sliding_window` (Mistral, Qwen with use_sliding_window: exact
while the window covers the whole sequence; a shorter window is refused). What none of them has
here is refused by name: an output-projection or MLP bias, an activation other than SiLU, a rotary
over part of each head, other rope scalings, and mixture-of-experts classes (their import comes
with the experts issue).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

# Our parameter name -> the Hugging Face tensor name, `{i}` standing for the layer index. A row is
# used only when our model has that parameter (biases, q/k norms and an untied head are optional).
LLAMA_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.q_proj.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.attn.k_proj.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.attn.v_proj.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class HFConfigError(ValueError):
    """A Hugging Face config that cannot be used, said in one paragraph naming the file."""


def _flag(key: str, default=False) -> Callable[[dict], bool]:
    return lambda hf: bool(hf.get(key, default))


def _sliding(hf: dict) -> int | None:
    """Mistral's window, or Qwen's where use_sliding_window turns it on."""
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return None
    return hf.get("sliding_window")


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face class: its model_type, how its config sets our optional features, the
    config keys it writes on export, and its tensor names."""

    model_type: str
    attention_bias: Callable[[dict], bool] = lambda hf: False
    qk_norm: bool = False
    sliding_window: Callable[[dict], int | None] = lambda hf: None
    names: dict[str, str] = field(default_factory=lambda: LLAMA_NAMES)
    # config.json keys written on export besides the shape (the class's own conventions).
    export_keys: Callable[[object], dict] = lambda m: {}
    # Config keys our model cannot honour: key -> (value it must have, why).
    must: dict = field(default_factory=dict)


_LLAMA_MUST = {"attention_bias": (False, "a bias on the output projection too"),
               "mlp_bias": (False, "biases in the MLP")}

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", must=_LLAMA_MUST,
        export_keys=lambda m: {"attention_bias": False, "mlp_bias": False}),
    "MistralForCausalLM": Architecture(
        "mistral", sliding_window=_sliding,
        export_keys=lambda m: {"sliding_window": m.sliding_window}),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", attention_bias=lambda hf: True, sliding_window=_sliding,
        export_keys=lambda m: {"use_sliding_window": m.sliding_window is not None,
                               "sliding_window": m.sliding_window}),
    "Qwen3ForCausalLM": Architecture(
        "qwen3", attention_bias=_flag("attention_bias"), qk_norm=True, sliding_window=_sliding,
        export_keys=lambda m: {"attention_bias": m.attention_bias,
                               "use_sliding_window": m.sliding_window is not None,
                               "sliding_window": m.sliding_window}),
}
# Our `model.architecture` values: the model_type of each entry.
BY_TYPE = {a.model_type: name for name, a in ARCHITECTURES.items()}
# Mixture-of-experts classes: their import comes with the experts issue (a table of expert names).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "OlmoeForCausalLM")


def architecture(model_type: str) -> Architecture:
    return ARCHITECTURES[BY_TYPE[model_type]]


def hf_name(ours: str, model_type: str) -> str:
    """The Hugging Face name of one of our parameters (e.g. layers.3.attn.q_proj.weight)."""
    table = architecture(model_type).names
    parts = ours.split(".")
    if parts[0] == "layers":
        return table["layers.{i}." + ".".join(parts[2:])].replace("{i}", parts[1])
    return table[ours]


# ---------------------------------------------------------------------------------------------
# Reading a config.json


def config_path(path: str | Path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


@lru_cache(maxsize=16)
def _read(path: str, mtime: float) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFConfigError(f"{path!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path!r} must hold a JSON object of model settings.")
    return cfg


def read_config(path: str | Path) -> dict:
    """The decoder's settings in a config.json (or the folder holding one)."""
    p = config_path(path)
    if not p.is_file():
        raise HFConfigError(f"Hugging Face config {str(p)!r} does not exist. Give a folder "
                            "written by save_pretrained (config.json and safetensors), or the "
                            "path of a config.json.")
    cfg = _read(str(p), p.stat().st_mtime)
    return cfg.get("text_config", cfg)  # multimodal wrappers keep the decoder under text_config


def class_name(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if archs:
        return archs[0]
    return BY_TYPE.get(hf.get("model_type", ""), hf.get("model_type") or "an unnamed model")


def _first(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, our rope_scaling or None) from transformers 5's `rope_parameters` or the older
    `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(_first(hf, "rope_theta", default=None) or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFConfigError(f"rope scaling {kind!r} is not implemented (only Llama 3.1's "
                            "'llama3' frequencies are)")
    return theta, {"type": "llama3", "factor": float(scaling["factor"]),
                   "low_freq_factor": float(scaling["low_freq_factor"]),
                   "high_freq_factor": float(scaling["high_freq_factor"]),
                   "original_max_positions": int(scaling["original_max_position_embeddings"])}


def model_keys(path: str | Path, strict: bool = True) -> dict:
    """Our model.* keys for the decoder in a config.json. strict (training, import, export): the
    architecture must be one of ARCHITECTURES and every feature one our model computes exactly;
    otherwise (the estimator, the planner) any decoder's shape, experts included."""
    where = str(config_path(path))
    hf = read_config(path)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if hf.get(k) is None]
    if missing:
        raise HFConfigError(f"{where!r} lacks {', '.join(missing)}: it does not look like the "
                            "config.json of a decoder-only transformer.")
    name = class_name(hf)
    arch = ARCHITECTURES.get(name)
    if strict:
        _check_supported(hf, name, arch, where)
    heads = int(hf["num_attention_heads"])
    keys = dict(
        preset=None, hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(_first(hf, "num_key_value_heads", default=heads)),
        ffn_hidden_size=int(_first(hf, "intermediate_size", "ffn_hidden_size", default=0)),
        vocab_size=int(hf["vocab_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(_first(hf, "rms_norm_eps", "layer_norm_eps", default=1e-5)),
    )
    head_dim = hf.get("head_dim")
    if head_dim and int(head_dim) * heads != keys["hidden_size"]:
        keys["head_dim"] = int(head_dim)
    try:
        keys["rope_theta"], scaling = _rope(hf)
    except HFConfigError as exc:
        if strict:
            raise HFConfigError(f"{where!r} ({name}): {exc}.") from None
        keys["rope_theta"], scaling = float(_first(hf, "rope_theta", default=10000.0)), None
    if scaling:
        keys["rope_scaling"] = scaling
    if arch is not None:
        keys["architecture"] = arch.model_type
        keys["attention_bias"] = arch.attention_bias(hf)
        keys["qk_norm"] = arch.qk_norm
        window = arch.sliding_window(hf)
        if window is not None:
            keys["sliding_window"] = int(window)
    if not strict:
        keys.update(_experts(hf, keys["ffn_hidden_size"]))
    return keys


def _check_supported(hf: dict, name: str, arch: Architecture | None, where: str) -> None:
    if name in MOE_ARCHITECTURES:
        raise HFConfigError(
            f"{where!r} is a {name}, a mixture-of-experts model: importing experts is not "
            "supported yet (it comes with the experts issue). Supported: "
            f"{', '.join(ARCHITECTURES)}.")
    if arch is None:
        raise HFConfigError(f"{where!r} is a {name}, which ultrascale cannot import or train: "
                            f"supported architectures are {', '.join(ARCHITECTURES)}.")
    for key, (value, why) in arch.must.items():
        if hf.get(key, value) != value:
            raise HFConfigError(f"{where!r} ({name}) sets {key}={hf[key]!r}: {why} is not "
                                "implemented in ultrascale's model.")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"{where!r} ({name}) sets hidden_act={act!r}: ultrascale's MLP is "
                            "SwiGLU (silu) only.")
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFConfigError(f"{where!r} ({name}) sets partial_rotary_factor={partial}: rotary "
                            "embeddings over part of each head are not implemented.")


def _experts(hf: dict, ffn: int) -> dict:
    experts = int(_first(hf, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    if not experts:
        return {}
    # MoE configs give the expert width separately when it differs from the dense MLP's
    # (Qwen-MoE, DeepSeek), whose width the first dense layers keep (DeepSeek).
    moe_ffn = int(_first(hf, "moe_intermediate_size", default=0))
    shared = int(_first(hf, "n_shared_experts", "num_shared_experts", default=0))
    if not shared and hf.get("shared_expert_intermediate_size"):
        shared = max(1, round(hf["shared_expert_intermediate_size"] / (moe_ffn or ffn)))
    return {"num_experts": experts, "shared_experts": shared, "moe_ffn_hidden_size": moe_ffn,
            "experts_top_k": int(_first(hf, "num_experts_per_tok", "moe_topk", default=0)),
            "first_k_dense": int(_first(hf, "first_k_dense_replace", default=0)),
            "router": "sigmoid" if hf.get("scoring_func") == "sigmoid" else "softmax"}


def model_label(path: str | Path) -> str:
    """What to call the model of a config.json: its own name where it records one (the folder it
    was saved from, `_name_or_path`), else its folder, with its class."""
    p = config_path(path)
    hf = read_config(path)
    own = hf.get("_name_or_path") or p.parent.name or p.stem
    return f"{Path(own).name} ({class_name(hf)})"


# ---------------------------------------------------------------------------------------------
# Writing a config.json (export)


def export_config(model, base: dict | None, *, max_positions: int,
                  bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The config.json of our `model` (a ModelConfig). `base`: the config.json it was imported
    from, whose other settings (token ids, max_position_embeddings, ...) are kept."""
    name = BY_TYPE[model.architecture]
    arch = ARCHITECTURES[name]
    out = dict(base) if base and class_name(base) == name else {
        "architectures": [name], "model_type": arch.model_type, "hidden_act": "silu",
        "max_position_embeddings": max_positions, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True, "bos_token_id": bos_id,
        "eos_token_id": eos_id}
    for key in ("rope_scaling", "rope_parameters", "rope_theta", "layer_types", "dtype",
                "torch_dtype", "transformers_version", "_name_or_path"):
        out.pop(key, None)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        s = model.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": model.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_positions}
    out.update({
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim,
        "vocab_size": model.vocab_size, "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings, "rope_parameters": rope,
        "dtype": "float32",
    })
    out.update(arch.export_keys(model))
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizers


def tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json of data.tokenizer (a file, or a model folder holding one), or None."""
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    return p if p.is_file() else None


@lru_cache(maxsize=8)
def _vocab_size(path: str, mtime: float) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def tokenizer_vocab_size(spec: str) -> int | None:
    """Tokens of a local Hugging Face tokenizer (None for `byte` or a path that is not one)."""
    if spec == "byte":
        return None
    p = tokenizer_file(spec)
    if p is None:
        return None
    try:
        return _vocab_size(str(p), p.stat().st_mtime)
    except Exception:  # unreadable: the preflight check says why, with the path
        return None
