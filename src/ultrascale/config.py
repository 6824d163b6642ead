"""The one validated configuration tree: YAML file plus `--set section.key=value` overrides.

Every structural rule (tp divides the heads, pp divides the layers, ...) is checked here, before any
process starts, and reported as a `ConfigError` that names the key, the value and the fix. The rules
themselves live in rules.py, which the estimator, the planner and the engine ask too.

How to add a key: declare it once, in its section below, as `name: type = key(default, meaning,
...)` (config_fields.py). The annotation is its type and the pydantic constraints (ge=, gt=, ...)
its bounds; `meaning` is the line `ultrascale config keys` and `ultrascale train --help` print;
`layout="..."` names the `Layout` field it feeds where it changes memory or time (add that field to
layout.py: `Config.layout()`, the `memory`/`plan` flag of that name and the layout string then
follow); `aliases=(...)` are other trainers' names for it. Then give it a row in
docs/configuration.md (tests/test_docs.py checks every key is there); a rule on its value goes in
rules.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from ultrascale import config_fields, devices, hf_arch, params
from ultrascale.config_fields import ConfigError, key
from ultrascale.layout import DTYPE_BYTES, Layout
from ultrascale.presets import model_defaults
from ultrascale.rules import (accumulation_for, layout_violations, model_violations,
                              data_violations, precision_violations, training_violations)

PRESET = "from preset"  # the key table's default for what a preset (or a Hugging Face config) fills
MOE = "mixture of experts: "
DTYPES = tuple(DTYPE_BYTES)  # what the estimator and the planner size (the engine: fewer)


class _Section(BaseModel):
    # inf and nan are refused in every float key (a learning rate of inf would start training).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RopeScaling(_Section):
    """Rotary frequencies for long contexts. "llama3" (Llama 3.1): the long wavelengths slowed by
    `factor`, the short ones kept, a smooth blend between. "yarn" (DeepSeek-V2/V3): the
    frequencies blended between interpolated (slowed by `factor`) and kept by a linear ramp over
    the dimensions that turn between `beta_fast` and `beta_slow` times in
    `original_max_positions`, the tables scaled by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), and (with mscale_all_dim) MLA's softmax scale by mscale(factor,
    mscale_all_dim)^2, where mscale(f, m) = 0.1 m ln f + 1."""

    type: Literal["llama3", "yarn"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_positions: int = Field(8192, ge=1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = Field(1.0, ge=0)
    mscale_all_dim: float = Field(0.0, ge=0)


class ModelConfig(_Section):
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
    # Exact while the window covers training.seq_len, refused below it.
    sliding_window: Optional[int] = key(None, "attention window in tokens (Mistral); must be >= "
                                              "training.seq_len", ge=1)
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


class ParallelConfig(_Section):
    # "auto": the world size taken from the launcher (validation context `world_size`: WORLD_SIZE
    # under torchrun/srun, the local GPUs otherwise).
    dp: int = key(2, "data-parallel ranks; auto: the world size / (tp x pp x cp) under "
                     "torchrun/srun", layout="dp", ge=1, aliases=(
                         "data_parallel", "data_parallel_size", "data_parallel_degree",
                         "data_parallel_shard_degree", "dp_size"))
    tp: int = key(1, "tensor-parallel ranks (divides num_heads and ffn_hidden_size)", layout="tp",
                  ge=1, aliases=("tensor_parallel", "tensor_model_parallel_size",
                                 "tensor_parallel_degree", "tensor_parallel_size", "tp_size"))
    pp: int = key(1, "pipeline stages (pp x pp_virtual_stages divides num_layers)", layout="pp",
                  ge=1, aliases=("pipeline_parallel", "pipeline_model_parallel_size",
                                 "pipeline_parallel_degree", "pipeline_parallel_size", "pp_size"))
    cp: int = key(1, "context-parallel ranks (sequence split for attention)", layout="cp", ge=1,
                  aliases=("context_parallel", "context_parallel_size", "context_parallel_degree",
                           "cp_size"))
    ep: int = key(1, "expert-parallel ranks, carved out of dp", layout="ep", ge=1, aliases=(
        "expert_parallel", "expert_model_parallel_size", "expert_parallel_degree", "ep_size"))
    zero: int = key(0, "ZeRO stage over the dp ranks: 1 optimizer state, 2 + gradients, 3 + "
                       "weights", layout="zero", ge=0, le=3,
                    aliases=("zero_stage", "zero_optimization"))
    # rules.zero3_gathers_per_step resolves auto (docs/pipeline.md).
    zero3_gather: Literal["auto", "step", "micro_batch"] = key(
        "auto", "ZeRO-3: gather parameters once a step (step) or for each forward and backward "
                "(micro_batch); auto: step under pp", layout="zero3_gather")
    # Hybrid sharding: ZeRO shards inside groups of dp_shard ranks, all-reduces across groups.
    dp_shard: Optional[int] = key(None, "hybrid sharding: ZeRO shards inside groups of this many "
                                        "dp ranks", layout="dp_shard", ge=1)
    sequence_parallel: bool = key(False, "shard norms and the residual stream along the sequence "
                                         "over tp", layout="sequence_parallel")
    pp_schedule: Literal["afab", "1f1b", "interleaved", "zero_bubble", "dualpipev"] = key(
        "1f1b", "pipeline schedule: afab, 1f1b, interleaved, zero_bubble, dualpipev",
        layout="pp_schedule")
    pp_virtual_stages: int = key(1, "model chunks per pipeline rank (interleaved; 2 for "
                                    "dualpipev)", layout="pp_virtual_stages", ge=1)
    pp_layers: Optional[list[int]] = key(None, "layers of each pipeline stage, for uneven splits "
                                               "(null: even)")
    # Ring: K/V around a ring; all_gather: K/V all-gathered; ulysses: an all-to-all from
    # sequence-sharded to head-sharded (docs/context_parallel.md).
    cp_mode: Literal["ring", "all_gather", "ulysses"] = key(
        "ring", "context-parallel attention: ring, all_gather or ulysses", layout="cp_mode")
    # Off: one contiguous chunk each.
    cp_load_balance: bool = key(True, "cp rank r keeps sequence chunks r and 2cp-1-r (equal causal "
                                      "work)")
    bucket_mb: float = key(25.0, "gradient bucket size of the data-parallel reduction, MB",
                           layout="bucket_mb", gt=0)
    overlap: bool = key(True, "overlap communication with computation where the strategy can")

    @model_validator(mode="before")
    @classmethod
    def _auto_dp(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or data.get("dp") != "auto":
            return data
        world = (info.context or {}).get("world_size")
        tp, pp, cp = (data.get(k, 1) for k in ("tp", "pp", "cp"))
        if not all(isinstance(x, int) and x >= 1 for x in (tp, pp, cp)):
            return {**data, "dp": 1}  # tp, pp or cp is invalid: let its own message say so
        if not world:
            raise ConfigError("parallel.dp=auto takes the world size from the launcher (WORLD_SIZE "
                              "under torchrun/srun, the GPUs of this machine otherwise); none is "
                              "known here. Give parallel.dp a number.")
        if world % (tp * pp * cp):
            raise ConfigError(
                f"parallel.dp=auto: the world size {world} is not divisible by tp x pp x cp = "
                f"{tp} x {pp} x {cp} = {tp * pp * cp}. Start a multiple of {tp * pp * cp} "
                "processes, or change tp, pp or cp.")
        return {**data, "dp": world // (tp * pp * cp)}

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def default_warmup(steps: int) -> int:
    """Warm-up when training.warmup_steps is not given: a tenth of the run, at most 1000 steps
    (200 steps warm up for 20; a 5-step smoke test starts at the peak rate)."""
    return min(steps // 10, 1000)


class TrainingConfig(_Section):
    steps: int = key(200, "optimizer steps", ge=1,
                     aliases=("max_steps", "train_iters", "train_steps", "iterations"))
    seq_len: int = key(128, "tokens per sequence", layout="seq_len", ge=2,
                       aliases=("seq_length", "sequence_length", "max_seq_len", "seq"))
    micro_batch_size: int = key(8, "sequences per micro-batch per dp rank", layout="mbs", ge=1,
                                aliases=("batch_size", "micro_batch", "mbs",
                                         "per_device_train_batch_size"))
    grad_accum_steps: int = key(1, "micro-batches per optimizer step (the pipeline's "
                                   "micro-batches)", layout="grad_accum", ge=1, aliases=(
                                       "gradient_accumulation_steps", "grad_accum",
                                       "accumulation_steps"))
    global_batch_size: Optional[int] = key(None, "sequences per step, kept when dp changes: "
                                           "grad_accum_steps follows it", ge=1,
                                           aliases=("train_batch_size",))
    lr: float = key(3e-3, "peak learning rate", gt=0, aliases=("learning_rate",))
    min_lr_ratio: float = key(0.1, "the cosine decay ends at min_lr_ratio x lr", ge=0, le=1)
    warmup_steps: Optional[int] = key(None, "linear warm-up steps (null: a tenth of steps, at "
                                            "most 1000)", ge=0, aliases=(
                                                "warmup", "warmup_iters", "lr_warmup_steps",
                                                "lr_warmup_iters"))
    weight_decay: float = key(0.1, "weight decay on matrices, not on norm weights (AdamW's; "
                                   "Muon's too)", ge=0)
    grad_clip: Optional[float] = key(1.0, "clip the global gradient norm to this (null: off)",
                                     gt=0, aliases=("clip_grad", "max_norm", "max_grad_norm",
                                                    "gradient_clipping"))
    beta1: float = key(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = key(0.95, "AdamW beta2", ge=0, lt=1)
    seed: int = key(1234, "initial weights (per parameter name) and data order")
    # muon: lr and weight_decay carry over from AdamW (Moonlight's update scale).
    optimizer: Literal["adamw", "muon"] = key(
        "adamw", "the optimizer: adamw, or muon (Muon for the blocks' matrices, AdamW for the "
        "rest)", layout="optimizer")
    # The optimizer path (parallel/flat.py): per_tensor is the reference the fused one is tested
    # against (tests/test_optimizer_path.py), and the GPU suite's baseline.
    optimizer_impl: Literal["fused", "per_tensor"] = key(
        "fused", "the optimizer path: fused (flat gradients, fp64-accumulated multi-tensor norm, "
        "clip on the device, fused AdamW) or per_tensor (the reference: for-loop AdamW, fp64 "
        "element-wise norm)")
    muon_momentum: float = key(0.95, "muon: the matrices' (Nesterov) momentum", ge=0, lt=1)
    muon_ns_steps: int = key(5, "muon: Newton-Schulz iterations that orthogonalise each update",
                             ge=1)
    # norms_and_mla_up: DeepSeek-V3's, the RMSNorms' and MLA's up-projections' outputs
    # recomputed from the tensors saved anyway (parallel/recipes.py).
    recompute: Literal["none", "selective", "full", "norms_and_mla_up"] = key(
        "none", "activation recomputation: none, selective, full, norms_and_mla_up (DeepSeek-V3's: "
        "the RMSNorms and MLA's up-projections)", layout="recompute", aliases=(
            "activation_checkpointing", "gradient_checkpointing", "recompute_granularity", "ac"))
    mtp_loss_weight: float = key(0.3, "multi-token prediction: weight of the MTP losses' mean "
                                      "over the depths", ge=0)
    compile: bool = key(False, "compile each transformer block's forward with torch.compile")
    compile_cache: Optional[str] = key(None, "inductor's cache folder (null: torch's default)")
    # auto: Triton on CUDA when installed and blocks are not compiled (inductor fuses them), else
    # the references of models/ops.py.
    kernels: Literal["auto", "triton", "torch"] = key(
        "auto", "fused kernels for RMSNorm, rotary, SwiGLU: auto, triton, torch")
    chunked_loss: bool = key(False, "head and cross-entropy a chunk of tokens at a time (no full "
                                    "logits)")
    # The validation split: data.val_source or data.val_fraction.
    eval_every: int = key(0, "validation loss every N steps (0: at the last step only)", ge=0)
    eval_batches: int = key(4, "global batches of validation sequences per evaluation", ge=1)

    @model_validator(mode="after")
    def _fill_warmup(self) -> "TrainingConfig":
        if self.warmup_steps is None:
            self.warmup_steps = default_warmup(self.steps)
        return self


class PrecisionConfig(_Section):
    # docs/precision.md. "auto" is resolved once when the Config is validated
    # (`Config._auto_dtype`): a validated Config's dtype is always concrete.
    dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = key(
        "auto", "compute dtype: fp32, bf16, fp16, fp8; auto: bf16 on CUDA and on CPUs with bf16 "
        "instructions, else fp32", layout="dtype", aliases=("mixed_precision", "param_dtype"))
    master_dtype: Literal["fp32"] = key("fp32", "dtype of the weights the optimizer updates",
                                        layout="master_dtype", layout_values=DTYPES)
    grad_accum_dtype: Literal["fp32", "bf16"] = key(
        "fp32", "dtype gradients accumulate in", layout="grad_accum_dtype", layout_values=DTYPES)
    # The loss is a token mean, so gradients are O(1) even in a spike: 2^10 leaves room for
    # elements up to 64 (docs/precision.md: PyTorch's 2^16 skips the steps of the first spike).
    loss_scaling: Literal["dynamic", "none"] = key(
        "dynamic", "fp16: dynamic (skip the step and halve the scale on overflow); none is refused")
    loss_scale_init: float = key(1024.0, "fp16: the first loss scale", gt=0)
    loss_scale_window: int = key(1000, "fp16: clean steps after which the loss scale doubles",
                                 ge=1)
    # Blockwise: DeepSeek-V3's 1x128 tiles of activations and gradients, 128x128 of weights.
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise"] = key(
        "tensorwise", "fp8 scales: tensorwise, rowwise, blockwise (1x128 / 128x128 tiles)")
    fp8_backward: Literal["e5m2", "e4m3"] = key(
        "e5m2", "fp8: the gradients' format, e5m2 or e4m3 (forward: e4m3)")
    fp8_emulate: bool = key(False, "fp8: the exact reference (quantise, dequantise, fp32 matmul) "
                                   "instead of the device's scaled matmul")
    # auto: rules.fp8_pays, torchao's measured thresholds on K (in_features) and N (out_features).
    fp8_filter: Literal["all", "auto"] = key(
        "all", "fp8: all the blocks' linears, or auto: only those large enough to gain "
               "(torchao's thresholds on K and N), the rest bf16")

    def summary(self) -> str:
        """What a run computes in what, in words (`ultrascale train`'s header: what `auto` became
        here). An FP8 recipe runs on the device's scaled matmul unless `fp8_emulate` (a device
        without it is refused before launch)."""
        dtype = self.dtype
        if dtype == "fp32":
            return "fp32 throughout"
        if dtype == "auto":  # a PrecisionConfig made on its own, outside a Config
            return "auto (resolved when the config is validated)"
        parts = [f"{'bf16' if dtype == 'fp8' else dtype} parameters and activations",
                 f"{self.master_dtype} master weights",
                 f"{self.grad_accum_dtype} gradient accumulation",
                 "fp32 norm statistics, softmax and loss"]
        if dtype == "fp8":
            how = ("EMULATED (precision.fp8_emulate: quantise, dequantise, fp32 matmul)"
                   if self.fp8_emulate else "on the device's scaled matmul")
            which = ("the blocks' linears large enough to gain (fp8_filter=auto), bf16 for the "
                     "rest" if self.fp8_filter == "auto" else "the blocks")
            parts.insert(0, f"fp8 matmuls in {which} ({self.fp8_recipe} scales, e4m3 forward, "
                            f"{self.fp8_backward} backward, fp32 accumulation, {how})")
        if dtype == "fp16":
            parts.append(f"dynamic loss scaling from {self.loss_scale_init:g} (halved on "
                         f"overflow, doubled after {self.loss_scale_window} clean steps)")
        return ", ".join(parts)


class DataConfig(_Section):
    source: str = key("builtin", "builtin, .txt/.md/.jsonl/.parquet files or a folder of them, a "
                                 "save_to_disk folder, or a .bin from `ultrascale tokenize`")
    tokenizer: str = key("byte", "byte (256 tokens, no files), a local tokenizer.json or Hugging "
                                 "Face model folder (model.vocab_size follows it)")
    text_key: str = key("text", "the field (JSON-lines, Parquet, datasets) that holds the text")
    val_source: Optional[str] = key(None, "validation data, in any form data.source takes (null: "
                                          "none)")
    val_fraction: float = key(0.0, "or hold out this last fraction of data.source's sequences",
                              ge=0, lt=1)
    # text: documents; chat: conversations rendered with the tokenizer folder's chat template
    # and packed whole (docs/sft.md).
    format: Literal["text", "chat"] = key(
        "text", "text (documents) or chat (conversations rendered with the tokenizer folder's "
        "chat template, docs/sft.md)")
    messages_key: str = key("messages", "chat: the field holding a conversation's [{role, "
                                        "content}] messages")
    # null resolves to a bool here: true for chat data, false for text (docs/configuration.md).
    document_mask: Optional[bool] = key(
        None, "attention never crosses a packed document's boundary, positions restart at each "
        "(null: true for chat data, false for text)")
    loss_on: Literal["assistant", "all"] = key(
        "assistant", "chat: the tokens trained on, assistant (the assistant's turns) or all")
    overlong: Literal["refuse", "drop", "cut"] = key(
        "refuse", "chat: a conversation longer than training.seq_len is refused, dropped or cut "
        "to it (counted in the run's header)")

    @model_validator(mode="after")
    def _check_format(self) -> "DataConfig":
        if self.document_mask is None:
            self.document_mask = self.format == "chat"
        if self.format == "chat" and (self.tokenizer == "byte" or self.source == "builtin"
                                      or self.source.endswith(".bin")):
            name, value = (("tokenizer", self.tokenizer) if self.tokenizer == "byte"
                           else ("source", self.source))
            raise ConfigError(
                f"data.format=chat with data.{name}={value!r}: chat data is JSON lines, Parquet "
                "or a save_to_disk folder of conversations (data.messages_key), rendered with the "
                "chat template of a local Hugging Face tokenizer folder (data.tokenizer). Give "
                "both, or data.format=text (docs/sft.md).")
        return self


class CheckpointConfig(_Section):
    dir: Optional[str] = key(None, "where step_XXXXXXXX/ folders go (null: "
                                   "<run_dir>/checkpoints)")
    every: int = key(0, "save every N steps (0: only the last step)", ge=0,
                     aliases=("save_interval", "checkpoint_interval"))
    keep: int = key(2, "keep the newest N checkpoints", ge=1)
    resume: str = key("none", "none, auto (the newest in dir) or a checkpoint folder, saved in any "
                              "layout (docs/checkpoints.md)")
    async_save: bool = key(False, "write checkpoints in the background while training goes on "
                                  "(one host copy of the rank's state meanwhile; still atomic)")
    every_minutes: Optional[float] = key(None, "also save when this many minutes passed since "
                                               "the last save (null: by steps only)", gt=0)
    save_on_signal_s: float = key(120.0, "on Ctrl-C or SIGTERM, finish the step and save a "
                                         "checkpoint if it ends within this many seconds (0: stop "
                                         "at once)", ge=0)


class LoggingConfig(_Section):
    run_dir: Optional[str] = key(None, "the run's folder (null: a fresh runs/<UTC time>)")
    metrics_file: Optional[str] = key(None, "one JSON line per logged step (null: "
                                            "<run_dir>/metrics.jsonl)")
    every: int = key(10, "log (metrics file and console) every N steps; the first and last always",
                     ge=1, aliases=("log_interval", "log_freq"))
    tensorboard: bool = key(False, "also write TensorBoard scalars (needs tensorboard)")
    wandb: bool = key(False, "refused: not implemented")
    progress: bool = key(True, "console progress: a bar on a terminal, a line per logged step "
                               "otherwise")
    measure_memory: bool = key(False, "record the peak bytes of activations saved for backward")
    sample_tokens: int = key(120, "length of the text sample printed at the end (0: none)", ge=0)


class LaunchConfig(_Section):
    """How the ranks are started and watched (the launcher's checks and limits)."""

    # torch's own default is 30 minutes.
    collective_timeout_s: Optional[float] = key(
        None, "a rank waiting this long in one collective ends the run (null: 300 s for local "
        "runs, 600 s under torchrun/srun)", gt=0)
    max_local_ranks: Optional[int] = key(None, "most processes started on this machine (null: 4 "
                                               "per CPU core, or the visible GPUs)", ge=1)
    memory_check: bool = key(True, "refuse a run whose memory estimate exceeds the device or the "
                                   "RAM")
    memory_per_rank_gib: Optional[float] = key(
        None, "refuse a run whose estimate per rank exceeds this many GiB (a device budget, "
        "emulated on CPUs; null: none)", gt=0)
    max_restarts: int = key(0, "restart from the last checkpoint when a rank dies, up to N times "
                               "(docs/faults.md)", ge=0)
    min_dp: Optional[int] = key(None, "ranks lost for good leave; go on down to this dp (null: "
                                      "no shrinking)", ge=1)
    oom_snapshot: bool = key(True, "CUDA: a memory snapshot in the run folder on out of memory")


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    device: Literal["auto", "cpu", "cuda"] = key("auto", "auto (CUDA when present, else CPU), cpu "
                                                         "or cuda")
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="before")
    @classmethod
    def _auto_dtype(cls, data: Any, info: ValidationInfo) -> Any:
        """`precision.dtype: auto` becomes the one dtype the run computes in (devices.resolve_dtype:
        bf16 on CUDA and on CPUs with bf16 instructions, fp32 otherwise), once, here: config.yaml,
        the ranks, the checkpoints' meta.json and every estimate see the same. CUDA is the
        validation context's `cuda` where given (the planner and a Slurm sweep predict GPUs from
        a login node), else what `device` means on this machine."""
        if not isinstance(data, dict):
            return data
        precision = data.get("precision")
        if isinstance(precision, PrecisionConfig):
            precision = precision.model_dump()
        precision = precision if precision is not None else {}
        if not isinstance(precision, dict) or precision.get("dtype", "auto") != "auto":
            return data
        cuda = (info.context or {}).get("cuda")
        if cuda is None:
            device = data.get("device", "auto")
            cuda = devices.uses_cuda(device) if device in ("auto", "cpu", "cuda") else False
        return {**data, "precision": {**precision, "dtype": devices.resolve_dtype("auto", cuda)}}

    @model_validator(mode="before")
    @classmethod
    def _vocab_from_tokenizer(cls, data: Any) -> Any:
        """model.vocab_size follows a Hugging Face tokenizer unless it is given (or the model
        comes from a Hugging Face config, whose vocabulary the weights have)."""
        if not isinstance(data, dict):
            return data
        model, section = data.get("model") or {}, data.get("data") or {}
        if not isinstance(model, dict) or not isinstance(section, dict):
            return data
        if model.get("vocab_size") or model.get("from_hf") or model.get("hf_config"):
            return data
        size = hf_arch.tokenizer_vocab_size(str(section.get("tokenizer", "byte")))
        return {**data, "model": {**model, "vocab_size": size}} if size else data

    @model_validator(mode="after")
    def _grad_accum_from_global_batch(self) -> "Config":
        """training.global_batch_size fixes the batch: grad_accum_steps follows dp."""
        t = self.training
        if t.global_batch_size is not None:
            given = t.grad_accum_steps if "grad_accum_steps" in t.model_fields_set else None
            t.grad_accum_steps, broken = accumulation_for(t.global_batch_size, t.micro_batch_size,
                                                          self.parallel.dp, given)
            if broken:
                raise ConfigError(broken.message)
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> "Config":
        t, d = self.training, self.data
        if d.val_source is not None and d.val_fraction:
            raise ConfigError(f"data.val_source={d.val_source!r} and data.val_fraction="
                              f"{d.val_fraction} both give a validation split. Keep one.")
        if t.eval_every and d.val_source is None and not d.val_fraction:
            raise ConfigError(f"training.eval_every={t.eval_every} but there is no validation "
                              "split: set data.val_source (a file or folder) or data.val_fraction "
                              "(e.g. 0.05), or training.eval_every=0.")
        broken = layout_violations(self.model, self.layout(), self.parallel.pp_layers) \
            + precision_violations(self.precision) + training_violations(self.training) \
            + data_violations(self.model, self.data)
        if broken:
            raise ConfigError(broken[0].message)
        if t.warmup_steps > t.steps:
            raise ConfigError(
                f"training.warmup_steps={t.warmup_steps} exceeds training.steps={t.steps}: "
                "the learning rate would never reach its peak. Lower warmup_steps, or leave it "
                f"out (the default is a tenth of the steps: {default_warmup(t.steps)})."
            )
        return self

    def layout(self) -> Layout:
        """This run's layout as the estimator and the planner see it: every knob that changes
        memory or time (the keys declared with `layout=`), the dtype concrete."""
        return Layout(**{k.layout: getattr(getattr(self, k.section), k.attr)
                         for k in layout_keys()})

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro_batch_size x grad_accum_steps x dp."""
        t = self.training
        return t.micro_batch_size * t.grad_accum_steps * self.parallel.dp

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# What the declarations say (config_fields.py reads them).


def known_keys() -> list[str]:
    """Every key of the tree, dotted (`training.lr`, ..., `device`), in declaration order."""
    return [k.name for k in config_fields.declared(Config)]


@functools.cache
def layout_keys() -> tuple[config_fields.Key, ...]:
    """The keys that feed a `Layout` field (declared with `layout=`), in declaration order."""
    return tuple(k for k in config_fields.declared(Config) if k.layout)


def layout_sections(layout: Layout) -> dict:
    """The nested config sections that run `layout` with `ultrascale train`."""
    out: dict = {}
    for k in layout_keys():
        out.setdefault(k.section, {})[k.attr] = getattr(layout, k.layout)
    return out


def suggest_key(loc: str) -> str | None:
    """The key meant by an unknown `loc` (config_fields.suggest_key)."""
    return config_fields.suggest_key(Config, loc)


# ---------------------------------------------------------------------------------------------
# Loading: YAML + overrides, with errors turned into one readable paragraph each.


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} has no '=': an override is one word, "
                          f"section.key=value: --set {item}=VALUE (e.g. --set training.lr=1e-3).")
    name, raw = item.split("=", 1)
    if not name.strip():
        raise ConfigError(f"--set {item!r} names no key: write --set section.key=value.")
    return name.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def build_config(data: dict | None = None, overrides: list[str] = (),
                 world_size: int | None = None, cuda: bool | None = None) -> Config:
    """Validate a nested dict plus `section.key=value` overrides into a Config, or raise ConfigError.

    world_size: the launcher's (WORLD_SIZE, or the local GPUs), which `parallel.dp: auto` divides.
    cuda: whether the run computes on CUDA, which `precision.dtype: auto` follows (None: what the
    config's `device` means on this machine).
    """
    data = json.loads(json.dumps(data or {}))  # a deep copy we may edit
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: `{part}` is not a section.")
        node[path[-1]] = value
    try:
        return Config.model_validate(data, context={"world_size": world_size, "cuda": cuda})
    except ValidationError as err:
        raise ConfigError(config_fields.explain(Config, err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                world_size: int | None = None, cuda: bool | None = None) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} does not exist. Give the path of a YAML "
                              "file, or no file to train the default tiny model.")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"Config file {str(path)!r} must hold a mapping of sections.")
    return build_config(data, overrides, world_size, cuda)
