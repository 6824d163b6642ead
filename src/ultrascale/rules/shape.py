"""The model's own shape, whoever runs it: every size set, whole heads, grouped-query attention,
rotary, multi-head latent attention's keys, a mixture of experts' keys and its router groups; and
whether tensor parallel splits the kv heads."""

from __future__ import annotations

from ultrascale.rules.violation import Violation, divisors


def model_violations(model) -> list[Violation]:
    """The model's own shape: every size set, whole heads, grouped-query attention, rotary."""
    out = []
    for key in ("hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "vocab_size"):
        if getattr(model, key) <= 0:
            out.append(Violation(f"model.{key}", getattr(model, key), f"model.{key} is not set",
                                 "Give it a positive value, or choose a model.preset"))
    if out:
        return out
    h, heads = model.hidden_size, model.num_heads
    kv = model.num_kv_heads or heads
    head_dim = getattr(model, "head_dim", 0) or 0
    if h % heads and not head_dim:  # (a model may give head_dim: Qwen3, Mistral Nemo)
        out.append(Violation("model.num_heads", heads,
                             f"model.hidden_size={h} is not divisible by model.num_heads={heads}",
                             f"Choose num_heads among {divisors(h)[:12]}..., or give "
                             "model.head_dim"))
        return out
    head_dim = head_dim or h // heads
    mla = getattr(model, "attention", "mha") == "mla"
    out += latent_attention_violations(model)
    if heads % kv:
        out.append(Violation(
            "model.num_kv_heads", kv,
            f"model.num_kv_heads={kv} does not divide model.num_heads={heads} (grouped-query "
            "attention shares each kv head among a whole number of query heads)",
            f"Choose num_kv_heads among {divisors(heads)}"))
    if head_dim % 2 and not mla:  # (MLA rotates its own qk_rope_head_dim)
        derived = head_dim * heads == h
        out.append(Violation("model.hidden_size" if derived else "model.head_dim",
                             h if derived else head_dim,
                             f"the head dimension {head_dim} (model.hidden_size/num_heads="
                             f"{h}/{heads}) is odd; rotary embeddings need an even head dimension"
                             if derived else f"model.head_dim={head_dim} is odd; rotary "
                             "embeddings need an even head dimension",
                             "Change hidden_size or num_heads" if derived else "Change head_dim"))
    out += window_violations(model)
    if model.num_experts:
        out += expert_violations(model)
    elif getattr(model, "router_groups", 1) > 1:
        out.append(Violation("model.router_groups", model.router_groups,
                             f"model.router_groups={model.router_groups} groups the experts, but "
                             "model.num_experts=0", "Set router_groups=1 for a dense model"))
    return out


def window_violations(model) -> list[Violation]:
    """`sliding_window_layers` names layers of the model, each once, and a window to slide."""
    layers = getattr(model, "sliding_window_layers", None)
    if layers is None:
        return []
    if getattr(model, "sliding_window", None) is None:
        return [Violation("model.sliding_window_layers", layers, "model.sliding_window_layers "
                          "lists the layers a window slides over, and model.sliding_window is "
                          "not set", "Set model.sliding_window, or leave the layers out")]
    bad = [i for i in layers if not 0 <= i < model.num_layers]
    if bad or len(set(layers)) != len(layers):
        return [Violation("model.sliding_window_layers", layers,
                          f"model.sliding_window_layers must name layers 0..{model.num_layers - 1}"
                          " once each" + (f" ({bad} are not)" if bad else " (some repeat)"),
                          "List each windowed layer once")]
    return []


_MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def latent_attention_violations(model) -> list[Violation]:
    """Multi-head latent attention's own keys (models/mla.py): a key-value latent, an even
    rotary part, values; none of them (nor the interleaved rotary layout) without MLA."""
    if getattr(model, "attention", "mha") != "mla":
        given = [k for k in _MLA_DIMS + ("rope_interleave",) if getattr(model, k, 0)]
        if given:
            return [Violation(f"model.{given[0]}", getattr(model, given[0]),
                              f"model.{given[0]} applies to multi-head latent attention, and "
                              "model.attention=mha", "Set model.attention=mla, or leave "
                              f"{given[0]} out")]
        return []
    out = []
    for key, least in (("kv_lora_rank", 1), ("qk_rope_head_dim", 2), ("v_head_dim", 1)):
        if getattr(model, key) < least:
            out.append(Violation(f"model.{key}", getattr(model, key),
                                 f"model.attention=mla needs model.{key} >= {least}",
                                 "Give it (DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64, "
                                 "qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536)"))
    if model.qk_rope_head_dim % 2:
        out.append(Violation("model.qk_rope_head_dim", model.qk_rope_head_dim,
                             f"model.qk_rope_head_dim={model.qk_rope_head_dim} is odd; rotary "
                             "embeddings turn pairs of dimensions", "Choose an even value"))
    for key, what in (("attention_bias", "biases on MLA's projections"),
                      ("qk_norm", "per-head q/k norms in MLA")):
        if getattr(model, key, False):
            out.append(Violation(f"model.{key}", True, f"{what} are not implemented",
                                 f"Set model.{key}=false"))
    return out


def expert_violations(model) -> list[Violation]:
    """A mixture of experts' own keys: top-k within the experts, dense layers within the model."""
    out, experts, top_k = [], model.num_experts, model.experts_top_k
    if not 1 <= top_k <= experts:
        out.append(Violation("model.experts_top_k", top_k,
                             f"model.experts_top_k={top_k} must be between 1 and "
                             f"model.num_experts={experts} (each token goes to top_k different "
                             "experts)",
                             f"Set experts_top_k to at most {experts} (2 is common), or raise "
                             "num_experts"))
    first_k = getattr(model, "first_k_dense", 0)
    if first_k > model.num_layers:
        out.append(Violation("model.first_k_dense", first_k,
                             f"model.first_k_dense={first_k} exceeds model.num_layers="
                             f"{model.num_layers}",
                             f"Choose first_k_dense between 0 and {model.num_layers}"))
    out += router_group_violations(model)
    if getattr(model, "shared_expert_gate", False) and not model.shared_experts:
        out.append(Violation("model.shared_expert_gate", True,
                             "model.shared_expert_gate=true gates the shared experts' output, "
                             "but model.shared_experts=0",
                             "Set shared_experts >= 1, or shared_expert_gate=false"))
    return out


def router_group_violations(model) -> list[Violation]:
    """Group-limited routing: whole groups of experts, at most as many kept as there are, and
    enough experts in the kept groups for the top-k."""
    groups = getattr(model, "router_groups", 1)
    kept = getattr(model, "router_topk_groups", None) or groups
    experts, top_k = model.num_experts, model.experts_top_k
    if experts % groups:
        fits = [g for g in divisors(experts)]
        return [Violation("model.router_groups", groups,
                          f"model.router_groups={groups} does not divide model.num_experts="
                          f"{experts} (the experts form equal groups)",
                          f"Choose router_groups among {fits}")]
    if kept > groups:
        return [Violation("model.router_topk_groups", kept,
                          f"model.router_topk_groups={kept} exceeds model.router_groups={groups}",
                          f"Choose router_topk_groups between 1 and {groups}")]
    if top_k > kept * (experts // groups):
        return [Violation("model.experts_top_k", top_k,
                          f"model.experts_top_k={top_k} exceeds the {kept * (experts // groups)} "
                          f"experts of the router_topk_groups={kept} groups a token keeps",
                          "Raise router_topk_groups, or lower experts_top_k")]
    return []


def kv_heads_split(num_kv_heads: int, tp: int) -> bool:
    """Whether tensor parallel splits the kv heads (tp divides them: each rank gets
    num_kv_heads / tp). Otherwise every rank keeps them all (ours) or the one its query heads use
    (Megatron): tp then only has to divide the query heads."""
    return num_kv_heads % tp == 0
