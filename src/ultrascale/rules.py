"""Layout rules, once: what must divide what, and what our engine runs today.

Config validation (config.py), the memory estimator, the planner's search and the engine's
pre-launch check (`parallel.support.check_supported`) all ask these functions instead of keeping
rules of their own (the pipeline executor's `validate_schedule` still guards its direct callers
with the same schedule rules). Each returns the rules a model or layout breaks, as `Violation`s
(key, value, reason, fix), in a fixed order: callers raise the first (or all) in their own error
type.

- `model_violations(model)`: the model's own shape (heads divide the width, ...);
- `layout_violations(model, layout)`: a layout against a model, whoever runs it (tp divides the
  heads and the MLP, the pipeline stages split the layers, cp and sequence parallel split the
  sequence, ep divides dp and the experts, dp_shard divides dp); `expert_violations` checks a
  mixture of experts' own keys;
- `value_violations(layout)`: values a `Layout` can hold but no run can take (what the config's
  types already refuse);
- `schedule_violations(layout, num_layers)`: what each pipeline schedule needs;
- `engine_violations(model, layout)`: what ultrascale's engine does not run yet (`ENGINE_GAPS`).

And the one convention for stages that do not divide the layers: `layers_per_stage` (the first
stages take the smaller shares), `split_layers` (the engine's ranges).

`model` is anything with `ModelConfig`'s field names, `layout` anything with `Layout`'s: no torch,
no pydantic, no import of the config, so that every part of the package can ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ultrascale.layout import DTYPE_BYTES

SCHEDULES = ("afab", "1f1b", "interleaved", "zero_bubble", "dualpipev")
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


@dataclass(frozen=True)
class Violation:
    """One broken rule: the config key at fault, its value, why it cannot be, and what to do."""

    key: str
    value: Any
    reason: str
    fix: str = ""  # empty where the reason already says what to do
    gap: bool = False  # a gap in our engine (ENGINE_GAPS), not a rule of the layout

    @property
    def message(self) -> str:
        """One paragraph, as ConfigError shows it: the reason, then the fix."""
        if self.gap:
            return f"{self.reason}; {_sentence(self.fix)}"
        return _sentence(self.reason) + (" " + _sentence(self.fix) if self.fix else "")

    def line(self) -> str:
        """`key=value: why.`, one line of the engine's refusal (`check_supported`)."""
        return f"{self.key}={self.value!r}: {self.message.rstrip('.')}."


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------------------
# The model


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
    if model.num_experts:
        out += expert_violations(model)
    elif getattr(model, "router_groups", 1) > 1:
        out.append(Violation("model.router_groups", model.router_groups,
                             f"model.router_groups={model.router_groups} groups the experts, but "
                             "model.num_experts=0", "Set router_groups=1 for a dense model"))
    return out


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


# ------------------------------------------------------------------------------------------------
# A layout against a model


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
    """ep is carved out of dp (dp = edp x ep) and splits the experts: it divides both. With
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


def pipeline_split_violations(num_layers: int, pp: int, v: int = 1,
                              pp_layers: Optional[Sequence[int]] = None,
                              rank_layers: Optional[Sequence[int]] = None) -> list[Violation]:
    """The layers of the pp x v stages: listed per stage (each at least one), per rank (none
    below zero), or split evenly (pp x v divide them)."""
    stages = pp * v
    if pp_layers is not None:
        if len(pp_layers) != stages or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            return [Violation("parallel.pp_layers", list(pp_layers),
                              f"parallel.pp_layers={list(pp_layers)} must list {stages} positive "
                              "layer counts (pp x pp_virtual_stages) summing to model.num_layers="
                              f"{num_layers}")]
    elif rank_layers is not None:
        if len(rank_layers) != pp or sum(rank_layers) != num_layers or min(rank_layers) < 0:
            return [Violation("pp_layers", list(rank_layers),
                              f"pp_layers={list(rank_layers)} must list pp={pp} layer counts, one "
                              f"per pipeline rank, summing to model.num_layers={num_layers}")]
    elif num_layers % stages:
        return [Violation("parallel.pp", pp,
                          f"parallel.pp={pp} x parallel.pp_virtual_stages={v} does not divide "
                          f"model.num_layers={num_layers}",
                          f"Choose them so their product is among {divisors(num_layers)}, or list "
                          "the layers of each stage in parallel.pp_layers")]
    return []


def layers_per_stage(num_layers: int, stages: int) -> list[int]:
    """Layers of each of `stages` consecutive (virtual) stages, as even as possible, the first
    stages (which also embed) taking the smaller shares: the engine's split, which the estimator
    and the planner assume too. Stages beyond the layers get none (`split_layers` refuses that)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s >= stages - extra else 0) for s in range(stages)]


