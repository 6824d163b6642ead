"""The model section of the configuration tree (config.py): the shape, the attention, the rotary
embeddings, a mixture of experts, multi-head latent attention and multi-token prediction.

How to add a key: see the note at the top of config.py (declare it once, `key(...)`, in its
section here).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from ultrascale import hf_arch, params
from ultrascale.config_fields import ConfigError, Section, key
from ultrascale.presets import model_defaults
from ultrascale.rules import model_violations

PRESET = "from preset"  # the key table's default for what a preset (or a Hugging Face config) fills
MOE = "mixture of experts: "


class RopeScaling(Section):
    """Rotary frequencies for long contexts. "linear": every frequency slowed by `factor` (position
    interpolation). "llama3" (Llama 3.1): the long wavelengths slowed by
    `factor`, the short ones kept, a smooth blend between. "yarn" (DeepSeek-V2/V3): the
    frequencies blended between interpolated (slowed by `factor`) and kept by a linear ramp over
    the dimensions that turn between `beta_fast` and `beta_slow` times in
    `original_max_positions`, the tables scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), and (with mscale_all_dim) MLA's softmax scale by mscale(factor,
    mscale_all_dim)^2, where mscale(f, m) = 0.1 m ln f + 1; `attention_factor` given outright
    replaces that table scale, and `truncate: false` keeps the ramp's ends unrounded."""

    type: Literal["llama3", "yarn", "linear"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_positions: int = Field(8192, ge=1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = Field(1.0, ge=0)
    mscale_all_dim: float = Field(0.0, ge=0)
    attention_factor: Optional[float] = Field(None, gt=0)
    truncate: bool = True


class ModelConfig(Section):
    preset: Optional[str] = key(
        "tiny", "named shape whose values are the defaults of the keys below (tiny, llama3-1b, "
        "llama3-3b, llama3-8b, llama3-70b, llama3-405b, tiny-moe, mixtral-8x7b, qwen3-30b-a3b, "
        "deepseek-v3, tiny-deepseek); null: give every shape key")
    from_hf: Optional[str] = key(None, "a local Hugging Face folder (config.json + safetensors): "
                                       "architecture and weights")
    hf_config: Optional[str] = key(None, "a Hugging Face config.json (or its folder): "
                                         "architecture only, fresh weights")
    architecture: str = key("llama", "Hugging Face family written on export: llama, mistral, "
                                     "qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                                     "deepseek_v2")
    hidden_size: int = key(0, "width of the residual stream", shown_default=PRESET, ge=0)
    num_layers: int = key(0, "transformer blocks", shown_default=PRESET, ge=0)
    num_heads: int = key(0, "attention query heads", shown_default=PRESET, ge=0)
    num_kv_heads: int = key(0, "key/value heads (fewer than num_heads: grouped-query attention)",
                            shown_default=PRESET, ge=0)
    ffn_hidden_size: int = key(0, "inner width of the SwiGLU MLP", shown_default=PRESET, ge=0)
    vocab_size: int = key(0, "embedding rows; at least the tokenizer's vocabulary",
                          shown_default=PRESET, ge=0)
    tie_embeddings: bool = key(False, "share the input embedding with the output head",
                               shown_default=PRESET)
    rope_theta: float = key(0.0, "rotary embedding base", shown_default=PRESET, ge=0)
    norm_eps: float = key(1e-5, "RMSNorm epsilon", gt=0)
    head_dim: int = key(0, "attention head width (default hidden_size / num_heads)",
                        shown_default=PRESET, ge=0)
    attention_bias: bool = key(False, "biases on the q, k, v projections (Qwen2)")
    qk_norm: bool = key(False, "RMSNorm over each query and key head before rotary (Qwen3)")
    rope_scaling: Optional[RopeScaling] = key(
        None, "rotary scaling: Llama 3.1's {type: llama3, factor, low_freq_factor, "
        "high_freq_factor, original_max_positions} or YaRN's {type: yarn, factor, "
        "original_max_positions, beta_fast, beta_slow, mscale, mscale_all_dim} (null: none)")
    # A query sees the window's keys, itself included (transformers' masks).
    sliding_window: Optional[int] = key(None, "attention window in tokens, the query's own "
                                              "included (Mistral, Qwen with use_sliding_window)",
                                        ge=1)
    # Qwen's layer_types / max_window_layers: the window on these layers, full attention on others.
    sliding_window_layers: Optional[list[int]] = key(
        None, "the layers (0-based) the window slides over, full attention on the others "
        "(Qwen's layer_types); null: every layer")
    # Mixture of experts (models/moe.py, docs/moe.md).
    num_experts: int = key(0, MOE + "experts per layer (0: dense)", shown_default=PRESET, ge=0)
    experts_top_k: int = key(0, MOE + "experts each token is routed to", shown_default=PRESET,
                             ge=0)
    shared_experts: int = key(0, MOE + "experts every token goes through", shown_default=PRESET,
                              ge=0)
    moe_ffn_hidden_size: int = key(0, MOE + "inner width of each expert (0: ffn_hidden_size)",
                                   ge=0)
    router: Literal["softmax", "sigmoid"] = key(
        "softmax", MOE + "softmax (top-k of a softmax) or sigmoid (DeepSeek-V3)")
    # Mixtral always renormalises, Qwen-MoE as its norm_topk_prob says.
    router_renormalize: Optional[bool] = key(
        None, MOE + "renormalise the top-k weights to sum 1 (null: sigmoid always, softmax when "
        "top_k > 1)")
    shared_expert_gate: bool = key(False, MOE + "a per-token sigmoid gate scales the shared "
                                               "experts' output (Qwen2-MoE)")
    # aux_free_and_aux_loss: DeepSeek-V3's, the bias and a small sequence-wise auxiliary loss.
    balance: Literal["aux_loss", "aux_free", "aux_free_and_aux_loss", "none"] = key(
        "aux_loss", MOE + "aux_loss, aux_free (expert bias moved by the load), "
        "aux_free_and_aux_loss (both: DeepSeek-V3) or none")
    aux_loss_coeff: float = key(0.01, MOE + "weight of the sequence-wise auxiliary loss", ge=0)
    z_loss_coeff: float = key(0.0, MOE + "weight of the router z-loss (0: off)", ge=0)
    bias_update_rate: float = key(1e-3, "mixture of experts, aux_free*: the expert bias's step "
                                        "per optimizer step", ge=0)
    capacity_factor: Optional[float] = key(
        None, MOE + "tokens an expert takes, x tokens x k / E (null: dropless)", gt=0)
    first_k_dense: int = key(0, MOE + "the first layers keep the dense MLP", ge=0)
    # Group-limited routing (DeepSeek-V3): each token keeps the router_topk_groups groups of the
    # highest sum of their two best scores and chooses its experts among them.
    router_groups: int = key(1, MOE + "the experts in this many equal groups (group-limited "
                                      "routing, DeepSeek-V3)", ge=1)
    router_topk_groups: Optional[int] = key(
        None, MOE + "a token chooses among the experts of its best this many groups, by their "
        "two best scores (null: all)", ge=1)
    routed_scaling_factor: float = key(1.0, MOE + "the routed experts' weights times this", gt=0)
    # Multi-head latent attention (models/mla.py, docs/deepseek.md).
    attention: Literal["mha", "mla"] = key(
        "mha", "mha (multi-head attention) or mla (DeepSeek's multi-head latent attention)")
    q_lora_rank: int = key(0, "mla: the query latent's width (0: one query projection)", ge=0)
    kv_lora_rank: int = key(0, "mla: the key-value latent's width", ge=0)
    qk_rope_head_dim: int = key(0, "mla: rotary dimensions of each query and key head (the "
                                   "keys' shared by the heads)", ge=0)
    qk_nope_head_dim: int = key(0, "mla: dimensions of each query and key head without rotary",
                                ge=0)
    v_head_dim: int = key(0, "mla: dimensions of each value head", ge=0)
    # Interleaved pairs (x0, x1), (x2, x3), ... rather than halves (Llama's).
    rope_interleave: bool = key(False, "mla: rotary dimensions in interleaved pairs (DeepSeek's "
                                       "checkpoints), not halves")
    # Multi-token prediction (models/mtp.py): sharing the embedding and the output head.
    mtp_layers: int = key(0, "multi-token prediction modules (DeepSeek-V3: 1); 0: none", ge=0)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        """A preset's or a Hugging Face config's values are the defaults (presets.py)."""
        return model_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        broken = model_violations(self)
        if broken:
            raise ConfigError(broken[0].message)
        if self.architecture not in hf_arch.BY_TYPE:
            raise ConfigError(f"model.architecture={self.architecture!r} is not one ultrascale "
                              f"knows; choose one of {', '.join(hf_arch.BY_TYPE)}.")
        return self

    def keys(self) -> dict:
        """The keys to rebuild this model from with some changed (`ModelConfig(**{**m.keys(),
        **changes})`): head_dim left out where it only follows hidden_size / num_heads, so that a
        changed width re-derives it."""
        data = self.model_dump()
        if self.head_dim * self.num_heads == self.hidden_size:
            data.pop("head_dim")
        return data

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "ModelConfig":
        """As pydantic's (no validation), with a derived head_dim following a changed width."""
        if update and {"hidden_size", "num_heads"} & set(update) and "head_dim" not in update \
                and self.head_dim * self.num_heads == self.hidden_size:
            h = update.get("hidden_size", self.hidden_size)
            n = update.get("num_heads", self.num_heads)
            update = {**update, "head_dim": h // n if n and h % n == 0 else 0}
        return super().model_copy(update=update, deep=deep)

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `models.llama.Llama` built from this config (params.py)."""
        return params.num_params(self, include_embedding)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full attention); multi-token prediction's
        blocks (numbered from num_layers on) slide as the last layer does."""
        if self.sliding_window is None or self.sliding_window_layers is None:
            return self.sliding_window
        layer = min(layer, self.num_layers - 1)
        return self.sliding_window if layer in self.sliding_window_layers else None

    @property
    def rotary_dim(self) -> int:
        """The dimensions rotary embeddings turn: a head's (MHA), or MLA's rotary part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def expert_ffn_hidden_size(self) -> int:
        """The inner width of each routed (and shared) expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N + 12 L h s (`params.flops_per_token`)."""
        return params.flops_per_token(self, seq_len)
