"""Hugging Face decoder architectures: how each one's `config.json` and tensor names map onto ours.

One `Architecture` entry per supported class; adding an architecture is adding an entry (its
config keys, its features, its table of tensor names). Torch-free and package-free: the config
tree reads `model.from_hf` / `model.hf_config` with it before any process starts, `checkpoint/hf.py`
moves the tensors with its name tables, and the estimator and the planner read any decoder's shape.

What our plain model has that some architectures need (model.* keys): `attention_bias` (biases on
the q, k, v projections: Qwen2), `qk_norm` (an RMSNorm over each query and key head before the
rotation: Qwen3), `head_dim` (when it is not hidden_size / num_heads: Qwen3), `rope_scaling`
(Llama 3.1's "llama3" frequencies), `sliding_window` and `sliding_window_layers` (Mistral, Qwen
with use_sliding_window: hf_window.py). Mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE) map onto models/moe.py: the per-expert tensors of a file (`{j}` in
a name) are stacked into our `[E, out, in]` weights, `router_renormalize` follows Mixtral (always)
or Qwen's `norm_topk_prob`, Qwen's dense layers are `first_k_dense`, Qwen2-MoE's gated shared
expert is `shared_experts` with `shared_expert_gate`. DeepSeek-V3 and V2 (multi-head latent
attention, group-limited routing, multi-token prediction) have their keys and names in
hf_deepseek.py; writing a config.json is hf_export.py's. What none of them has here is refused by
name: an output-projection or MLP bias, an activation other than SiLU, a rotary over part of each
head, rope scalings other than linear, llama3 and YaRN (dynamic NTK's frequencies change with
each batch's length), router jitter noise, dense layers other than the first ones, and the
mixture-of-experts classes of UNSUPPORTED_MOE (with their reason).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from ultrascale import hf_deepseek
from ultrascale.hf_window import qwen_window, sliding, window_layers

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
# Mixtures of experts. `{j}` is the expert: our stacked [E, out, in] weight is E tensors there.
_ATTENTION_NAMES = {k: v for k, v in LLAMA_NAMES.items() if ".mlp." not in k}
QWEN_MOE_NAMES: dict[str, str] = {
    **LLAMA_NAMES,  # the dense layers (mlp_only_layers) keep the dense MLP's names
    "layers.{i}.mlp.gate.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.mlp.experts.gate_proj": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
    "layers.{i}.mlp.experts.up_proj": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
    "layers.{i}.mlp.experts.down_proj": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
}
QWEN2_MOE_NAMES: dict[str, str] = {
    **QWEN_MOE_NAMES,
    "layers.{i}.mlp.shared_experts.gate_proj.weight":
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "layers.{i}.mlp.shared_experts.up_proj.weight":
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "layers.{i}.mlp.shared_experts.down_proj.weight":
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "layers.{i}.mlp.shared_expert_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
MIXTRAL_NAMES: dict[str, str] = {
    **_ATTENTION_NAMES,
    "layers.{i}.mlp.gate.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers.{i}.mlp.experts.gate_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
    "layers.{i}.mlp.experts.down_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight",
    "layers.{i}.mlp.experts.up_proj": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
}
# Ours alone: the auxiliary-loss-free expert bias (no Mixtral or Qwen tensor holds it). Import
# leaves it at zero; export refuses a non-zero one unless told to drop it (checkpoint/hf.py).
OURS_ONLY_SUFFIXES = (".gate.expert_bias",)


class HFConfigError(ValueError):
    """A Hugging Face config that cannot be used, said in one paragraph naming the file."""


def _flag(key: str, default=False) -> Callable[[dict], bool]:
    return lambda hf: bool(hf.get(key, default))


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
    # Mixtures of experts: our expert keys from the config, exactly (HFConfigError for a feature
    # our model lacks), and the checks and keys of an export.
    moe: Callable[[dict, int], dict] | None = None
    moe_export: Callable[[object], dict] | None = None
    # A dense family's mixture-of-experts class: what a run of it with experts exports as.
    with_experts: str | None = None
    # Every MoE layer has a shared expert scaled by a sigmoid gate (Qwen2-MoE); none elsewhere.
    shared_expert_gate: bool = False
    # Biases on q, k, v on export: "never", "always" (Qwen2), "key" (a config key says).
    qkv_bias: str = "never"
    # DeepSeek's classes (hf_deepseek.py): "v3" or "v2"; their attention is MLA.
    deepseek: str | None = None


_LLAMA_MUST = {"attention_bias": (False, "a bias on the output projection too"),
               "mlp_bias": (False, "biases in the MLP")}


# ---------------------------------------------------------------------------------------------
# Mixtures of experts: the config's expert keys, read exactly, and written back on export


def _balance(hf: dict, top_k: int, moe_layers: int) -> dict:
    """Transformers adds `router_aux_loss_coef` x its load-balancing loss only when
    `output_router_logits` is set; its loss pools all layers and the whole batch (E x sum_i f_i
    P_i, f_i and P_i averaged over the MoE layers' tokens), ours is per layer and per sequence
    (sum_i f_i P_i with f_i in units of k / E, summed over layers). The coefficient is mapped so
    that each layer's term weighs the same near balance: ours = theirs x k / (MoE layers)."""
    coef = float(hf.get("router_aux_loss_coef", 0.001) or 0.0)
    return {"router": "softmax",
            "balance": "aux_loss" if hf.get("output_router_logits") else "none",
            "aux_loss_coeff": coef * top_k / max(moe_layers, 1)}


def balance_export(m, base: dict) -> dict:
    moe_layers = max(m.num_layers - m.first_k_dense, 1)
    coef = m.aux_loss_coeff * moe_layers / m.experts_top_k
    kept = base.get("router_aux_loss_coef")
    if isinstance(kept, (int, float)) and math.isclose(kept * m.experts_top_k / moe_layers,
                                                       m.aux_loss_coeff, rel_tol=1e-12):
        coef = kept  # the imported value, not its round trip through our units
    return {"output_router_logits": m.balance == "aux_loss", "router_aux_loss_coef": coef}


def _mixtral_moe(hf: dict, num_layers: int) -> dict:
    jitter = hf.get("router_jitter_noise") or 0.0
    if jitter:
        raise HFConfigError(f"sets router_jitter_noise={jitter}: noise multiplied into the "
                            "router's input in training is not implemented (0.0 trains exactly)")
    top_k = int(hf.get("num_experts_per_tok", 2))
    return {"num_experts": int(_first(hf, "num_local_experts", "num_experts", default=8)),
            "experts_top_k": top_k, "moe_ffn_hidden_size": 0, "shared_experts": 0,
            "shared_expert_gate": False, "first_k_dense": 0, "router_renormalize": True,
            **_balance(hf, top_k, num_layers)}


def _dense_layers(hf: dict, num_layers: int) -> int:
    """Qwen-MoE's dense layers (mlp_only_layers, and all but every decoder_sparse_step-th) as
    our first_k_dense: only a run of first layers can be dense here."""
    step = int(hf.get("decoder_sparse_step") or 1)
    only = sorted(set(hf.get("mlp_only_layers") or []))
    dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise HFConfigError(f"sets mlp_only_layers={only} and decoder_sparse_step={step}: its "
                            f"dense layers are {dense}, but only the first layers of a model can "
                            "keep the dense MLP here (model.first_k_dense)")
    return len(dense)


def _qwen_moe(hf: dict, num_layers: int, shared: bool) -> dict:
    first_k = _dense_layers(hf, num_layers)
    top_k = int(hf.get("num_experts_per_tok", 8))
    width = int(hf.get("moe_intermediate_size", 0) or _first(hf, "intermediate_size"))
    keys = {"num_experts": int(_first(hf, "num_experts", "num_local_experts", default=60)),
            "experts_top_k": top_k, "moe_ffn_hidden_size": width, "first_k_dense": first_k,
            "router_renormalize": bool(hf.get("norm_topk_prob", False)),
            "shared_experts": 0, "shared_expert_gate": False,
            **_balance(hf, top_k, num_layers - first_k)}
    if shared:
        size = int(hf.get("shared_expert_intermediate_size") or 0)
        if size <= 0 or size % width:
            raise HFConfigError(f"sets shared_expert_intermediate_size={size}: the shared expert "
                                "is modelled as shared experts of the routed experts' width, so "
                                f"it must be a positive multiple of moe_intermediate_size={width}")
        keys.update(shared_experts=size // width, shared_expert_gate=True)
    return keys


def _mixtral_export(m) -> dict:
    return {"num_local_experts": m.num_experts, "intermediate_size": m.expert_ffn_hidden_size,
            "router_jitter_noise": 0.0, "num_experts_per_tok": m.experts_top_k}


def _qwen_moe_export(m, shared: bool) -> dict:
    out = {"num_experts": m.num_experts, "moe_intermediate_size": m.expert_ffn_hidden_size,
           "norm_topk_prob": router_renormalizes(m), "mlp_only_layers":
           list(range(m.first_k_dense)), "decoder_sparse_step": 1,
           "num_experts_per_tok": m.experts_top_k}
    if shared:
        out["shared_expert_intermediate_size"] = m.shared_experts * m.expert_ffn_hidden_size
    return out


def router_renormalizes(m) -> bool:
    """Whether our router renormalises the top-k weights (models/moe.py `Router`)."""
    if m.router_renormalize is not None:
        return m.router_renormalize
    return m.router == "sigmoid" or m.experts_top_k > 1


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", must=_LLAMA_MUST, with_experts="MixtralForCausalLM",
        export_keys=lambda m: {"attention_bias": False, "mlp_bias": False}),
    "MistralForCausalLM": Architecture(
        "mistral", sliding_window=sliding, with_experts="MixtralForCausalLM",
        export_keys=lambda m: {"sliding_window": m.sliding_window}),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", attention_bias=lambda hf: True, sliding_window=sliding, qkv_bias="always",
        with_experts="Qwen2MoeForCausalLM",
        export_keys=qwen_window),
    "Qwen3ForCausalLM": Architecture(
        "qwen3", attention_bias=_flag("attention_bias"), qk_norm=True, sliding_window=sliding,
        qkv_bias="key", with_experts="Qwen3MoeForCausalLM",
        export_keys=lambda m: {"attention_bias": m.attention_bias,
                               **qwen_window(m)}),
    "MixtralForCausalLM": Architecture(
        "mixtral", sliding_window=sliding, names=MIXTRAL_NAMES, moe=_mixtral_moe,
        moe_export=_mixtral_export,
        export_keys=lambda m: {"sliding_window": m.sliding_window}),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe", attention_bias=_flag("qkv_bias", True), sliding_window=sliding,
        names=QWEN2_MOE_NAMES, qkv_bias="key", shared_expert_gate=True,
        moe=lambda hf, n: _qwen_moe(hf, n, shared=True),
        moe_export=lambda m: _qwen_moe_export(m, shared=True),
        export_keys=lambda m: {"qkv_bias": m.attention_bias,
                               **qwen_window(m)}),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", attention_bias=_flag("attention_bias"), qk_norm=True,
        sliding_window=sliding, names=QWEN_MOE_NAMES, qkv_bias="key",
        moe=lambda hf, n: _qwen_moe(hf, n, shared=False),
        moe_export=lambda m: _qwen_moe_export(m, shared=False),
        export_keys=lambda m: {"attention_bias": m.attention_bias,
                               **qwen_window(m)}),
    hf_deepseek.V3: Architecture(
        "deepseek_v3", names=hf_deepseek.names(bias=True), deepseek="v3",
        must={"attention_bias": (False, "biases on the attention projections")}),
    hf_deepseek.V2: Architecture(
        "deepseek_v2", names=hf_deepseek.names(bias=False), deepseek="v2",
        must={"attention_bias": (False, "biases on the attention projections"),
              "mlp_bias": (False, "biases in the MLP")}),
}
# Our `model.architecture` values: the model_type of each entry.
BY_TYPE = {a.model_type: name for name, a in ARCHITECTURES.items()}
# Mixture-of-experts classes refused, and why (the others are in ARCHITECTURES).
UNSUPPORTED_MOE = {
    "OlmoeForCausalLM": "its q and k norms span the whole projection, not each head",
}


