"""Parameter counts, once: the whole model, one layer on one rank, one pipeline stage on one rank.

`ModelConfig.num_params` (MFU, reports), the memory estimator (bytes per rank) and the planner's
cost model (gradient, optimizer and ZeRO traffic) all count here. Exact for `models.llama.Llama`:
q, k, v, o projections, a SwiGLU MLP (or routed experts, shared experts and a router), two RMSNorm
weights per block, a final norm, the embedding and an output head unless tied.

`model` is anything with `ModelConfig`'s field names; `ModelShape` is the hashable one that the
estimator's caches key on. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrascale.rules import kv_heads_split


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 0
    experts_top_k: int = 0
    shared_experts: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def model_shape(model) -> ModelShape:
    """The shape of a `ModelConfig` (or anything with its field names) as a hashable key."""
    if isinstance(model, ModelShape):
        return model
    return ModelShape(model.hidden_size, model.num_layers, model.num_heads,
                      model.num_kv_heads or model.num_heads, model.ffn_hidden_size,
                      model.vocab_size, bool(model.tie_embeddings), model.num_experts,
                      model.experts_top_k, model.shared_experts)


def num_params(model, include_embedding: bool = True) -> int:
    """Parameters of the whole model (`include_embedding`: the embedding and an untied head)."""
    dense, expert = layer_params(model)
    h = model.hidden_size
    emb = model.vocab_size * h * (1 if model.tie_embeddings else 2) if include_embedding else 0
    return model.num_layers * (dense + expert) + h + emb  # + the final norm


def layer_params(model, tp: int = 1, ep: int = 1, whole_kv: bool = False) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank of tp x ep."""
    h, f, hd = model.hidden_size, model.ffn_hidden_size, model.head_dim
    kv_heads = model.num_kv_heads or model.num_heads
    if kv_heads_split(kv_heads, tp):
        kv = kv_heads // tp * hd
    else:
        # tp exceeds (or does not divide) the kv heads: each rank keeps the kv head its query
        # heads use (Megatron) or all of them (ours).
        kv = kv_heads * hd if whole_kv else max(kv_heads // tp, 1) * hd
    q = model.num_heads // tp * hd
    attn = h * q * 2 + h * kv * 2
    norms = 2 * h
    experts = model.num_experts
    if not experts:
        return attn + 3 * h * f // tp + norms, 0
    routed = (experts // ep) * 3 * h * f // tp
    dense = attn + norms + model.shared_experts * 3 * h * f // tp + h * experts  # router replicated
    return dense, routed


def stage_params(model, layout, layers: int, stage: int,
                 whole_kv: bool = False) -> tuple[int, int, int]:
    """(dense params, expert params, params of one layer incl. experts) on a rank of pipeline
    stage `stage` holding `layers` layers."""
    dense, expert = layer_params(model, layout.tp, layout.ep, whole_kv)
    h = model.hidden_size
    d = layers * dense
    emb = -(-model.vocab_size // layout.tp) * h  # the vocabulary padded to a multiple of tp
    if stage == 0:
        d += emb
    if stage == layout.pp - 1:
        d += h  # final norm
        # The output head: its own matrix, or a copy of the tied embedding on another stage.
        if not model.tie_embeddings or layout.pp > 1:
            d += emb
    return d, layers * expert, dense + expert
