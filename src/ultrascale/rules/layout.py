"""A layout against a model: tp divides the heads and the MLP, the pipeline stages split the
layers, cp and sequence parallel split the sequence, ep divides dp and the experts, dp_shard divides
dp; the values a `Layout` can hold and no run can take; a fixed global batch's accumulation; when
ZeRO-3 gathers."""

from __future__ import annotations

from typing import Optional, Sequence

from ultrascale.layout import DTYPE_BYTES
from ultrascale.rules.pipeline import SCHEDULES, pipeline_split_violations
from ultrascale.rules.violation import Violation, divisors

CP_MODES = ("ring", "all_gather", "ulysses")
RECOMPUTE = ("none", "selective", "full", "norms_and_mla_up")
ZERO_STAGES = (0, 1, 2, 3)
ZERO3_GATHER = ("auto", "step", "micro_batch")


def zero3_gathers_per_step(mode: str, pp: int) -> bool:
    """Whether ZeRO-3 gathers each unit once a step and keeps it through the micro-batches
    (`parallel.zero3_gather`). auto: under pp, where a stage's parameters are 1/pp of the model
    and gathering them for each of a step's 2m forwards and backwards moves 2m times the bytes
    (benchmarks/bench_pipeline_zero3.py measures both); without pp, for each use, so that the
    whole model is never held gathered."""
    if mode not in ZERO3_GATHER:
        raise ValueError(f"parallel.zero3_gather={mode!r} is not one of {', '.join(ZERO3_GATHER)}")
    return mode == "step" or (mode == "auto" and pp > 1)


def accumulation_for(global_batch: int, micro_batch: int, dp: int,
                     given: Optional[int] = None) -> tuple[int, Optional[Violation]]:
    """The grad_accum_steps a fixed global batch takes at this micro-batch and dp (`given`: the
    one the user also wrote, which must agree), or the violation."""
    per_step = micro_batch * dp
    if global_batch % per_step:
        return 0, Violation(
            "training.global_batch_size", global_batch,
            f"training.global_batch_size={global_batch} is not a multiple of micro_batch_size x "
            f"dp = {micro_batch} x {dp} = {per_step}",
            f"give a multiple of {per_step} (e.g. {max(1, global_batch // per_step) * per_step}), "
            "or another training.micro_batch_size")
    accum = global_batch // per_step
    if given is not None and given != accum:
        return accum, Violation(
            "training.grad_accum_steps", given,
            f"training.grad_accum_steps={given} and training.global_batch_size={global_batch} "
            f"disagree: at micro_batch_size {micro_batch} and dp {dp} the global batch takes "
            f"grad_accum_steps={accum}", "Give one of the two")
    return accum, None


def layout_violations(model, layout, pp_layers: Optional[Sequence[int]] = None,
                      rank_layers: Optional[Sequence[int]] = None) -> list[Violation]:
    """The rules any runtime needs. `pp_layers`: layers of each of the pp x v stages (the config's
    `parallel.pp_layers`); `rank_layers`: layers of each pipeline rank, where a rank may hold
    none (a cost-balanced split, the estimator's input). Without either, pp x v divide the layers.
    """
    lay, out = layout, []
    heads, ffn, layers = model.num_heads, model.ffn_hidden_size, model.num_layers
    tp, pp, v = lay.tp, lay.pp, lay.pp_virtual_stages
    if heads % tp:
        mla = getattr(model, "attention", "mha") == "mla"
        out.append(Violation("parallel.tp", tp,
                             f"parallel.tp={tp} does not divide model.num_heads={heads}: tensor "
                             "parallel gives each rank whole attention heads" + (
                                 " (MLA's up-projections and output projection are split by "
                                 "heads; its down-projections and latent norms are replicated)"
                                 if mla else ""),
                             f"Choose tp among {divisors(heads)}"))
    if ffn % tp:
        out.append(Violation("parallel.tp", tp,
                             f"parallel.tp={tp} does not divide model.ffn_hidden_size={ffn}",
                             f"Choose tp among {[d for d in divisors(heads) if ffn % d == 0]}"))
    width = getattr(model, "moe_ffn_hidden_size", 0) or ffn
    if model.num_experts and width % tp:
        out.append(Violation("parallel.tp", tp,
                             f"parallel.tp={tp} does not divide each expert's width "
                             f"model.moe_ffn_hidden_size={width} (tensor parallel splits every "
                             "expert as it splits the MLP)",
                             f"Choose tp among {[d for d in divisors(heads) if width % d == 0]}"))
    out += pipeline_split_violations(layers, pp, v, pp_layers, rank_layers)
    if v > 1 and lay.pp_schedule not in ("interleaved", "dualpipev"):
        out.append(Violation("parallel.pp_virtual_stages", v,
                             f"parallel.pp_virtual_stages={v} only applies to parallel.pp_schedule="
                             f"interleaved or dualpipev (got {lay.pp_schedule!r})",
                             "Set the schedule to interleaved or pp_virtual_stages to 1"))
    if lay.dp_shard and lay.dp % lay.dp_shard:
        out.append(Violation("parallel.dp_shard", lay.dp_shard,
                             f"parallel.dp_shard={lay.dp_shard} does not divide parallel.dp="
                             f"{lay.dp}: hybrid sharding splits dp into groups of dp_shard ranks",
                             f"Choose dp_shard among {divisors(lay.dp)}"))
    out += sequence_violations(lay)
    mtp = getattr(model, "mtp_layers", 0)
    if mtp and mtp >= lay.seq_len:
        out.append(Violation("model.mtp_layers", mtp,
                             f"model.mtp_layers={mtp} predicts tokens up to {mtp + 1} ahead, and "
                             f"a sequence of training.seq_len={lay.seq_len} holds no target that "
                             "far for its last depth",
                             f"Choose mtp_layers at most {lay.seq_len - 1}, or a longer "
                             "seq_len"))
    out += context_violations(model, lay)
    if lay.ep > 1:
        out += expert_parallel_violations(model, lay)
    return out