def architecture(model_type: str) -> Architecture:
    return ARCHITECTURES[BY_TYPE[model_type]]


def hf_name(ours: str, model_type: str, num_layers: int = 0) -> str:
    """The Hugging Face name of one of our parameters (e.g. layers.3.attn.q_proj.weight), with
    `{j}` standing for the expert where our stacked experts are one tensor per expert there.
    A multi-token prediction module's (mtp.<k>.*) is at layer num_layers + k (DeepSeek-V3).
    KeyError: the architecture has no place for it."""
    table = architecture(model_type).names
    parts = ours.split(".")
    if parts[0] == "layers":
        return table["layers.{i}." + ".".join(parts[2:])].replace("{i}", parts[1])
    if parts[0] == "mtp" and architecture(model_type).deepseek == "v3":
        return hf_deepseek.mtp_name(".".join(parts[2:]), num_layers + int(parts[1]),
                                    lambda name: hf_name(name, model_type))
    return table[ours]


def hf_names(ours: str, model_type: str, num_experts: int, num_layers: int = 0) -> list[str]:
    """The Hugging Face tensors holding one of our parameters: one, or one per expert (in
    order, stacked along our dim 0)."""
    name = hf_name(ours, model_type, num_layers)
    if "{j}" not in name:
        return [name]
    return [name.replace("{j}", str(j)) for j in range(num_experts)]


