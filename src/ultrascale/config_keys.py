"""`ultrascale config keys`: every configuration key with its default and what it means.

The meanings live here, one line each, so that the command line can answer without the docs;
docs/configuration.md says the same at more length (a test keeps both complete).
"""

from __future__ import annotations

from pydantic import BaseModel

from ultrascale.config import Config, known_keys

MEANINGS = {
    "model.preset": "named shape whose values are the defaults of the keys below (tiny, llama3-1b, "
                    "llama3-3b, llama3-8b, llama3-70b, llama3-405b, tiny-moe, mixtral-8x7b, "
                    "qwen3-30b-a3b, deepseek-v3, tiny-deepseek); null: give every shape key",
    "model.hidden_size": "width of the residual stream",
    "model.num_layers": "transformer blocks",
    "model.num_heads": "attention query heads",
    "model.num_kv_heads": "key/value heads (fewer than num_heads: grouped-query attention)",
    "model.ffn_hidden_size": "inner width of the SwiGLU MLP",
    "model.vocab_size": "embedding rows; at least the tokenizer's vocabulary",
    "model.tie_embeddings": "share the input embedding with the output head",
    "model.rope_theta": "rotary embedding base",
    "model.norm_eps": "RMSNorm epsilon",
    "model.from_hf": "a local Hugging Face folder (config.json + safetensors): architecture and "
                     "weights",
    "model.hf_config": "a Hugging Face config.json (or its folder): architecture only, fresh "
                       "weights",
    "model.architecture": "Hugging Face family written on export: llama, mistral, qwen2, qwen3, "
                          "mixtral, qwen2_moe, qwen3_moe, deepseek_v3, deepseek_v2",
    "model.head_dim": "attention head width (default hidden_size / num_heads)",
    "model.attention_bias": "biases on the q, k, v projections (Qwen2)",
    "model.qk_norm": "RMSNorm over each query and key head before rotary (Qwen3)",
    "model.rope_scaling": "rotary scaling: Llama 3.1's {type: llama3, factor, low_freq_factor, "
                          "high_freq_factor, original_max_positions} or YaRN's {type: yarn, "
                          "factor, original_max_positions, beta_fast, beta_slow, mscale, "
                          "mscale_all_dim} (null: none)",
    "model.sliding_window": "attention window in tokens (Mistral); must be >= training.seq_len",
    "model.num_experts": "mixture of experts: experts per layer (0: dense)",
    "model.experts_top_k": "mixture of experts: experts each token is routed to",
    "model.shared_experts": "mixture of experts: experts every token goes through",
    "model.moe_ffn_hidden_size": "mixture of experts: inner width of each expert (0: ffn_hidden_size)",
    "model.router": "mixture of experts: softmax (top-k of a softmax) or sigmoid (DeepSeek-V3)",
    "model.router_renormalize": "mixture of experts: renormalise the top-k weights to sum 1 (null: "
                                "sigmoid always, softmax when top_k > 1)",
    "model.shared_expert_gate": "mixture of experts: a per-token sigmoid gate scales the shared "
                                "experts' output (Qwen2-MoE)",
    "model.balance": "mixture of experts: aux_loss, aux_free (expert bias moved by the load), "
                     "aux_free_and_aux_loss (both: DeepSeek-V3) or none",
    "model.aux_loss_coeff": "mixture of experts: weight of the sequence-wise auxiliary loss",
    "model.z_loss_coeff": "mixture of experts: weight of the router z-loss (0: off)",
    "model.bias_update_rate": "mixture of experts, aux_free: the expert bias's step per optimizer step",
    "model.capacity_factor": "mixture of experts: tokens an expert takes, x tokens x k / E (null: "
                             "dropless)",
    "model.first_k_dense": "mixture of experts: the first layers keep the dense MLP",
    "model.router_groups": "mixture of experts: the experts in this many equal groups "
                           "(group-limited routing, DeepSeek-V3)",
    "model.router_topk_groups": "mixture of experts: a token chooses among the experts of its "
                                "best this many groups, by their two best scores (null: all)",
    "model.routed_scaling_factor": "mixture of experts: the routed experts' weights times this",
    "model.attention": "mha (multi-head attention) or mla (DeepSeek's multi-head latent "
                       "attention)",
    "model.q_lora_rank": "mla: the query latent's width (0: one query projection)",
    "model.kv_lora_rank": "mla: the key-value latent's width",
    "model.qk_rope_head_dim": "mla: rotary dimensions of each query and key head (the keys' "
                              "shared by the heads)",
    "model.qk_nope_head_dim": "mla: dimensions of each query and key head without rotary",
    "model.v_head_dim": "mla: dimensions of each value head",
    "model.rope_interleave": "mla: rotary dimensions in interleaved pairs (DeepSeek's "
                             "checkpoints), not halves",
    "model.mtp_layers": "multi-token prediction modules (DeepSeek-V3: 1); 0: none",
    "parallel.dp": "data-parallel ranks; auto: the world size / (tp x pp x cp) under torchrun/srun",
    "parallel.tp": "tensor-parallel ranks (divides num_heads and ffn_hidden_size)",
    "parallel.pp": "pipeline stages (pp x pp_virtual_stages divides num_layers)",
    "parallel.cp": "context-parallel ranks (sequence split for attention)",
    "parallel.ep": "expert-parallel ranks, carved out of dp",
    "parallel.zero": "ZeRO stage over the dp ranks: 1 optimizer state, 2 + gradients, 3 + weights",
    "parallel.dp_shard": "hybrid sharding: ZeRO shards inside groups of this many dp ranks",
    "parallel.sequence_parallel": "shard norms and the residual stream along the sequence over tp",
    "parallel.pp_schedule": "pipeline schedule: afab, 1f1b, interleaved, zero_bubble",
    "parallel.pp_virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
    "parallel.pp_layers": "layers of each pipeline stage, for uneven splits (null: even)",
    "parallel.cp_mode": "context-parallel attention: ring, all_gather or ulysses",
    "parallel.cp_load_balance": "cp rank r keeps sequence chunks r and 2cp-1-r (equal causal work)",
    "parallel.bucket_mb": "gradient bucket size of the data-parallel reduction, MB",
    "parallel.overlap": "overlap communication with computation where the strategy can",
    "training.steps": "optimizer steps",
    "training.seq_len": "tokens per sequence",
    "training.micro_batch_size": "sequences per micro-batch per dp rank",
    "training.grad_accum_steps": "micro-batches per optimizer step (the pipeline's micro-batches)",
    "training.lr": "peak learning rate",
    "training.min_lr_ratio": "the cosine decay ends at min_lr_ratio x lr",
    "training.warmup_steps": "linear warm-up steps (null: a tenth of steps, at most 1000)",
    "training.weight_decay": "weight decay on matrices, not on norm weights (AdamW's; Muon's too)",
    "training.grad_clip": "clip the global gradient norm to this (null: off)",
    "training.beta1": "AdamW beta1",
    "training.beta2": "AdamW beta2",
    "training.seed": "initial weights (per parameter name) and data order",
    "training.optimizer": "the optimizer: adamw, or muon (Muon for the blocks' matrices, "
                          "AdamW for the rest)",
    "training.muon_momentum": "muon: the matrices' (Nesterov) momentum",
    "training.muon_ns_steps": "muon: Newton-Schulz iterations that orthogonalise each update",
    "training.recompute": "activation recomputation: none, selective, full, norms_and_mla_up "
                          "(DeepSeek-V3's: the RMSNorms and MLA's up-projections)",
    "training.mtp_loss_weight": "multi-token prediction: weight of the MTP losses' mean over the "
                                "depths",
    "training.compile": "compile each transformer block's forward with torch.compile",
    "training.compile_cache": "inductor's cache folder (null: torch's default)",
    "training.kernels": "fused kernels for RMSNorm, rotary, SwiGLU: auto, triton, torch",
    "training.chunked_loss": "head and cross-entropy a chunk of tokens at a time (no full logits)",
    "training.eval_every": "validation loss every N steps (0: at the last step only)",
    "training.eval_batches": "global batches of validation sequences per evaluation",
    "precision.dtype": "compute dtype: fp32, bf16, fp16, fp8; auto: bf16 on CUDA and on CPUs "
                       "with bf16 instructions, else fp32",
    "precision.master_dtype": "dtype of the weights the optimizer updates",
    "precision.grad_accum_dtype": "dtype gradients accumulate in",
    "precision.loss_scaling": "fp16: dynamic (skip the step and halve the scale on overflow); "
                              "none is refused",
    "precision.loss_scale_init": "fp16: the first loss scale",
    "precision.loss_scale_window": "fp16: clean steps after which the loss scale doubles",
    "precision.fp8_recipe": "fp8 scales: tensorwise, rowwise, blockwise (1x128 / 128x128 tiles)",
    "precision.fp8_backward": "fp8: the gradients' format, e5m2 or e4m3 (forward: e4m3)",
    "precision.fp8_emulate": "fp8: the exact reference (quantise, dequantise, fp32 matmul) "
                             "instead of the device's scaled matmul",
    "data.source": "builtin, .txt/.md/.jsonl/.parquet files or a folder of them, a save_to_disk "
                   "folder, or a .bin from `ultrascale tokenize`",
    "data.tokenizer": "byte (256 tokens, no files), a local tokenizer.json or Hugging Face model "
                      "folder (model.vocab_size follows it)",
    "data.text_key": "the field (JSON-lines, Parquet, datasets) that holds the text",
    "data.val_source": "validation data, in any form data.source takes (null: none)",
    "data.val_fraction": "or hold out this last fraction of data.source's sequences",
    "checkpoint.dir": "where step_XXXXXXXX/ folders go (null: <run_dir>/checkpoints)",
    "checkpoint.every": "save every N steps (0: only the last step)",
    "checkpoint.keep": "keep the newest N checkpoints",
    "checkpoint.resume": "none, auto (the newest in dir) or a checkpoint folder, saved in any "
                         "layout (docs/checkpoints.md)",
    "checkpoint.async_save": "write checkpoints in the background while training goes on (one "
                             "host copy of the rank's state meanwhile; still atomic)",
    "logging.run_dir": "the run's folder (null: a fresh runs/<UTC time>)",
    "logging.metrics_file": "one JSON line per logged step (null: <run_dir>/metrics.jsonl)",
    "logging.every": "log (metrics file and console) every N steps; the first and last always",
    "logging.tensorboard": "also write TensorBoard scalars (needs tensorboard)",
    "logging.wandb": "refused: not implemented",
    "logging.progress": "console progress: a bar on a terminal, a line per logged step otherwise",
    "logging.measure_memory": "record the peak bytes of activations saved for backward",
    "logging.sample_tokens": "length of the text sample printed at the end (0: none)",
    "device": "auto (CUDA when present, else CPU), cpu or cuda",
    "launch.collective_timeout_s": "a rank waiting this long in one collective ends the run "
                                   "(null: 300 s for local runs, 600 s under torchrun/srun)",
    "launch.max_local_ranks": "most processes started on this machine (null: 4 per CPU core, "
                              "or the visible GPUs)",
    "launch.memory_check": "refuse a run whose memory estimate exceeds the device or the RAM",
    "launch.memory_per_rank_gib": "refuse a run whose estimate per rank exceeds this many GiB "
                                  "(a device budget, emulated on CPUs; null: none)",
}


PRESET_FILLED = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                 "vocab_size", "tie_embeddings", "rope_theta", "head_dim", "num_experts",
                 "experts_top_k", "shared_experts")


def _default(key: str) -> str:
    node: type[BaseModel] = Config
    *sections, name = key.split(".")
    for sec in sections:
        node = node.model_fields[sec].annotation
    field = node.model_fields[name]
    if sections == ["model"] and name in PRESET_FILLED:
        # A preset (or a Hugging Face config) fills these; 0 means "from the preset".
        return "from preset"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def rows(section: str | None = None) -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key, or those of one section."""
    out = []
    for key in known_keys():
        if section and key.split(".")[0] != section:
            continue
        out.append((key, _default(key), MEANINGS.get(key, "")))
    return out


def format_keys(section: str | None = None) -> str:
    table = rows(section)
    w_key = max(len(k) for k, _, _ in table)
    w_def = max(len(d) for _, d, _ in table)
    return "\n".join(f"{k:<{w_key}}  {d:<{w_def}}  {m}" for k, d, m in table)