def expert_parallel_violations(model, lay) -> list[Violation]:
    """ep is carved out of dp (dp = edp x ep) and splits the experts: it divides both (and, with
    hybrid sharding, dp_shard: the ep ranks lie inside one shard group). With
    group-limited routing the ep ranks hold the experts group by group (each rank whole groups,
    or each group whole ranks), so that a token's exchange reaches the ranks of its groups."""
    experts, ep, dp = model.num_experts, lay.ep, lay.dp
    if not experts:
        return [Violation("parallel.ep", ep,
                          f"parallel.ep={ep} needs a mixture-of-experts model "
                          "(model.num_experts > 0)", "Set parallel.ep=1 for a dense model")]
    if dp % ep or experts % ep:
        fits = [d for d in divisors(dp) if experts % d == 0]
        return [Violation("parallel.ep", ep,
                          f"parallel.ep={ep} must divide parallel.dp={dp} (experts are spread "
                          f"over data-parallel ranks: dp = edp x ep) and model.num_experts="
                          f"{experts} (each ep rank holds num_experts / ep of them)",
                          f"Choose ep among {fits}, or raise parallel.dp to a multiple of {ep}")]
    shard = lay.dp_shard
    if shard and shard < dp and shard % ep:
        return [Violation("parallel.ep", ep,
                          f"parallel.ep={ep} must divide parallel.dp_shard={shard}: with hybrid "
                          "sharding the expert-parallel ranks lie inside one shard group (dp = "
                          "dp_replicate x dp_shard, dp_shard = expert shards x ep)",
                          f"Choose ep among {[d for d in divisors(shard) if experts % d == 0]}, "
                          f"or dp_shard a multiple of {ep}")]
    groups = getattr(model, "router_groups", 1)
    if groups > 1 and groups % ep and ep % groups:
        fits = [d for d in divisors(dp) if experts % d == 0 and (groups % d == 0
                                                                 or d % groups == 0)]
        return [Violation("parallel.ep", ep,
                          f"parallel.ep={ep} cuts the model.router_groups={groups} expert groups "
                          "unevenly: the ep ranks hold the experts group by group, so ep must "
                          "divide the groups or be a multiple of them",
                          f"Choose ep among {fits}")]
    return []


def sequence_violations(layout) -> list[Violation]:
    """Context parallel gives each cp rank two balanced chunks of the sequence: seq_len / cp
    tokens, which sequence parallel splits further over tp. So 2 cp divides seq_len, and tp
    divides seq_len / cp (with cp = 1: tp divides seq_len)."""
    seq, cp, tp, out = layout.seq_len, layout.cp, layout.tp, []
    if cp > 1 and seq % (2 * cp):
        out.append(Violation("training.seq_len", seq,
                             f"training.seq_len={seq} is not divisible by 2 x parallel.cp={2 * cp} "
                             "(each context-parallel rank takes two balanced chunks)",
                             "Change seq_len or cp"))
    local = seq // cp
    if layout.sequence_parallel and tp > 1 and local % tp:
        if cp == 1:
            out.append(Violation("training.seq_len", seq,
                                 f"training.seq_len={seq} is not divisible by parallel.tp={tp}, "
                                 "which sequence parallel needs",
                                 "Change seq_len or turn parallel.sequence_parallel off"))
        else:
            out.append(Violation("training.seq_len", seq,
                                 f"training.seq_len={seq} / parallel.cp={cp} = {local} tokens per "
                                 f"context-parallel rank are not divisible by parallel.tp={tp}, "
                                 "which sequence parallel needs (it splits each cp rank's tokens "
                                 "over tp)",
                                 "Change seq_len, cp or tp, or turn "
                                 "parallel.sequence_parallel off"))
    return out