def ours_only(ours: str, model_type: str = "llama") -> bool:
    """A tensor of ours that the Hugging Face class has no place for (the expert bias, except
    in DeepSeek-V3's)."""
    if not ours.endswith(OURS_ONLY_SUFFIXES):
        return False
    try:
        hf_name(ours, model_type)
    except KeyError:
        return True
    return False


def mtp_copies(model) -> dict[str, list[str]]:
    """Our tensor -> the Hugging Face names of its copies in DeepSeek-V3's MTP layers (the
    embedding and the head, which each MTP layer repeats in DeepSeek's checkpoints)."""
    if not model.mtp_layers or architecture(model.architecture).deepseek != "v3":
        return {}
    head = "embed.weight" if model.tie_embeddings else "output.weight"
    out: dict[str, list[str]] = {}
    for k in range(model.mtp_layers):
        layer = model.num_layers + k
        for ours, theirs in (("embed.weight", "embed_tokens.weight"),
                             (head, "shared_head.head.weight")):
            out.setdefault(ours, []).append(f"model.layers.{layer}.{theirs}")
    return out


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
    if kind == "yarn":
        return theta, _yarn(hf, scaling)
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(scaling["factor"])}
    if kind != "llama3":
        raise HFConfigError(f"rope scaling {kind!r} is not implemented (only 'linear', Llama "
                            "3.1's 'llama3' frequencies and YaRN are)")
    return theta, {"type": "llama3", "factor": float(scaling["factor"]),
                   "low_freq_factor": float(scaling["low_freq_factor"]),
                   "high_freq_factor": float(scaling["high_freq_factor"]),
                   "original_max_positions": int(scaling["original_max_position_embeddings"])}


