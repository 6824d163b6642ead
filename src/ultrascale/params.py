"""Parameter counts, once: the whole model, one layer on one rank, one pipeline stage on one rank.

`ModelConfig.num_params` (MFU, reports), the memory estimator (bytes per rank) and the planner's
cost model (gradient, optimizer and ZeRO traffic) all count here. Exact for `models.llama.Llama`:
q, k, v, o projections (and q, k, v biases, per-head q/k norms where the model has them), a SwiGLU
MLP (or, past the first `first_k_dense` layers of a mixture of experts, routed experts and shared
experts of `moe_ffn_hidden_size` and a router), two RMSNorm weights per block, a final norm, the
embedding and an output head unless tied.

`model` is anything with `ModelConfig`'s field names (a `theory.shape.ModelShape`, the hashable
one the estimator's caches key on, or the config itself). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, wraps
from typing import Callable

from ultrascale.rules import kv_heads_split
from ultrascale.theory.shape import ModelShape, model_shape

NS_STEPS = 5  # Muon's Newton-Schulz iterations (optim/muon.py), for the planner's cost


def mla_dims(model) -> tuple[int, int, int, int, int]:
    """(kv_lora_rank, q_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim) of a model
    with multi-head latent attention (model.attention=mla); zeros otherwise (multi-head
    attention, or a shape that does not say: the estimator's, which plans MLA as MHA)."""
    if getattr(model, "attention", "mha") != "mla":
        return (0, 0, 0, 0, 0)
    return (model.kv_lora_rank, model.q_lora_rank, model.qk_rope_head_dim,
            model.qk_nope_head_dim, model.v_head_dim)


def expert_ffn(model) -> int:
    """The inner width of each expert (routed or shared)."""
    return getattr(model, "moe_ffn_hidden_size", 0) or model.ffn_hidden_size


def dense_layers(model) -> int:
    """Layers with the dense MLP: all of a dense model, the first `first_k_dense` of an MoE."""
    if not model.num_experts:
        return model.num_layers
    return min(getattr(model, "first_k_dense", 0), model.num_layers)


def dense_layers_in(model, first: int, count: int) -> int:
    """Dense-MLP layers among the `count` layers from global index `first`."""
    k = dense_layers(model)
    return max(0, min(first + count, k) - first)


def shared_gate(model) -> int:
    """1 where the shared experts' output is gated per token (one weight vector: Qwen2-MoE)."""
    return 1 if getattr(model, "shared_expert_gate", False) else 0


@dataclass(frozen=True)
class LayerParams:
    """The parameters of one whole transformer layer, by part: what the architecture holds,
    before any layout shards it."""

    q_o: int  # the query and output projections (and the query bias)
    kv: int  # the key and value projections (and their biases)
    mlp: int  # one SwiGLU MLP (gate, up, down): the dense MLP, or each expert
    router: int  # 0 for a dense model (and the shared experts' gate, where there is one)
    norms: int  # the two RMSNorm weights (and the per-head q/k norms)
    experts: int  # routed experts (0: dense)
    shared_experts: int
    # MLA's down-projections and latent norms, which tensor parallel replicates (its query
    # up-projection and output projection count in q_o, its key-value up-projection in kv).
    replicated: int = 0

    @property
    def total(self) -> int:
        mlps = self.experts + self.shared_experts if self.experts else 1
        return self.q_o + self.kv + self.mlp * mlps + self.router + self.norms + self.replicated


def once_per_shape(count: Callable) -> Callable:
    """`count(model, ...)` counted once for each `ModelShape` and arguments (a shape is hashable,
    and the same for every layout the planner ranks); a config is counted afresh each time."""
    cached = lru_cache(maxsize=1024)(count)

    @wraps(count)
    def counted(model, *args, **kwargs):
        if type(model) is ModelShape:
            return cached(model, *args, **kwargs)
        return count(model, *args, **kwargs)

    return counted


@once_per_shape
def layer_parts(model, moe: bool = True) -> LayerParams:
    """One layer's parameters: an MoE layer of an MoE model, or (moe=False, or a dense model) a
    layer with the dense MLP."""
    h, hd = model.hidden_size, model.head_dim
    kv_heads = model.num_kv_heads or model.num_heads
    experts = model.num_experts if moe else 0
    bias = 1 if getattr(model, "attention_bias", False) else 0
    q_o = (2 * h + bias) * model.num_heads * hd
    kv = 2 * (h + bias) * kv_heads * hd
    replicated = 0
    kv_rank, q_rank, rope, nope, v = mla_dims(model)
    if kv_rank:  # multi-head latent attention (models/mla.py)
        heads = model.num_heads
        q_o = heads * (nope + rope) * (q_rank or h) + heads * v * h
        kv = kv_rank * heads * (nope + v)
        replicated = h * (kv_rank + rope) + kv_rank + (h * q_rank + q_rank if q_rank else 0)
    return LayerParams(q_o=q_o, kv=kv,
                       mlp=3 * h * (expert_ffn(model) if experts else model.ffn_hidden_size),
                       router=h * (experts + shared_gate(model)) if experts else 0,
                       norms=2 * h + (2 * hd if getattr(model, "qk_norm", False) else 0),
                       experts=experts,
                       shared_experts=model.shared_experts if experts else 0,
                       replicated=replicated)


def mtp_layer_params(model) -> int:
    """One multi-token prediction module (models/mtp.py): its three norms, the projection of
    the embedding and the hidden state, and a block of the kind the layer after the last one
    would be (the embedding and the head are the model's own)."""
    h = model.hidden_size
    return 3 * h + 2 * h * h + layer_parts(model, moe=mtp_moe(model)).total


def mtp_rank_params(model, tp: int, ep: int, whole_kv: bool = False) -> tuple[int, int]:
    """(dense, expert) parameters of one multi-token prediction module on a rank: its three
    norms and the projection of the embedding and the hidden state (replicated over tp), and its
    block's share (`layer_params`)."""
    h = model.hidden_size
    block, experts = layer_params(model, tp, ep, whole_kv, moe=mtp_moe(model))
    return 3 * h + 2 * h * h + block, experts


def mtp_moe(model) -> bool:
    """Whether an MTP module's block is an MoE layer (the kind the layer after the last would
    be)."""
    return bool(model.num_experts) and model.num_layers >= getattr(model, "first_k_dense", 0)


def num_params(model, include_embedding: bool = True) -> int:
    """Parameters of the whole model (`include_embedding`: the embedding and an untied head)."""
    h = model.hidden_size
    emb = model.vocab_size * h * (1 if model.tie_embeddings else 2) if include_embedding else 0
    dense = dense_layers(model)
    layers = dense * layer_parts(model, moe=False).total
    layers += (model.num_layers - dense) * layer_parts(model).total
    mtp = getattr(model, "mtp_layers", 0) * mtp_layer_params(model)
    return layers + h + emb + mtp  # + the final norm


def active_params(model) -> int:
    """Parameters that work on each token, the embedding left out: every dense weight, and of
    each MoE layer the router, the shared experts and top-k of the routed experts."""
    idle = 0
    if model.num_experts:
        part = layer_parts(model)
        moe_layers = model.num_layers - dense_layers(model) + getattr(model, "mtp_layers", 0)
        idle = moe_layers * part.mlp * (model.num_experts - model.experts_top_k)
    return num_params(model, include_embedding=False) - idle


@once_per_shape
def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12 L h s (forward + backward, attention scores included).

    N counts the parameters that do matmuls on each token: every block and the output head (the
    input embedding is a lookup, but we keep the common convention of counting it once through
    the head, whether tied or not). Of a mixture of experts, only the active parameters count:
    the router, the shared experts and the top-k routed experts (`active_params`).
    """
    n = active_params(model) + model.vocab_size * model.hidden_size
    kv_rank, _, rope, nope, v = mla_dims(model)
    # Multi-head latent attention's scores run at the query-key width and its values at the
    # value width: 2 n s (dn + dr + dv) forward where multi-head attention's is 4 h s. An MTP
    # module's block attends as a layer does.
    width = model.num_heads * (nope + rope + v) / 2 if kv_rank else model.hidden_size
    layers = model.num_layers + getattr(model, "mtp_layers", 0)
    return 6.0 * n + 12.0 * layers * width * seq_len


@once_per_shape
def layer_params(model, tp: int = 1, ep: int = 1, whole_kv: bool = False,
                 moe: bool = True) -> tuple[int, int]:
    """(dense, expert) parameters of one transformer layer on one rank of tp x ep (moe=False: a
    layer with the dense MLP)."""
    part = layer_parts(model, moe)
    kv_heads = model.num_kv_heads or model.num_heads
    if kv_heads_split(kv_heads, tp):
        kv = part.kv // tp
    else:
        # tp exceeds (or does not divide) the kv heads: each rank keeps the kv head its query
        # heads use (Megatron) or all of them (ours).
        kept = kv_heads if whole_kv else max(kv_heads // tp, 1)
        bias = 1 if getattr(model, "attention_bias", False) else 0
        kv = 2 * (model.hidden_size + bias) * kept * model.head_dim
    attn = part.q_o // tp + kv + part.replicated
    if not part.experts:
        return attn + part.mlp // tp + part.norms, 0
    routed = (part.experts // ep) * part.mlp // tp
    dense = attn + part.norms + part.shared_experts * part.mlp // tp + part.router  # replicated
    return dense, routed


def stage_params(model, layout, layers: int, stage: int, whole_kv: bool = False,
                 first_layer: int | None = None, embedding: bool | None = None,
                 head: bool | None = None, dense_layers: int | None = None
                 ) -> tuple[int, int, int]:
    """(dense params, expert params, params of its largest layer incl. experts) on a rank of
    pipeline stage `stage` holding `layers` layers from global index `first_layer` (default:
    stage x layers, an even split), of which the first `first_k_dense` of the model are dense,
    or `dense_layers` of them (a rank holding chunks apart: theory/stages.py
    `rank_dense_layers`). `embedding`, `head`: whether it holds the embedding, and the final
    norm and output head (default: the first and the last stage)."""
    return _stage_params(model, layout.tp, layout.ep, layout.pp, layers, stage, whole_kv,
                         first_layer, embedding, head, dense_layers)


@once_per_shape
def _stage_params(model, tp: int, ep: int, pp: int, layers: int, stage: int, whole_kv: bool,
                  first_layer: int | None, embedding: bool | None,
                  head: bool | None, dense_layers: int | None) -> tuple[int, int, int]:
    first = stage * layers if first_layer is None else first_layer
    n_dense = dense_layers_in(model, first, layers) if dense_layers is None else dense_layers
    dense, expert = layer_params(model, tp, ep, whole_kv)
    plain, _ = layer_params(model, tp, ep, whole_kv, moe=False)
    h = model.hidden_size
    d = (layers - n_dense) * dense + n_dense * plain
    largest = max(dense + expert if layers > n_dense else 0, plain if n_dense else 0)
    emb = -(-model.vocab_size // tp) * h  # the vocabulary padded to a multiple of tp
    embeds = stage == 0 if embedding is None else embedding
    if embeds:
        d += emb
    expert_total = (layers - n_dense) * expert
    if stage == pp - 1 if head is None else head:
        d += h  # final norm
        # The output head: its own matrix, or a copy of the tied embedding on another stage
        # (one copy where both ends share the rank: one stage, or dualpipev's rank 0).
        if not model.tie_embeddings or not embeds:
            d += emb
        mtp = getattr(model, "mtp_layers", 0)
        if mtp:  # the multi-token prediction modules sit with the head (models/mtp.py)
            own, experts = mtp_rank_params(model, tp, ep, whole_kv)
            d += mtp * own
            expert_total += mtp * experts
            if not model.tie_embeddings and not embeds:
                d += emb  # the embedding's copy its tokens are embedded with
    return d, expert_total, largest


def stage_matrix_params(model, layout, layers: int, stage: int, whole_kv: bool = False,
                        first_layer: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of the matrices Muon steps on a rank of pipeline stage `stage`
    (optim/muon.py `is_matrix`): the blocks' projections and experts, without the embedding, the
    head, norms, biases and routers (AdamW steps those)."""
    plain = replace(model_shape(model), attention_bias=False)
    first = stage * layers if first_layer is None else first_layer
    n_dense = dense_layers_in(plain, first, layers)
    dense, expert = layer_params(plain, layout.tp, layout.ep, whole_kv)
    part = layer_parts(plain)
    dense -= part.norms + part.router
    mlp_layer, _ = layer_params(plain, layout.tp, layout.ep, whole_kv, moe=False)
    mlp_layer -= layer_parts(plain, moe=False).norms
    return (layers - n_dense) * dense + n_dense * mlp_layer, (layers - n_dense) * expert


def layer_matrix_shapes(model, moe: bool = True) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of one whole layer's Muon matrices (an MoE layer's experts, shared
    ones included, are one matrix each): what Newton-Schulz runs on."""
    h, hd = model.hidden_size, model.head_dim
    kv_heads = model.num_kv_heads or model.num_heads
    experts = model.num_experts if moe else 0
    mlps = experts + model.shared_experts if experts else 1
    ffn = expert_ffn(model) if experts else model.ffn_hidden_size
    return [(1, model.num_heads * hd, h), (2, kv_heads * hd, h), (1, h, model.num_heads * hd),
            (2 * mlps, ffn, h), (mlps, h, ffn)]


def even_split_params(model, layout, layers: int, vocab_matrices: int) -> float:
    """The matmul weights of `layers` layers and `vocab_matrices` vocabulary-sized matrices, all
    split evenly over tp and the experts over ep, the norms left out: the planner's count of the
    bytes a rank's gradients and optimizer stream. (Exact per-rank counts are `stage_params`'s;
    the planner's H100 constants were fitted with this one, and its worst-cell fit moves by
    several percent with any change of the count, even the norms' 2 h per layer.)"""
    part = layer_parts(model)
    attn = part.q_o + part.kv
    if part.experts:
        # The model's average layer: its first_k_dense layers keep the dense MLP.
        moe = part.mlp * (part.experts / layout.ep + part.shared_experts) + part.router
        k = dense_layers(model)
        mlp = (k * layer_parts(model, moe=False).mlp + (model.num_layers - k) * moe) \
            / model.num_layers
    else:
        mlp = part.mlp
    vocab = model.vocab_size * model.hidden_size * vocab_matrices
    return (layers * (attn + mlp) + vocab) / layout.tp