def split_layers(num_layers: int, pp: int, v: int = 1,
                 pp_layers: Optional[Sequence[int]] = None) -> list[range]:
    """Global layer indices of every virtual stage, in stage order (parallel/pipeline/stage.py
    cuts the model with them). `pp_layers` lists the layer count of each of the pp*v stages;
    otherwise `layers_per_stage`. Raises ValueError unless every stage gets a layer."""
    counts = list(pp_layers) if pp_layers is not None else layers_per_stage(num_layers, pp * v)
    broken = pipeline_split_violations(num_layers, pp, v, counts)
    if broken:
        raise ValueError(broken[0].message)
    bounds, start = [], 0
    for n in counts:
        bounds.append(range(start, start + n))
        start += n
    return bounds


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


_AT_LEAST_ONE = {"dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp",
                 "cp": "parallel.cp", "ep": "parallel.ep", "mbs": "training.micro_batch_size",
                 "grad_accum": "training.grad_accum_steps", "seq_len": "training.seq_len",
                 "pp_virtual_stages": "parallel.pp_virtual_stages"}


def value_violations(layout) -> list[Violation]:
    """Values a `Layout` can hold and no run can take (the config's types refuse them first)."""
    out = []
    for name, key in _AT_LEAST_ONE.items():
        if getattr(layout, name) < 1:
            out.append(Violation(key, getattr(layout, name),
                                 f"{key}={getattr(layout, name)} must be at least 1"))
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
    return out