def _yarn(hf: dict, scaling: dict) -> dict:
    """Our YaRN keys, as transformers reads them (factor from the context extension where the
    config gives none)."""
    original = int(scaling.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings") or 0)
    factor = scaling.get("factor") or (hf.get("max_position_embeddings", 0) / max(original, 1))
    given = scaling.get("attention_factor")
    return {"type": "yarn", "factor": float(factor), "original_max_positions": original,
            "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1),
            "mscale": float(scaling.get("mscale") or 0), "mscale_all_dim":
            float(scaling.get("mscale_all_dim") or 0),
            "attention_factor": None if given is None else float(given),
            "truncate": bool(scaling.get("truncate", True))}


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
    mla = hf.get("kv_lora_rank") is not None  # (its head_dim is the rotary part's)
    if head_dim and int(head_dim) * heads != keys["hidden_size"] and not mla:
        keys["head_dim"] = int(head_dim)
    if mla:  # multi-head latent attention: one kv head per query head, whatever the file says
        keys.update(hf_deepseek.attention_keys(hf), num_kv_heads=heads)
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
            layers = window_layers(hf)
            if layers is not None:
                keys["sliding_window_layers"] = layers
    if arch is not None and arch.deepseek is not None:
        try:
            keys.update(hf_deepseek.moe_keys(hf, keys["num_layers"], arch.deepseek == "v3",
                                             hf_deepseek.mtp_in_weights(
                                                 config_path(path).parent, keys["num_layers"])))
        except hf_deepseek.DeepseekConfigError as exc:
            if strict:
                raise HFConfigError(f"{where!r} ({name}) {exc}.") from None
            keys.update(_experts(hf, keys["ffn_hidden_size"]))
    elif arch is not None and arch.moe is not None:
        try:
            keys.update(arch.moe(hf, keys["num_layers"]))
        except HFConfigError as exc:
            if strict:
                raise HFConfigError(f"{where!r} ({name}) {exc}.") from None
            keys.update(_experts(hf, keys["ffn_hidden_size"]))
    elif not strict:
        keys.update(_experts(hf, keys["ffn_hidden_size"]))
    return keys


def _check_supported(hf: dict, name: str, arch: Architecture | None, where: str) -> None:
    if name in UNSUPPORTED_MOE:
        raise HFConfigError(
            f"{where!r} is a {name}, a mixture-of-experts model ultrascale cannot import or "
            f"train: {UNSUPPORTED_MOE[name]}. Supported: {', '.join(ARCHITECTURES)}.")
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
    missing = hf_deepseek.missing_keys(hf) if arch.deepseek else []
    if missing:
        raise HFConfigError(f"{where!r} ({name}) lacks {', '.join(missing)}: its multi-head "
                            "latent attention and experts need them.")
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
    groups = int(hf.get("n_group") or 1)
    return {"num_experts": experts, "shared_experts": shared, "moe_ffn_hidden_size": moe_ffn,
            "experts_top_k": int(_first(hf, "num_experts_per_tok", "moe_topk", default=0)),
            "first_k_dense": int(_first(hf, "first_k_dense_replace", default=0)),
            "router": "sigmoid" if hf.get("scoring_func") == "sigmoid" else "softmax",
            # DeepSeek's group-limited routing and multi-token prediction, where given
            "router_groups": groups if experts % groups == 0 else 1,
            "router_topk_groups": int(hf.get("topk_group") or groups) if experts % groups == 0
            else None, "mtp_layers": int(hf.get("num_nextn_predict_layers") or 0)}


def model_label(path: str | Path) -> str:
    """What to call the model of a config.json: its own name where it records one (the folder it
    was saved from, `_name_or_path`), else its folder, with its class."""
    p = config_path(path)
    hf = read_config(path)
    own = hf.get("_name_or_path") or p.parent.name or p.stem
    return f"{Path(own).name} ({class_name(hf)})"


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
