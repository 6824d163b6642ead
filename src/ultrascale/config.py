"""The one validated configuration tree: YAML file plus `--set section.key=value` overrides.

Every structural rule (tp divides the heads, pp divides the layers, ...) is checked here, before any
process starts, and reported as a `ConfigError` that names the key, the value and the fix. The rules
themselves live in rules.py, which the estimator, the planner and the engine ask too.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      model_validator)

from ultrascale import hf_arch, params
from ultrascale.layout import Layout
from ultrascale.presets import PRESETS
from ultrascale.rules import (
    layout_violations, model_violations, precision_violations, training_violations,
)


class ConfigError(ValueError):
    """An invalid configuration, explained in one paragraph: what is wrong and how to fix it."""


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


# Model keys that a preset or a Hugging Face config fills (the rest have their own defaults).
_SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
               "vocab_size", "tie_embeddings", "rope_theta")


class ModelConfig(_Section):
    preset: Optional[str] = "tiny"
    # A local Hugging Face folder (config.json + safetensors): its architecture and its weights.
    from_hf: Optional[str] = None
    # A Hugging Face config.json (or its folder): its architecture only, fresh weights.
    hf_config: Optional[str] = None
    architecture: str = "llama"  # the Hugging Face family written on export (hf_arch.py)
    hidden_size: int = Field(0, ge=0)
    num_layers: int = Field(0, ge=0)
    num_heads: int = Field(0, ge=0)
    num_kv_heads: int = Field(0, ge=0)
    ffn_hidden_size: int = Field(0, ge=0)
    vocab_size: int = Field(0, ge=0)
    tie_embeddings: bool = False
    rope_theta: float = Field(0.0, ge=0)
    norm_eps: float = Field(1e-5, gt=0)
    head_dim: int = Field(0, ge=0)  # 0: hidden_size / num_heads
    attention_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3)
    rope_scaling: Optional[RopeScaling] = None
    # Attention limited to this many past tokens (Mistral, some Qwen): exact while it covers
    # training.seq_len, refused below it.
    sliding_window: Optional[int] = Field(None, ge=1)
    # Mixture of experts (models/moe.py, docs/moe.md): 0 experts means a dense model.
    num_experts: int = Field(0, ge=0)
    experts_top_k: int = Field(0, ge=0)
    shared_experts: int = Field(0, ge=0)
    moe_ffn_hidden_size: int = Field(0, ge=0)  # each expert's width; 0: ffn_hidden_size
    router: Literal["softmax", "sigmoid"] = "softmax"
    # The top-k weights renormalised to sum 1. null: the router's own way (sigmoid always,
    # softmax when top_k > 1); Mixtral always renormalises, Qwen-MoE as its norm_topk_prob says.
    router_renormalize: Optional[bool] = None
    # A per-token sigmoid gate (one weight vector) scales the shared experts' output (Qwen2-MoE).
    shared_expert_gate: bool = False
    # aux_free_and_aux_loss: DeepSeek-V3's, the bias and a small sequence-wise auxiliary loss.
    balance: Literal["aux_loss", "aux_free", "aux_free_and_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = Field(0.01, ge=0)
    z_loss_coeff: float = Field(0.0, ge=0)
    bias_update_rate: float = Field(1e-3, ge=0)  # aux_free*: the expert bias moves this per step
    capacity_factor: Optional[float] = Field(None, gt=0)  # None: dropless
    first_k_dense: int = Field(0, ge=0)  # the first layers keep the dense MLP
    # Group-limited routing (DeepSeek-V3): the experts in router_groups equal groups; each token
    # keeps the router_topk_groups groups of the highest sum of their two best scores (null: all
    # groups) and chooses its experts_top_k experts among them. The routed output is scaled by
    # routed_scaling_factor.
    router_groups: int = Field(1, ge=1)
    router_topk_groups: Optional[int] = Field(None, ge=1)
    routed_scaling_factor: float = Field(1.0, gt=0)
    # Multi-head latent attention (models/mla.py, docs/deepseek.md): "mla" projects queries
    # through a q_lora_rank latent (0: one projection) and keys and values from one
    # kv_lora_rank latent, with qk_rope_head_dim rotary dimensions (one key part shared by the
    # heads) beside qk_nope_head_dim, and values of v_head_dim.
    attention: Literal["mha", "mla"] = "mha"
    q_lora_rank: int = Field(0, ge=0)
    kv_lora_rank: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    # The rotary dimensions in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints)
    # rather than in halves (Llama's).
    rope_interleave: bool = False
    # Multi-token prediction (models/mtp.py): modules that predict the tokens 2..mtp_layers+1
    # ahead, sharing the embedding and the output head.
    mtp_layers: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        hf_source = data.get("from_hf") or data.get("hf_config")
        if hf_source is not None:
            return cls._fill_from_hf(data, hf_source)
        preset = data.get("preset", "tiny")
        if preset is not None and preset not in PRESETS:
            raise ConfigError(
                f"model.preset={preset!r} is not a known preset. Choose one of "
                f"{', '.join(PRESETS)}, or set model.preset=null and give the shape keys "
                "(hidden_size, num_layers, num_heads, ...) yourself."
            )
        merged = dict(PRESETS[preset]) if preset is not None else {}
        merged.update({k: v for k, v in data.items() if v is not None or k == "preset"})
        return cls._derived_defaults(merged)

    @classmethod
    def _fill_from_hf(cls, data: dict, source: str) -> dict:
        """A Hugging Face config's values are the defaults, as a preset's are. A config resolved
        before (a run's config.yaml, a checkpoint's meta.json) names every key: then the folder
        need not exist any more (export and generate read such configs)."""
        key = "from_hf" if data.get("from_hf") else "hf_config"
        if data.get("from_hf") and data.get("hf_config"):
            raise ConfigError("model.from_hf and model.hf_config are both given: from_hf already "
                              "takes the architecture from the folder's config.json. Keep one.")
        if data.get("preset"):
            raise ConfigError(f"model.preset={data['preset']!r} and model.{key}={source!r} both "
                              "give the model's shape. Set model.preset=null (or leave it out).")
        given = {k: v for k, v in data.items() if v is not None}
        try:
            merged = hf_arch.model_keys(source)
        except hf_arch.HFConfigError as exc:
            if not all(k in given for k in _SHAPE_KEYS):
                raise ConfigError(f"model.{key}: {exc}") from None
            merged = {}
        merged.update(given)
        merged["preset"] = None
        return cls._derived_defaults(merged)

    @staticmethod
    def _derived_defaults(merged: dict) -> dict:
        """Defaults that follow from other keys."""
        h, heads = merged.get("hidden_size") or 0, merged.get("num_heads") or 0
        if not merged.get("num_kv_heads"):
            merged["num_kv_heads"] = heads
        merged.setdefault("tie_embeddings", False)
        if not merged.get("rope_theta"):
            merged["rope_theta"] = 10000.0
        if not merged.get("head_dim") and heads and h % heads == 0:
            merged["head_dim"] = h // heads  # (left 0 otherwise: the rules say why)
        return merged

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
        """Training FLOPs per token: 6N + 12 L h s (forward + backward, attention scores included).

        N counts the parameters that do matmuls on each token: every block and the output head
        (the input embedding is a lookup, but we keep the common convention of counting it once
        through the head, whether tied or not). Of a mixture of experts, only the active
        parameters count: the router, the shared experts and the top-k routed experts
        (params.active_params).
        """
        n = params.active_params(self) + self.vocab_size * self.hidden_size
        return 6.0 * n + 12.0 * self.num_layers * self.hidden_size * seq_len


class ParallelConfig(_Section):
    # "auto": the world size / (tp x pp x cp), the world size taken from the launcher
    # (validation context `world_size`: WORLD_SIZE under torchrun/srun, the local GPUs otherwise).
    dp: int = Field(2, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    zero: int = Field(0, ge=0, le=3)
    # Hybrid sharding: ZeRO shards inside groups of dp_shard ranks, all-reduces across groups.
    dp_shard: Optional[int] = Field(None, ge=1)
    sequence_parallel: bool = False
    pp_schedule: Literal["afab", "1f1b", "interleaved", "zero_bubble"] = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1)
    # Explicit layer counts per pipeline stage (uneven splits); None balances by count.
    pp_layers: Optional[list[int]] = None
    # Context parallel's attention: K/V around a ring, K/V all-gathered, or Ulysses' all-to-all
    # from sequence-sharded to head-sharded (docs/context_parallel.md).
    cp_mode: Literal["ring", "all_gather", "ulysses"] = "ring"
    # Each cp rank keeps chunks r and 2cp-1-r of the sequence (equal causal work); off: one
    # contiguous chunk each.
    cp_load_balance: bool = True
    bucket_mb: float = Field(25.0, gt=0)
    overlap: bool = True

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
    steps: int = Field(200, ge=1)
    seq_len: int = Field(128, ge=2)
    micro_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: Optional[int] = Field(None, ge=0)  # None: default_warmup(steps)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: Optional[float] = Field(1.0, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    seed: int = 1234
    # muon: Muon for the blocks' matrices, AdamW for the rest (docs/muon.md); lr and
    # weight_decay carry over from AdamW (Moonlight's update scale).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_ns_steps: int = Field(5, ge=1)
    # none, selective (attention cores and SwiGLU products), full (whole blocks), or
    # norms_and_mla_up (DeepSeek-V3's: the RMSNorms' outputs and MLA's up-projections, recomputed
    # from the tensors saved anyway).
    recompute: Literal["none", "selective", "full", "norms_and_mla_up"] = "none"
    # Multi-token prediction: its losses weigh this much (their mean over the mtp_layers depths).
    mtp_loss_weight: float = Field(0.3, ge=0)
    # Regional compilation: each transformer block's forward through torch.compile (docs/kernels.md).
    compile: bool = False
    compile_cache: Optional[str] = None  # inductor's cache folder; None: torch's default
    # Fused kernels: triton, torch (the references in models/ops.py), or auto (Triton on CUDA when
    # installed and blocks are not compiled, else torch).
    kernels: Literal["auto", "triton", "torch"] = "auto"
    chunked_loss: bool = False  # the loss a chunk of tokens at a time: never the full logits
    # The loss on the validation split (data.val_source or data.val_fraction) every N steps;
    # 0: at the last step only, when there is a validation split.
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(4, ge=1)  # global batches of validation sequences per evaluation

    @model_validator(mode="after")
    def _fill_warmup(self) -> "TrainingConfig":
        if self.warmup_steps is None:
            self.warmup_steps = default_warmup(self.steps)
        return self


class PrecisionConfig(_Section):
    # Compute dtype (docs/precision.md). "auto": bf16 on CUDA and on CPUs with bf16 instructions,
    # fp32 on other CPUs, resolved once before launch (devices.resolve_dtype).
    dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    master_dtype: Literal["fp32"] = "fp32"
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    # fp16: the loss is multiplied by a scale that halves on an overflow (the step is skipped) and
    # doubles after `loss_scale_window` clean steps. fp16 without it is refused. The loss is a
    # token mean, so gradients are O(1) even in a spike: 2^10 leaves room for elements up to 64
    # (docs/precision.md: PyTorch's 2^16 skips the steps of the first spike).
    loss_scaling: Literal["dynamic", "none"] = "dynamic"
    loss_scale_init: float = Field(1024.0, gt=0)
    loss_scale_window: int = Field(1000, ge=1)
    # fp8: how the matmul inputs are scaled (tensorwise, rowwise, or DeepSeek-V3's blockwise: 1x128
    # tiles of activations and gradients, 128x128 blocks of weights), the 8-bit format of the
    # gradients (the forward is e4m3), and whether to run the exact reference (quantise,
    # dequantise, fp32 matmul) instead of the device's scaled matmul.
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise"] = "tensorwise"
    fp8_backward: Literal["e5m2", "e4m3"] = "e5m2"
    fp8_emulate: bool = False

    def summary(self, dtype: str | None = None) -> str:
        """What a run computes in what, in words (`ultrascale train`'s header); `dtype`: the
        resolved one when this says auto. An FP8 recipe runs on the device's scaled matmul unless
        `fp8_emulate` (a device without it is refused before launch)."""
        dtype = dtype or self.dtype
        if dtype == "fp32":
            return "fp32 throughout"
        if dtype == "auto":
            return "auto (resolved before launch)"
        parts = [f"{'bf16' if dtype == 'fp8' else dtype} parameters and activations",
                 f"{self.master_dtype} master weights",
                 f"{self.grad_accum_dtype} gradient accumulation",
                 "fp32 norm statistics, softmax and loss"]
        if dtype == "fp8":
            how = ("EMULATED (precision.fp8_emulate: quantise, dequantise, fp32 matmul)"
                   if self.fp8_emulate else "on the device's scaled matmul")
            parts.insert(0, f"fp8 matmuls in the blocks ({self.fp8_recipe} scales, e4m3 forward, "
                            f"{self.fp8_backward} backward, fp32 accumulation, {how})")
        if dtype == "fp16":
            parts.append(f"dynamic loss scaling from {self.loss_scale_init:g} (halved on "
                         f"overflow, doubled after {self.loss_scale_window} clean steps)")
        return ", ".join(parts)


class DataConfig(_Section):
    # "builtin" (Python's own pydoc topics), a .txt/.md/.jsonl/.parquet file, a folder of them, a
    # folder written by `datasets`' save_to_disk, or a .bin written by `ultrascale tokenize`.
    source: str = "builtin"
    # "byte", a local tokenizer.json, or a local Hugging Face model folder holding one.
    tokenizer: str = "byte"
    text_key: str = "text"  # the field (JSON-lines, Parquet, datasets) that holds the text
    val_source: Optional[str] = None  # validation data, in any form `source` takes
    val_fraction: float = Field(0.0, ge=0, lt=1)  # or the last fraction of source's sequences


class CheckpointConfig(_Section):
    dir: Optional[str] = None  # default: <run dir>/checkpoints
    every: int = Field(0, ge=0)  # 0: only at the end
    keep: int = Field(2, ge=1)
    resume: str = "none"  # none, auto (newest in dir) or a checkpoint path, in any layout
    # Write checkpoints in a background thread while training goes on (still atomic).
    async_save: bool = False


class LoggingConfig(_Section):
    run_dir: Optional[str] = None  # default: runs/<UTC timestamp>
    metrics_file: Optional[str] = None  # default: <run dir>/metrics.jsonl
    every: int = Field(10, ge=1)
    tensorboard: bool = False
    wandb: bool = False
    progress: bool = True
    measure_memory: bool = False
    sample_tokens: int = Field(120, ge=0)  # length of the text sample printed at the end


class LaunchConfig(_Section):
    """How the ranks are started and watched (the launcher's checks and limits)."""

    # A rank that waits this long in one collective ends the run. None: 300 s for the ranks this
    # machine starts itself, 600 s under torchrun/srun (torch's own default is 30 minutes).
    collective_timeout_s: Optional[float] = Field(None, gt=0)
    # Local processes allowed; None: 4 per CPU core on CPUs, the visible GPUs on CUDA.
    max_local_ranks: Optional[int] = Field(None, ge=1)
    # Refuse to start when the memory estimate exceeds the device (or the RAM the ranks share).
    memory_check: bool = True
    # A memory budget per rank, GiB (e.g. a GPU's memory, emulated on CPUs): refuse a launch whose
    # estimate per rank exceeds it. None: no budget besides the device or the RAM.
    memory_per_rank_gib: Optional[float] = Field(None, gt=0)


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

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
    def _check_layout(self) -> "Config":
        t, d = self.training, self.data
        if d.val_source is not None and d.val_fraction:
            raise ConfigError(f"data.val_source={d.val_source!r} and data.val_fraction="
                              f"{d.val_fraction} both give a validation split. Keep one.")
        if t.eval_every and d.val_source is None and not d.val_fraction:
            raise ConfigError(f"training.eval_every={t.eval_every} but there is no validation "
                              "split: set data.val_source (a file or folder) or data.val_fraction "
                              "(e.g. 0.05), or training.eval_every=0.")
        # The layout rules read no dtype: an unresolved `auto` is fine here.
        broken = layout_violations(self.model, Layout.from_config(self, self.precision.dtype),
                                   self.parallel.pp_layers) + precision_violations(self.precision)
        broken += training_violations(self.training)
        if broken:
            raise ConfigError(broken[0].message)
        if t.warmup_steps > t.steps:
            raise ConfigError(
                f"training.warmup_steps={t.warmup_steps} exceeds training.steps={t.steps}: "
                "the learning rate would never reach its peak. Lower warmup_steps, or leave it "
                f"out (the default is a tenth of the steps: {default_warmup(t.steps)})."
            )
        return self

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro_batch_size x grad_accum_steps x dp."""
        t = self.training
        return t.micro_batch_size * t.grad_accum_steps * self.parallel.dp

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Loading: YAML + overrides, with errors turned into one readable paragraph each.


def _known_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def known_keys() -> list[str]:
    """Every key of the tree, dotted (`training.lr`, ..., `device`), in declaration order."""
    return _known_keys(Config)


# The names other trainers (Megatron, torchtitan, DeepSpeed, Hugging Face) give our keys: a user
# who types theirs is pointed at ours, where spelling alone would suggest a wrong neighbour.
ALIASES = {
    **dict.fromkeys(["tensor_parallel", "tensor_model_parallel_size", "tensor_parallel_degree",
                     "tensor_parallel_size", "tp_size"], "parallel.tp"),
    **dict.fromkeys(["data_parallel", "data_parallel_size", "data_parallel_degree",
                     "data_parallel_shard_degree", "dp_size"], "parallel.dp"),
    **dict.fromkeys(["pipeline_parallel", "pipeline_model_parallel_size",
                     "pipeline_parallel_degree", "pipeline_parallel_size", "pp_size"],
                    "parallel.pp"),
    **dict.fromkeys(["context_parallel", "context_parallel_size", "context_parallel_degree",
                     "cp_size"], "parallel.cp"),
    **dict.fromkeys(["expert_parallel", "expert_model_parallel_size", "expert_parallel_degree",
                     "ep_size"], "parallel.ep"),
    **dict.fromkeys(["zero_stage", "zero_optimization"], "parallel.zero"),
    **dict.fromkeys(["learning_rate"], "training.lr"),
    **dict.fromkeys(["max_steps", "train_iters", "train_steps", "iterations"], "training.steps"),
    **dict.fromkeys(["seq_length", "sequence_length", "max_seq_len", "seq"], "training.seq_len"),
    **dict.fromkeys(["batch_size", "micro_batch", "mbs", "per_device_train_batch_size"],
                    "training.micro_batch_size"),
    **dict.fromkeys(["gradient_accumulation_steps", "grad_accum", "accumulation_steps"],
                    "training.grad_accum_steps"),
    **dict.fromkeys(["warmup", "warmup_iters", "lr_warmup_steps", "lr_warmup_iters"],
                    "training.warmup_steps"),
    **dict.fromkeys(["activation_checkpointing", "gradient_checkpointing", "recompute_granularity",
                     "ac"], "training.recompute"),
    **dict.fromkeys(["clip_grad", "max_norm", "max_grad_norm", "gradient_clipping"],
                    "training.grad_clip"),
    **dict.fromkeys(["save_interval", "checkpoint_interval"], "checkpoint.every"),
    **dict.fromkeys(["log_interval", "log_freq"], "logging.every"),
    **dict.fromkeys(["mixed_precision", "param_dtype"], "precision.dtype"),
}


def suggest_key(loc: str) -> str | None:
    """The key meant by an unknown `loc`: the section first (closest section name), then the key
    within it (exact, another trainer's name for it, the closest spelling), then the same key in
    another section."""
    sections = {name: f.annotation for name, f in Config.model_fields.items()}
    parts = loc.split(".")
    sec, rest = parts[0], parts[1:]
    if sec not in sections:
        if sec in ALIASES:
            return ALIASES[sec]
        close = difflib.get_close_matches(sec, list(sections), n=1, cutoff=0.6)
        if close:
            sec = close[0]
        elif not rest:  # a key given without its section, e.g. `lr`
            return _key_anywhere(sec)
        else:
            return _key_anywhere(rest[0])
    if not rest:
        return sec
    ann = sections[sec]
    if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
        return sec  # `device` has no keys below it
    key, fields = rest[0], list(ann.model_fields)
    if key in fields:
        return f"{sec}.{key}"
    if key in ALIASES:
        return ALIASES[key]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"{sec}.{close[0]}"
    return _key_anywhere(key)


def _key_anywhere(key: str) -> str | None:
    if key in ALIASES:
        return ALIASES[key]
    keys = known_keys()
    exact = [k for k in keys if k.split(".")[-1] == key]
    if exact:
        return exact[0]
    close = difflib.get_close_matches(key, [k.split(".")[-1] for k in keys], n=1, cutoff=0.75)
    return next((k for k in keys if close and k.split(".")[-1] == close[0]), None)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigError):
            lines.append(str(ctx_err))
        elif e["type"] == "extra_forbidden":
            # An unknown section comes as one error: name each key under it.
            sub = e.get("input")
            locs = [f"{loc}.{k}" for k in sub] if len(e["loc"]) == 1 and isinstance(sub, dict) \
                and sub else [loc]
            for full in locs:
                close = suggest_key(full)
                hint = f" Did you mean `{close}`?" if close and close != full else ""
                lines.append(f"Unknown configuration key `{full}`.{hint} Every key, with its "
                             "default and meaning: `ultrascale config keys`.")
        else:
            lines.append(f"`{loc}` = {e.get('input')!r} is invalid: {e['msg']}. "
                         "Fix the value in the YAML file or the --set override.")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} has no '=': an override is one word, "
                          f"section.key=value: --set {item}=VALUE (e.g. --set training.lr=1e-3).")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {item!r} names no key: write --set section.key=value.")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def build_config(data: dict | None = None, overrides: list[str] = (),
                 world_size: int | None = None) -> Config:
    """Validate a nested dict plus `section.key=value` overrides into a Config, or raise ConfigError.

    world_size: the launcher's (WORLD_SIZE, or the local GPUs), which `parallel.dp: auto` divides.
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
        return Config.model_validate(data, context={"world_size": world_size})
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                world_size: int | None = None) -> Config:
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
    return build_config(data, overrides, world_size)


def round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)