def context_violations(model, layout) -> list[Violation]:
    """What context parallel's attention needs besides the sequence split: Ulysses trades the
    sequence split for a head split, so cp divides the query heads of each tp rank (kv heads that
    cp does not divide are replicated up to a multiple of cp)."""
    cp, tp, mode = layout.cp, layout.tp, getattr(layout, "cp_mode", "ring")
    heads = model.num_heads
    if cp == 1 or mode != "ulysses" or heads % tp:
        return []
    local = heads // tp
    if local % cp:
        fits = [c for c in divisors(local) if c > 1]
        what = f"model.num_heads={heads}" if tp == 1 else \
            f"model.num_heads / parallel.tp = {heads} / {tp} = {local}"
        return [Violation("parallel.cp", cp,
                          f"parallel.cp_mode=ulysses splits the attention heads over cp, and "
                          f"parallel.cp={cp} does not divide {what}",
                          f"Choose cp among {fits or [1]}, or parallel.cp_mode=ring or all_gather")]
    return []


# A layout field -> (the config key that feeds it, the least value that key takes: its `ge`,
# which tests/test_rules.py checks against the declaration).
MINIMUMS = {"dp": ("parallel.dp", 1), "tp": ("parallel.tp", 1), "pp": ("parallel.pp", 1),
            "cp": ("parallel.cp", 1), "ep": ("parallel.ep", 1),
            "mbs": ("training.micro_batch_size", 1),
            "grad_accum": ("training.grad_accum_steps", 1), "seq_len": ("training.seq_len", 2),
            "pp_virtual_stages": ("parallel.pp_virtual_stages", 1)}


def value_violations(layout) -> list[Violation]:
    """Values a `Layout` can hold and no run can take (the config's types refuse them first)."""
    out = []
    for name, (key, least) in MINIMUMS.items():
        if getattr(layout, name) < least:
            out.append(Violation(key, getattr(layout, name),
                                 f"{key}={getattr(layout, name)} must be at least {least}"))
    if layout.zero not in ZERO_STAGES:
        out.append(Violation("parallel.zero", layout.zero,
                             f"parallel.zero={layout.zero} is not a ZeRO stage",
                             "Choose 0, 1, 2 or 3"))
    if layout.dtype == "auto":
        out.append(Violation("precision.dtype", "auto",
                             "precision.dtype=auto is resolved before a layout is predicted",
                             "Give the dtype the run computes in (devices.resolve_dtype: bf16 on "
                             "CUDA and on CPUs with bf16 instructions, fp32 on other CPUs)"))
    for key, value, known in (("training.recompute", layout.recompute, RECOMPUTE),
                              ("parallel.pp_schedule", layout.pp_schedule, SCHEDULES),
                              ("parallel.zero3_gather", getattr(layout, "zero3_gather", "auto"),
                               ZERO3_GATHER),
                              ("parallel.cp_mode", getattr(layout, "cp_mode", "ring"), CP_MODES),
                              ("precision.dtype", layout.dtype, tuple(DTYPE_BYTES)),
                              ("precision.master_dtype", layout.master_dtype, tuple(DTYPE_BYTES)),
                              ("precision.grad_accum_dtype", layout.grad_accum_dtype,
                               tuple(DTYPE_BYTES))):
        if value not in known and (key, value) != ("precision.dtype", "auto"):
            out.append(Violation(key, value, f"{key}={value!r} is unknown",
                                 f"Choose one of {', '.join(known)}"))
    for name, key in (("fp8_cache", "fp8_cache_activations"), ("fp8_experts", "fp8_experts")):
        if getattr(layout, name, False) and layout.dtype not in ("fp8", "auto"):
            out.append(Violation(f"precision.{key}", True,
                                 f"precision.{key}=true acts on FP8 matmuls, and precision.dtype="
                                 f"{layout.dtype!r} has none",
                                 f"Set precision.dtype=fp8, or precision.{key}=false"))
    return out