def schedule_violations(layout, num_layers: Optional[int] = None) -> list[Violation]:
    """What the pipeline schedules need (parallel/pipeline/schedules.py runs them): the
    interleaved one, pp >= 2, v >= 2 and micro-batches in groups of pp; dualpipev, pp >= 2, v = 2
    and at least 2 pp micro-batches; with `num_layers`, at least one layer per virtual stage."""
    pp, v, m, name = layout.pp, layout.pp_virtual_stages, layout.grad_accum, layout.pp_schedule
    out = []

    def bad(reason: str, fix: str) -> None:
        out.append(Violation("parallel.pp_schedule", name, reason, fix))

    if name == "interleaved":
        if pp < 2:
            bad("The 'interleaved' schedule needs pp >= 2 (with one rank there is no bubble to "
                "shrink)", "Use pp_schedule=1f1b or raise parallel.pp")
        if v < 2:
            bad(f"The 'interleaved' schedule needs pp_virtual_stages >= 2 (got {v}); with one "
                "chunk per rank it is plain 1F1B", "Set pp_virtual_stages=2 or pp_schedule=1f1b")
        if pp >= 1 and m % pp:
            # Micro-batches go round the ranks in groups of pp per chunk; a short last group
            # would leave the first rank waiting for its own chunk's input.
            lo, hi = (m // pp) * pp, (m // pp + 1) * pp
            bad(f"The 'interleaved' schedule needs the number of micro-batches (grad_accum_steps="
                f"{m}) to be a multiple of pp={pp}", f"Use {f'{lo} or {hi}' if lo else hi} "
                "micro-batches")
    if name == "dualpipev":
        if pp < 2:
            bad("The 'dualpipev' schedule needs pp >= 2 (its V goes down the ranks and back up)",
                "Use pp_schedule=1f1b or raise parallel.pp")
        if v != 2:
            bad(f"The 'dualpipev' schedule runs two chunks per rank (stages r and 2pp-1-r, the "
                f"V); got pp_virtual_stages={v}", "Set parallel.pp_virtual_stages=2")
        if m < 2 * pp:
            bad(f"The 'dualpipev' schedule needs at least 2 x pp = {2 * pp} micro-batches "
                f"(grad_accum_steps={m})", f"Use {2 * pp} or more")
    if num_layers is not None and num_layers < pp * v:
        bad(f"{num_layers} layers do not fit {pp} pipeline ranks x {v} virtual stages = "
            f"{pp * v} stages (each needs at least one layer)",
            "Lower pp or pp_virtual_stages, or use a deeper model")
    return out


# ------------------------------------------------------------------------------------------------
# Precision (parallel/precision.py runs it; docs/precision.md)

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
FP8_FILTERS = ("all", "auto")


def fp8_pays(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether FP8 is expected to speed up a linear layer x [tokens, in] @ W [out, in].T
    (`precision.fp8_filter=auto`; full, unsplit sizes): the contraction K = in_features and the
    output width N = out_features both multiples of 16 (the scaled matmul's alignment), and above
    torchao's thresholds, which it measured on H100s (torchao/float8 README; its auto filters):
    row-wise (and block-wise, the same per-tile work) needs K > 2048, N > 1024 and not both
    K <= 4096 and N <= 2048; tensor-wise needs K > 1024 or N > 4096. Below them the quantisation
    passes cost as much as the FP8 matmul saves."""
    k, n = in_features, out_features
    if k % 16 or n % 16:
        return False
    if recipe == "tensorwise":
        return k > 1024 or n > 4096
    return k > 2048 and n > 1024 and not (k <= 4096 and n <= 2048)


def precision_violations(precision, native_fp8: Optional[Sequence[str]] = None,
                         device: str = "this device") -> list[Violation]:
    """What no run can take in `precision` (anything with PrecisionConfig's field names): fp16
    without loss scaling, an unknown FP8 recipe; with `native_fp8` (the recipes the device's
    scaled matmul runs, parallel/precision.py `native_fp8_recipes`), an FP8 recipe the device
    lacks unless the exact reference is asked for (`fp8_emulate`)."""
    out = []
    if precision.dtype == "fp16" and precision.loss_scaling == "none":
        out.append(Violation(
            "precision.loss_scaling", "none",
            "fp16 without loss scaling loses every gradient below 6e-8 (fp16's smallest "
            "subnormal) and most below 6e-5 to underflow",
            "Set precision.loss_scaling=dynamic, or use precision.dtype=bf16 (fp32's range: no "
            "scaling needed)"))
    if precision.dtype != "fp8":
        return out
    recipe = precision.fp8_recipe
    if recipe not in FP8_RECIPES:
        out.append(Violation("precision.fp8_recipe", recipe,
                             f"precision.fp8_recipe={recipe!r} is not an FP8 recipe",
                             f"Choose one of {', '.join(FP8_RECIPES)}"))
    elif native_fp8 is not None and recipe not in native_fp8 and not precision.fp8_emulate:
        have = (f"it runs {', '.join(native_fp8)}" if native_fp8 else
                "it has no FP8 scaled matmul at all")
        out.append(Violation(
            "precision.fp8_recipe", recipe,
            f"The scaled matmul of {device} does not run the {recipe} FP8 recipe ({have})",
            "Set precision.fp8_emulate=true to run the exact reference instead (quantise, "
            "dequantise, fp32 matmul: the same numbers, not the speed)"
            + (f", or choose precision.fp8_recipe among {', '.join(native_fp8)}"
               if native_fp8 else "")))
    return out


# ------------------------------------------------------------------------------------------------
# What the engine runs today. Each gap is one function; a feature that lands deletes its entry
# from ENGINE_GAPS (and turns the test of its refusal into a parity test).


def _experts_with_hybrid_sharding(model, lay) -> Optional[Violation]:
    if lay.ep > 1 and lay.dp_shard and lay.dp_shard < lay.dp:
        return Violation("parallel.dp_shard", lay.dp_shard,
                         "hybrid sharding and expert parallel both carve dp, and the mesh "
                         "carves it one way (dp_replicate x dp_shard or edp x ep)",
                         "leave dp_shard unset with ep > 1", gap=True)
    return None


def _sliding_window(model, lay) -> Optional[Violation]:
    window = getattr(model, "sliding_window", None)
    if window is not None and window < lay.seq_len:
        return Violation("model.sliding_window", window,
                         f"attention over a sliding window shorter than the sequence "
                         f"(training.seq_len={lay.seq_len}) is not implemented; the model is "
                         "exact while the window covers the whole sequence",
                         f"set training.seq_len <= {window}", gap=True)
    return None


ENGINE_GAPS: tuple[Callable[[Any, Any], Optional[Violation]], ...] = (
    _experts_with_hybrid_sharding, _sliding_window)


def data_violations(model, data) -> list[Violation]:
    """Data settings a model's features do not take yet (`data` anything with DataConfig's field
    names)."""
    if getattr(model, "mtp_layers", 0) and (data.document_mask or data.format == "chat"):
        key, value = (("data.format", "chat") if data.format == "chat"
                      else ("data.document_mask", True))
        return [Violation(key, value,
                          f"multi-token prediction (model.mtp_layers={model.mtp_layers}) with "
                          f"{key}={value!r} is not implemented: its modules read the tokens ahead "
                          "from the targets, which document boundaries and loss masks hide",
                          "set model.mtp_layers=0, or train on text without document masks",
                          gap=True)]
    return []


def training_violations(training) -> list[Violation]:
    """Training settings the engine does not run together yet (anything with TrainingConfig's
    field names)."""
    if training.compile and training.recompute == "norms_and_mla_up":
        return [Violation("training.recompute", training.recompute,
                          "the norms_and_mla_up policy saves the norms' and MLA's outputs as "
                          "recipes through saved-tensor hooks, which do not reach inside the "
                          "graphs training.compile makes (those keep their own activations)",
                          "with training.compile=true use recompute selective or full, or "
                          "compile off", gap=True)]
    return []


def engine_violations(model, layout) -> list[Violation]:
    """Why ultrascale's engine would refuse a layout that the layout rules accept: the first
    schedule rule it breaks (with pp > 1), then each gap of `ENGINE_GAPS`."""
    out = schedule_violations(layout, model.num_layers)[:1] if layout.pp > 1 else []
    return out + [v for gap in ENGINE_GAPS if (v := gap(model, layout)) is not None]

