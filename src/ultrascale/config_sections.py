"""The run's sections of the configuration tree (config.py) besides the model: parallel, training,
precision, data, checkpoint, logging and launch.

How to add a key: see the note at the top of config.py (declare it once, `key(...)`, in its
section here).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ValidationInfo, model_validator

from ultrascale.config_fields import ConfigError, Section, key
from ultrascale.layout import DTYPE_BYTES, with_schedule_chunks

DTYPES = tuple(DTYPE_BYTES)  # what the estimator and the planner size (the engine: fewer)


class ParallelConfig(Section):
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
    pp_virtual_stages: int = key(1, "model chunks per pipeline rank (interleaved; dualpipev's "
                                    "V is 2, its default)", layout="pp_virtual_stages", ge=1)
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

    @model_validator(mode="before")
    @classmethod
    def _dualpipev_chunks(cls, data: Any) -> Any:
        return with_schedule_chunks(data) if isinstance(data, dict) else data

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def default_warmup(steps: int) -> int:
    """Warm-up when training.warmup_steps is not given: a tenth of the run, at most 1000 steps
    (200 steps warm up for 20; a 5-step smoke test starts at the peak rate)."""
    return min(steps // 10, 1000)


class TrainingConfig(Section):
    steps: int = key(200, "optimizer steps", ge=1,
                     aliases=("max_steps", "train_iters", "train_steps", "iterations"))
    seq_len: int = key(128, "tokens per sequence", layout="seq_len", ge=2,
                       aliases=("seq_length", "sequence_length", "max_seq_len", "seq"))
    micro_batch_size: int = key(8, "sequences per micro-batch per dp rank", layout="mbs", ge=1,
                                aliases=("batch_size", "micro_batch", "mbs",
                                         "per_device_train_batch_size", "local_batch_size"))
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
            "activation_checkpointing", "gradient_checkpointing", "recompute_granularity", "ac",
            "activation_checkpoint"))
    mtp_loss_weight: float = key(0.3, "multi-token prediction: weight of the MTP losses' mean "
                                      "over the depths", ge=0)
    compile: bool = key(False, "compile each transformer block's forward with torch.compile")
    compile_cache: Optional[str] = key(None, "inductor's cache folder (null: torch's default)")
    # auto: Triton on CUDA when installed and blocks are not compiled (inductor fuses them), else
    # the references of models/ops.py.
    kernels: Literal["auto", "triton", "torch"] = key(
        "auto", "fused kernels for RMSNorm, rotary, SwiGLU: auto, triton, torch")
    chunked_loss: bool = key(False, "head and cross-entropy a chunk of tokens at a time (no full "
                                    "logits)", layout="chunked_loss")
    # The validation split: data.val_source or data.val_fraction.
    eval_every: int = key(0, "validation loss every N steps (0: at the last step only)", ge=0)
    eval_batches: int = key(4, "global batches of validation sequences per evaluation", ge=1)

    @model_validator(mode="after")
    def _fill_warmup(self) -> "TrainingConfig":
        if self.warmup_steps is None:
            self.warmup_steps = default_warmup(self.steps)
        return self


class PrecisionConfig(Section):
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
    # DeepSeek-V3's low-precision storage (docs/precision.md): the forward's own quantisation of a
    # linear's input is what backward keeps, in place of the bf16 input.
    fp8_cache_activations: bool = key(
        False, "fp8: keep each FP8 linear's input for backward as the forward quantised it "
               "(e4m3 and a scale per tile), and each SwiGLU's gate and up in e4m3, not in bf16",
        layout="fp8_cache")
    fp8_experts: bool = key(
        False, "fp8: the routed experts' grouped GEMMs in FP8 too (else bf16)",
        layout="fp8_experts")

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
            if self.fp8_experts:
                which += " and the routed experts"
            kept = ", inputs kept in e4m3 for backward" if self.fp8_cache_activations else ""
            parts.insert(0, f"fp8 matmuls in {which} ({self.fp8_recipe} scales, e4m3 forward, "
                            f"{self.fp8_backward} backward, fp32 accumulation, {how}{kept})")
        if dtype == "fp16":
            parts.append(f"dynamic loss scaling from {self.loss_scale_init:g} (halved on "
                         f"overflow, doubled after {self.loss_scale_window} clean steps)")
        return ", ".join(parts)


class DataConfig(Section):
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
                                        "content}] messages (ShareGPT's [{from, value}] too)")
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


class CheckpointConfig(Section):
    dir: Optional[str] = key(None, "where step_XXXXXXXX/ folders go (null: "
                                   "<run_dir>/checkpoints)")
    every: int = key(0, "save every N steps (0: only the last step)", ge=0,
                     aliases=("save_interval", "checkpoint_interval", "interval"))
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


class LoggingConfig(Section):
    run_dir: Optional[str] = key(None, "the run's folder (null: a fresh runs/<UTC time>)")
    metrics_file: Optional[str] = key(None, "one JSON line per logged step (null: "
                                            "<run_dir>/metrics.jsonl)")
    every: int = key(10, "log (metrics file and console) every N steps; the first and last always",
                     ge=1, aliases=("log_interval", "log_freq"))
    tensorboard: bool = key(False, "also write TensorBoard scalars (needs tensorboard)")
    wandb: bool = key(False, "also log the metrics to Weights & Biases from rank 0 (needs wandb; "
                             "WANDB_MODE=offline keeps them in the run folder)")
    wandb_project: str = key("ultrascale", "wandb: the project the run is logged to")
    progress: bool = key(True, "console progress: a bar on a terminal, a line per logged step "
                               "otherwise")
    measure_memory: bool = key(False, "record the peak bytes of activations saved for backward")
    sample_tokens: int = key(120, "length of the text sample printed at the end (0: none)", ge=0)


class LaunchConfig(Section):
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
