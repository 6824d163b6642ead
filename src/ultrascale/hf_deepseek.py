"""Hugging Face's DeepseekV3ForCausalLM and DeepseekV2ForCausalLM: their config keys and tensor
names, for hf_arch.py's table (torch-free and package-free, as hf_arch is).

- Attention: multi-head latent attention (models/mla.py) with the same parameter names; the
  rotary dimensions are interleaved (V3's `rope_interleave`, V2's complex rotation); YaRN scaling.
- Experts: `n_routed_experts` of `moe_intermediate_size` (one tensor per expert in the files),
  `n_shared_experts` as shared experts of that width, the first `first_k_dense_replace` layers
  dense. V3: sigmoid scores, group-limited routing (`n_group`, `topk_group`), the
  auxiliary-loss-free bias (`e_score_correction_bias`: our `expert_bias`, imported and exported),
  `norm_topk_prob`, `routed_scaling_factor`. V2: softmax scores, never renormalised (as
  transformers computes them), `routed_scaling_factor`; its group-limited routing (groups scored
  by their best expert) is refused.
- Multi-token prediction (V3): DeepSeek's checkpoints hold module k as layer num_layers + k:
  `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a decoder layer's tensors, and copies of the
  embedding and of the head (`embed_tokens`, `shared_head.head`). transformers does not run them
  (its config still says `num_nextn_predict_layers`); import reads them when the files hold them,
  export writes them (the copies included).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a_proj_with_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.experts.gate_proj": "mlp.experts.{j}.gate_proj.weight",
    "mlp.experts.up_proj": "mlp.experts.{j}.up_proj.weight",
    "mlp.experts.down_proj": "mlp.experts.{j}.down_proj.weight",
    "mlp.shared_experts.gate_proj.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.down_proj.weight",
}


def names(bias: bool) -> dict[str, str]:
    """Our names -> theirs (hf_arch's table form); `bias`: V3's expert bias has a tensor."""
    table = {f"layers.{{i}}.{ours}": f"model.layers.{{i}}.{theirs}"
             for ours, theirs in _LAYER.items()}
    if bias:
        table["layers.{i}.mlp.gate.expert_bias"] = "model.layers.{i}.mlp.gate.e_score_correction_bias"
    return {"embed.weight": "model.embed_tokens.weight", **table,
            "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


# MTP module k's own tensors, at layer num_layers + k (besides its decoder layer's).
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
# What DeepSeek's checkpoints copy into each MTP layer: of our embedding and of our head.
MTP_COPIES = {"embed.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}


def mtp_name(rest: str, layer: int, layer_name) -> str:
    """The Hugging Face name of our `mtp.<k>.<rest>` at layer `layer` (num_layers + k);
    `layer_name(ours)` maps a decoder layer's name. KeyError: no such tensor."""
    if rest in _MTP_OWN:
        return f"model.layers.{layer}.{_MTP_OWN[rest]}"
    if rest.startswith("block."):
        return layer_name(f"layers.{layer}.{rest[len('block.'):]}")
    raise KeyError(rest)


class DeepseekConfigError(ValueError):
    """A DeepSeek config.json setting our model cannot honour (hf_arch names the file)."""


REQUIRED = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def missing_keys(hf: dict) -> list[str]:
    """The keys a DeepSeek config.json must give (transformers writes them all)."""
    return [k for k in REQUIRED if hf.get(k) is None]


def attention_keys(hf: dict) -> dict:
    """Our multi-head latent attention keys."""
    return {"attention": "mla", "q_lora_rank": int(hf.get("q_lora_rank") or 0),
            "kv_lora_rank": int(hf["kv_lora_rank"]),
            "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
            "qk_nope_head_dim": int(hf["qk_nope_head_dim"]), "v_head_dim": int(hf["v_head_dim"]),
            # V3's `rope_interleave` (default true); V2 always rotates interleaved pairs.
            "rope_interleave": bool(hf.get("rope_interleave", True))}


def moe_keys(hf: dict, num_layers: int, v3: bool, mtp_in_weights: bool | None) -> dict:
    """Our mixture-of-experts (and multi-token prediction) keys. `mtp_in_weights`: whether the
    folder's weights hold the MTP modules (None: no weights, the config says)."""
    if int(hf.get("moe_layer_freq", 1) or 1) != 1:
        raise DeepseekConfigError(f"sets moe_layer_freq={hf['moe_layer_freq']}: only the first "
                                  "layers can keep the dense MLP here (model.first_k_dense)")
    groups = int(hf.get("n_group") or 1)
    keys = {"num_experts": int(hf["n_routed_experts"]),
            "experts_top_k": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "shared_experts": int(hf.get("n_shared_experts") or 0), "shared_expert_gate": False,
            "first_k_dense": min(int(hf.get("first_k_dense_replace") or 0), num_layers),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
            "router_groups": 1, "router_topk_groups": None, "capacity_factor": None}
    if v3:
        alpha = float(hf.get("aux_loss_alpha") or 0.0)
        keys.update(router="sigmoid", router_renormalize=bool(hf.get("norm_topk_prob", True)),
                    router_groups=groups, router_topk_groups=int(hf.get("topk_group") or groups),
                    balance="aux_free_and_aux_loss" if alpha and hf.get("seq_aux") else
                    "aux_free", mtp_layers=_mtp_layers(hf, mtp_in_weights))
        if alpha and hf.get("seq_aux"):
            keys["aux_loss_coeff"] = alpha
        return keys
    if hf.get("topk_method", "greedy") != "greedy":
        raise DeepseekConfigError(f"sets topk_method={hf['topk_method']!r}: DeepSeek-V2's "
                                  "group-limited routing (groups scored by their best expert) is "
                                  "not implemented; only 'greedy' is")
    keys.update(router="softmax", router_renormalize=False, balance="none", mtp_layers=0)
    return keys


def _mtp_layers(hf: dict, in_weights: bool | None) -> int:
    said = int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
    return said if in_weights is None or in_weights else 0


def export_keys(m, v3: bool) -> dict:
    """config.json keys of our `m` (a ModelConfig) as DeepSeek's class; ValueError naming the key
    of a feature it has no place for."""
    if m.attention != "mla" or not m.num_experts:
        raise DeepseekConfigError("it has multi-head latent attention and a mixture of experts")
    if m.shared_expert_gate:
        raise DeepseekConfigError("its shared experts are not gated")
    out = {"q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
           "qk_rope_head_dim": m.qk_rope_head_dim, "qk_nope_head_dim": m.qk_nope_head_dim,
           "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
           "num_key_value_heads": m.num_heads, "n_routed_experts": m.num_experts,
           "num_experts_per_tok": m.experts_top_k, "moe_intermediate_size":
           m.expert_ffn_hidden_size, "n_shared_experts": m.shared_experts,
           "first_k_dense_replace": m.first_k_dense,
           "routed_scaling_factor": m.routed_scaling_factor, "attention_bias": False}
    if v3:
        out.update(rope_interleave=m.rope_interleave, n_group=m.router_groups,
                   topk_group=m.router_topk_groups or m.router_groups,
                   norm_topk_prob=_renormalizes(m), num_nextn_predict_layers=m.mtp_layers)
    else:
        out.update(topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False)
    return out


def _renormalizes(m) -> bool:
    return m.router_renormalize if m.router_renormalize is not None else \
        (m.router == "sigmoid" or m.experts_top_k > 1)


def check_export(m, v3: bool) -> tuple[str, object, str] | None:
    """(key, value, why) of the first feature of `m` DeepSeek's class computes otherwise."""
    if m.sliding_window is not None:
        return "sliding_window", m.sliding_window, "its attention has no sliding window"
    if v3 and m.router != "sigmoid":
        return "router", m.router, "its router's scores are sigmoids"
    if not v3:
        if m.router != "softmax":
            return "router", m.router, "its router is a softmax over the experts"
        if _renormalizes(m):
            return "router_renormalize", True, "it never renormalises the top-k weights"
        if m.router_groups > 1:
            return "router_groups", m.router_groups, "its groups are scored by their best expert"
        if not m.rope_interleave:
            return "rope_interleave", False, "it rotates interleaved pairs"
        if m.mtp_layers:
            return "mtp_layers", m.mtp_layers, "it has no multi-token prediction"
    return None


def weight_names(folder: str | Path) -> list[str] | None:
    """The tensor names of a save_pretrained folder, from its index or its safetensors header
    (no tensor read); None when it holds no safetensors weights."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list((json.loads(index.read_text()).get("weight_map") or {}))
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    with single.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def mtp_in_weights(folder: str | Path, num_layers: int) -> bool | None:
    """Whether a folder's weights hold an MTP module (a layer past the last); None: no weights
    (a config alone)."""
    found = weight_names(folder) if Path(folder).is_dir() else None
    if found is None:
        return None
    return any(n.startswith(f"model.layers.{num_layers}.") for n in found)
