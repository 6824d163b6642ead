"""Per-device memory of a training layout, before any run: bytes of named tensors, most loaded rank.

`estimate(model, layout)` adds up, for every pipeline stage, what one rank of that stage holds:

- parameters, gradients and optimizer state (the playbook's 2+2+12 bytes per parameter in mixed
  precision with Adam, +4 for an fp32 gradient accumulation buffer), divided by ZeRO as the
  playbook does (stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters)
  over the `dp_shard` x cp ranks, and by tp, pp and ep for the parameters each rank owns;
- activations at the peak of the pipeline schedule: the micro-batches a stage holds at once (AFAB:
  all m, 1F1B: p - rank, interleaved: Megatron's warm-up, see pipeline.py) times the bytes its
  layers save for backward (activations.py), plus the loss's logits on the last stage and the layer
  rebuilt in backward under full recomputation; under zero bubble, micro-batches past their I pass
  hold only what their deferred W pass needs;
- communication buffers: the sequence-parallel all-gather output, ZeRO-3's gathered layers, the
  gradient bucket, pipeline send/receive buffers, and whatever the runtime keeps between steps.

Two phases peak separately: forward/backward (activations) and the optimizer step (ZeRO's gathered
parameters); the total is the larger, and the fields (params + grads + optimizer + activations +
comm_buffers + other) add up to it. `reserved` adds what PyTorch's caching allocator keeps on top
of memory that comes and goes within a step; the fits verdict compares it with the device. Implementation choices that change which tensors exist
(fused kernels, DDP's gradient buckets, ...) live in a `Runtime`; `ULTRASCALE` is ours,
`NANOTRON` the runtime behind the playbook's H100 benchmarks, `PLAYBOOK` the playbook's formulas.
No torch import: the planner calls this for tens of thousands of layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import gcd

from ultrascale.layout import DTYPE_BYTES, Layout, storage_bytes
from ultrascale.memory.activations import (
    Shape, TensorRules, deferred_weight_grad_layer, playbook_layer, rotary_tables, tensors_layer,
)
from ultrascale.memory.pipeline import edge_in_flight, in_flight, zero_bubble_states
from ultrascale.params import (ModelShape, dense_layers_in, expert_ffn, model_shape,
                               stage_matrix_params, stage_params)
from ultrascale.rules import (  # noqa: F401 (RECOMPUTE, SCHEDULES: the memory command's choices)
    RECOMPUTE, SCHEDULES, layout_violations, schedule_violations, value_violations,
)

GIB = 2**30
# Activation parts that exist only while they are used, not saved for backward.
TRANSIENT_PARTS = ("logits", "recomputed layer")


class LayoutError(ValueError):
    """A layout that cannot run this model, explained in one paragraph with the fix."""


@dataclass(frozen=True)
class Runtime:
    """What an implementation keeps besides the layout's own tensors."""

    name: str
    activations: str  # "tensors" (activations.tensors_layer) or "playbook" (Korthikanti's form)
    rules: TensorRules
    # A parameter-dtype .grad beside an fp32 accumulation buffer: "always", "dp" (only when dp > 1:
    # DDP's gradient buckets), "dp_zero0" (dp > 1 without ZeRO: a cast of the reduced fp32 sum
    # that stays allocated from step to step) or "never".
    half_grads: str = "always"
    # ZeRO-2 accumulates micro-batches in the full gradient buffer and frees all but its shard
    # only after the last one is reduce-scattered: the full buffer exists during backward.
    zero2_full_grads_in_backward: bool = False
    # What ZeRO-1/2 copies to all-gather the updated parameters: "full" (a flat temporary of all
    # of them plus the local shard, nanotron), "shard" (a copy of the local shard, ours), "none".
    zero_gather_copy: str = "none"
    # Data parallel reduces through buckets of bucket_mb separate from the gradients (else the
    # gradients are views of the buckets, as in ours and in DDP).
    grad_bucket_copy: bool = False
    # Buffers of b*s*h elements kept from step to step when tp > 1 with sequence parallel
    # (nanotron's MemoryBuffer: the all-gathered input, and the gathered gradient in backward).
    sp_gather_buffers: int = 0
    # Tensors beside the layers' saved activations (token ids, logits and loss probabilities, the
    # layer rebuilt by full recompute); the playbook's formula counts only the layers.
    count_extras: bool = True
    # With tp above the kv-head count, every rank keeps all kv projection weights (ours; Megatron
    # keeps only the kv head its query heads use).
    whole_kv: bool = False
    # ZeRO-3 keeps only each rank's fp32 shard (ours, zero3.py): it is the parameters' storage
    # and the master copy at once, and the compute-dtype parameters exist only while gathered.
    zero3_shard_is_master: bool = False
    # Library workspaces and small tables (cuBLAS workspaces, rotary caches), bytes.
    workspace: int = 0
    # The caching allocator's overhead on memory that comes and goes within a step (activations,
    # transients): a fraction of it, reserved but not allocated. Only the `reserved` figure and
    # the fits verdict use it. The GPU runtimes use 0.25: on the playbook's H100 runs the median
    # of (reserved - steady) / (peak - steady) is 1.29 (docs/memory.md).
    fragmentation: float = 0.0
    # Timing, read by the planner's cost model: whether the ZeRO-1/2 gradient reduce-scatter runs
    # under the last backward (ours, like DDP's all-reduce) or holds it up bucket by bucket.
    zero_reduce_overlaps: bool = True
    # How pipeline ranks split the model: "even" (layers as even as possible, the head on the last
    # rank; ours) or "cost" (nanotron: blocks go to ranks in order until each rank's share of the
    # summed block costs, 4 h^2 + 3 f h per layer and vocab x h for the head, is passed). Read by
    # the cost model; the memory estimate keeps the even split.
    pp_partition: str = "even"
    # All-reduces of a few numbers per token in the vocabulary-parallel cross-entropy (ours: the
    # maximum logit, then the sum of exponentials and the target logit together; nanotron: three).
    loss_all_reduces: int = 2


# Ours: models/llama.py run by PyTorch autograd (unfused RMSNorm, SDPA, unfused SwiGLU), with
# parallel/recompute.py's selective mode (attention core and SwiGLU product rerun in backward).
ULTRASCALE = Runtime(
    name="ultrascale", activations="tensors",
    rules=TensorRules(norm_saves_normalized=True, norm_upcast=True, rotary_saves_input=False,
                      attention="flash", attention_output_copy=False, swiglu_fused=False,
                      sp_saves_gathered=False, selective_swiglu=True, sp_head_gathered=True,
                      rotary_tables_shared=True),
    # A low-precision gradient is added into the fp32 buffer and dropped as it comes
    # (parallel/buckets.py, replicated.py), and the fp32 master weights step on the fp32 sum
    # (parallel/precision.py); parallel/zero.py gathers parameters from a copy of the local
    # shard and, at stage 2, reduce-scatters the full buffer after the last micro-batch.
    half_grads="never", zero_gather_copy="shard", zero2_full_grads_in_backward=True,
    whole_kv=True, zero3_shard_is_master=True,
    fragmentation=0.25,
)
# nanotron as used for the playbook's benchmark runs: Triton RMSNorm (keeps input and 1/rms),
# in-place flash rotary, flash attention, merged gate/up projection, DDP with an fp32 accumulation
# hook, ZeRO-1 all-gather through a flat copy, persistent all-gather buffers under sequence
# parallel. The 80 MiB workspace is calibrated on those runs (docs/memory.md): one cuBLAS workspace
# per stream (32 MiB each on Hopper for compute and communication streams) and small caches.
NANOTRON = Runtime(
    name="nanotron", activations="tensors",
    rules=TensorRules(norm_saves_normalized=False, norm_upcast=False, rotary_saves_input=False,
                      attention="flash", attention_output_copy=False, swiglu_fused=False,
                      sp_saves_gathered=False),
    half_grads="dp", zero_gather_copy="full", sp_gather_buffers=2, workspace=80 * 2**20,
    fragmentation=0.25,
    # Its fp32 accumulation hook issues ZeRO's reduce-scatter through a helper whose completion
    # callback copies the reduced shard back on the compute stream: that copy waits for the
    # collective, so each bucket's reduce-scatter holds up the rest of the backward. (Without
    # ZeRO, the hook's all-reduce is only waited for after the backward, and overlaps it.)
    zero_reduce_overlaps=False,
    loss_all_reduces=3,
)
# The playbook's own accounting: its activation formula (layers only) and the ZeRO formulas.
PLAYBOOK = Runtime(
    name="playbook", activations="playbook", rules=ULTRASCALE.rules, count_extras=False,
)
# nanotron with its own pipeline partition. The H100 constants were fitted with the even split
# (`nanotron`); with this one, refitted, they leave their bounds (docs/planner.md), which is the
# next step for the playbook comparison (`planner_vs_playbook.py --runtime nanotron-balanced`).
NANOTRON_BALANCED = replace(NANOTRON, name="nanotron-balanced", pp_partition="cost")
RUNTIMES = {r.name: r for r in (ULTRASCALE, NANOTRON, NANOTRON_BALANCED, PLAYBOOK)}


@dataclass
class MemoryEstimate:
    """Bytes on the most loaded rank (or the rank asked for). `total` is the peak over the step."""

    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    other: int
    total: int
    rank_desc: str
    fits: bool | None
    device_memory: int | None
    stage: int
    phase: str  # which phase holds the peak: "forward/backward" or "optimizer step"
    phases: dict[str, int] = field(default_factory=dict)
    activation_parts: dict[str, int] = field(default_factory=dict)
    comm_parts: dict[str, int] = field(default_factory=dict)
    runtime: str = "ultrascale"
    activations_peak: int = 0  # the forward/backward peak, even when the optimizer step binds
    reserved: int = 0  # total plus the caching allocator's fragmentation; what `fits` compares
    # Of params, grads and optimizer, the bytes of routed-expert weights (E / ep experts of each
    # MoE layer, their ZeRO shards over edp): keys "params", "grads", "optimizer".
    experts: dict[str, int] = field(default_factory=dict)

    @property
    def saved_activations(self) -> int:
        """Activation bytes saved for backward at the end of the forward (what
        `saved_tensors_hooks`, e.g. memory/measure.py, sees): the peak less its transients."""
        return sum(v for k, v in self.activation_parts.items() if k not in TRANSIENT_PARTS)

    @property
    def steady(self) -> int:
        """Parameters, gradients and optimizer state: held all the time."""
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
            "activations": self.activations, "comm_buffers": self.comm_buffers,
            "other": self.other, "total": self.total, "rank_desc": self.rank_desc,
            "fits": self.fits, "device_memory": self.device_memory, "stage": self.stage,
            "phase": self.phase, "phases": dict(self.phases),
            "activation_parts": dict(self.activation_parts),
            "comm_parts": dict(self.comm_parts),
            "runtime": self.runtime, "activations_peak": self.activations_peak,
            "saved_activations": self.saved_activations,
            "reserved": self.reserved, "experts": dict(self.experts),
            "total_gib": round(self.total / GIB, 3),
        }

    def format_table(self) -> str:
        from ultrascale.memory.report import format_table

        return format_table(self)


# ---------------------------------------------------------------------------------------------
# The layout's rules (rules.py) and its layers per stage


def check_layout(m: ModelShape, lay: Layout, pp_layers: tuple[int, ...] | None = None) -> None:
    """Raise LayoutError unless `lay` can run model `m` (`pp_layers`: layers per pipeline rank)."""
    bad = value_violations(lay)
    if not bad:
        bad = layout_violations(m, lay, rank_layers=pp_layers) + schedule_violations(lay)
    if bad:
        raise LayoutError(bad[0].message)


def stage_layers(m: ModelShape, lay: Layout,
                 pp_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    if pp_layers is not None:
        return tuple(pp_layers)
    return (m.num_layers // lay.pp,) * lay.pp


# ---------------------------------------------------------------------------------------------
# The estimate


def _ulysses_kv(m: ModelShape, lay: Layout) -> int:
    """Key/value width Ulysses attention keeps: the kv heads of a tp rank replicated up to a
    multiple of cp when cp does not divide them (parallel/context.py); 0 when nothing changes."""
    if lay.cp == 1 or lay.cp_mode != "ulysses":
        return 0
    local = max(m.num_kv_heads // lay.tp, 1)
    return 0 if local % lay.cp == 0 else local * lay.cp // gcd(local, lay.cp) * m.head_dim


def _shape(m: ModelShape, lay: Layout, moe: bool = True) -> Shape:
    """The per-rank sizes of an MoE layer of an MoE model (moe=False, or a dense model: of a
    layer with the dense MLP)."""
    tp, cp = lay.tp, lay.cp
    experts = m.num_experts if moe else 0
    return Shape(
        b=lay.mbs, s=lay.seq_len // cp, s_kv=lay.seq_len, h=m.hidden_size,
        heads=m.num_heads // tp, kv=max(m.num_kv_heads // tp, 1) * m.head_dim,
        head_dim=m.head_dim, f=(expert_ffn(m) if experts else m.ffn_hidden_size) // tp, tp=tp,
        sp=lay.sequence_parallel and tp > 1, act=storage_bytes(lay.dtype),
        top_k=m.experts_top_k if experts else 0, experts=experts // lay.ep if experts else 0,
        shared_experts=m.shared_experts if experts else 0,
        shared_gate=bool(experts and m.shared_expert_gate), vocab=-(-m.vocab_size // tp),
        ep=lay.ep if experts else 1,
        attn_kv=_ulysses_kv(m, lay), output_copy=lay.cp > 1 and lay.cp_mode == "ulysses",
    )


def _layer_parts(shape: Shape, recompute: str, rt: Runtime) -> dict[str, int]:
    if rt.activations == "playbook":
        return playbook_layer(shape, recompute)
    return tensors_layer(shape, recompute, rt.rules)


@dataclass(frozen=True)
class _LayerKind:
    """One kind of layer (dense MLP, or MoE): its sizes, saved parts (under the layout's
    recompute) and the bytes one layer rebuilds under full recomputation."""

    shape: Shape
    parts: dict
    full: int


def _layer_kinds(m: ModelShape, lay: Layout, rt: Runtime) -> dict[str, _LayerKind]:
    kinds = {}
    for kind in ("dense", "moe") if m.num_experts else ("dense",):
        shape = _shape(m, lay, moe=kind == "moe")
        parts = _layer_parts(shape, lay.recompute, rt)
        whole = parts if lay.recompute == "none" else _layer_parts(shape, "none", rt)
        kinds[kind] = _LayerKind(shape, parts, sum(whole.values()))
    return kinds


def _stage(m: ModelShape, lay: Layout, rt: Runtime, layers: tuple[int, ...], stage: int,
           kinds: dict[str, _LayerKind], norm: int, detail: bool) -> dict:
    p_b = storage_bytes(lay.dtype)  # fp8 keeps its parameters in bf16
    acc_b = DTYPE_BYTES[lay.grad_accum_dtype]
    master_b = DTYPE_BYTES[lay.master_dtype] if lay.master_dtype != lay.dtype else 0
    # The stage's layers from its first global index (interleaved chunks are taken as one run):
    # the first first_k_dense of the model keep the dense MLP.
    first = sum(layers[:stage])
    n_dense = dense_layers_in(m, first, layers[stage])
    count = {"dense": n_dense, "moe": layers[stage] - n_dense}
    present = [k for k in kinds if count[k]]
    shape = kinds["moe" if "moe" in present else "dense"].shape
    per_stage: dict[str, float] = {}  # saved bytes of all the stage's layers, one micro-batch
    for k in present:
        for part, v in kinds[k].parts.items():
            per_stage[part] = per_stage.get(part, 0) + v * count[k]
    full_layer = max((kinds[k].full for k in present), default=0) \
        if lay.recompute == "full" else 0
    dense, expert, one_layer = stage_params(m, lay, layers[stage], stage, rt.whole_kv, first)
    # ZeRO shards over every rank that holds the same weights and sees other tokens: dp (or the
    # dp_shard group) x cp.
    shard = (lay.dp_shard or lay.dp) * lay.cp
    shard_e = max(shard // lay.ep, 1)  # expert weights are replicated over dp / ep (x cp) ranks
    reduced = lay.dp * lay.cp > 1  # gradients are summed over dp x cp
    psi = dense + expert  # parameters this rank owns before ZeRO

    def zero_split(per_param: float, stage_min: int) -> float:
        if lay.zero >= stage_min:
            return dense * per_param / shard + expert * per_param / shard_e
        return psi * per_param

    def expert_split(per_param: float, stage_min: int) -> float:
        return expert * per_param / (shard_e if lay.zero >= stage_min else 1)

    # Gradients: one buffer in the accumulation dtype, plus a parameter-dtype .grad beside it when
    # the two differ and the runtime keeps both.
    half = 0
    if acc_b != p_b and (rt.half_grads == "always" or (rt.half_grads == "dp" and reduced)
                         or (rt.half_grads == "dp_zero0" and reduced and lay.zero == 0)):
        half = p_b
    params = zero_split(p_b, 3)
    grads = zero_split(acc_b + half, 2)
    # Muon's matrices hold one fp32 momentum buffer where Adam holds m and v: 4 bytes fewer.
    muon, muon_e = stage_matrix_params(m, lay, layers[stage], stage, rt.whole_kv, first) \
        if lay.optimizer == "muon" else (0, 0)
    sharded = lay.zero >= 1
    saved = 4 * (muon / (shard if sharded else 1) + muon_e / (shard_e if sharded else 1))
    saved_e = 4 * muon_e / (shard_e if sharded else 1)
    optimizer = zero_split(master_b + 8, 1) - saved  # master copy (if any) + Adam's m and v
    experts = {"params": expert_split(p_b, 3), "grads": expert_split(acc_b + half, 2),
               "optimizer": expert_split(master_b + 8, 1) - saved_e}
    if lay.zero >= 3 and rt.zero3_shard_is_master:
        params = zero_split(DTYPE_BYTES[lay.master_dtype], 3)
        optimizer = zero_split(8, 1) - saved
        experts.update(params=expert_split(DTYPE_BYTES[lay.master_dtype], 3),
                       optimizer=expert_split(8, 1) - saved_e)

    # Activations: per-layer parts x layers x micro-batches held at the schedule's peak, and the
    # first and last stages' own tensors per micro-batch (all as bytes of ONE micro-batch here).
    a = shape.act
    tok = shape.b * shape.s
    res = tok * shape.h // (shape.tp if shape.sp else 1)
    edge: dict[str, float] = {}  # held per micro-batch in the first / last chunk
    whole: dict[str, float] = {}  # held per micro-batch like the layers
    transient: dict[str, float] = {}
    comm: dict[str, float] = {}
    deferred = 0.0  # zero bubble: what a W pass needs, per micro-batch between its I and W
    if rt.count_extras:
        if stage == 0:
            # int64 ids; a vocabulary-parallel embedding also keeps its out-of-shard mask (bool).
            edge["token ids"] = tok * (8 + (lay.tp > 1))
        if stage == lay.pp - 1:
            # Final norm as in a block; the loss keeps fp32 probabilities (log-softmax or softmax)
            # per micro-batch until its backward, and while it runs the logits in the compute
            # dtype and, if narrower, their fp32 copy.
            final = norm  # as in a block, outside any recomputed layer
            if shape.sp and rt.rules.sp_head_gathered and not rt.rules.sp_saves_gathered:
                final += (tok * shape.h - res) * a  # the head keeps the gathered output
            edge["final norm"] = final
            logits = tok * shape.vocab
            edge["loss probabilities (fp32)"] = logits * 4
            # int64, kept by the loss for its backward; a vocabulary-parallel loss keeps the
            # targets' shard indices and which of them fall in its shard (bool).
            edge["targets"] = tok * (8 + (lay.tp > 1))
            transient["logits"] = logits * (a + (4 if a < 4 else 0))
            # The head runs as F.linear on its weight (tied or not), never deferred to a W pass.
    shared_rope = rt.rules.rotary_tables_shared and layers[stage] and rt.activations == "tensors"
    if lay.recompute == "full" and layers[stage] and rt.count_extras:
        transient["recomputed layer"] = full_layer  # backward rebuilds one layer at a time
        if shared_rope:  # the layers' checkpoints keep only their hidden states; a rebuilt
            transient["recomputed layer"] += rotary_tables(shape)  # layer saves the tables
        else:
            # The checkpoint of each layer keeps its inputs: the hidden states (counted per
            # layer) and the positions, one int64 tensor shared by the layers of a chunk.
            whole["positions"] = shape.s * 8 * lay.pp_virtual_stages  # one per chunk's forward
    elif shared_rope:  # one pair of tables per chunk's forward, saved by every layer's rotary
        whole["rotary tables"] = rotary_tables(shape) * lay.pp_virtual_stages
        if lay.recompute == "selective":  # the checkpointed attention cores keep the positions
            whole["positions"] = shape.s * 8 * lay.pp_virtual_stages
    held = in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, lay.pp_virtual_stages, stage)
    held_edge = edge_in_flight(lay.pp_schedule, lay.pp, lay.grad_accum, lay.pp_virtual_stages,
                               stage, held)
    n_deferred = 0
    if lay.pp_schedule == "zero_bubble" and lay.pp > 1 and rt.activations == "tensors":
        # ZB-H1 (parallel/pipeline/stage.py): an I pass frees what only it needed; the W pass
        # still needs each linear's input and output gradient, kept until W runs.
        deferred += sum(deferred_weight_grad_layer(kinds[k].shape) * count[k] for k in present)
        per_mb = (sum(per_stage.values()) + sum(edge.values())
                  + sum(whole.values()))
        held, n_deferred = max(zero_bubble_states(lay.pp, lay.grad_accum, stage),
                               key=lambda s: s[0] * per_mb + s[1] * deferred)
        held_edge = held
    # The per-part dict only for the rank reported; the others need the sum.
    acts: dict[str, float] = ({k: v * held for k, v in per_stage.items()} if detail
                              else {"layers": sum(per_stage.values()) * held})
    acts.update({k: v * held_edge for k, v in edge.items()})
    acts.update({k: v * held for k, v in whole.items()})
    if n_deferred:
        acts["deferred weight-gradient inputs"] = deferred * n_deferred
    if (lay.cp > 1 and lay.cp_mode == "ulysses" and lay.recompute == "none" and layers[stage]
            and rt.activations == "tensors"):
        # Where each token of the gathered sequence comes from and goes back to (int64, three of
        # seq_len, made once and shared by every layer and micro-batch).
        acts["Ulysses token order"] = 3 * lay.seq_len * 8
    acts.update(transient)
    activations = sum(acts.values())

    # Communication buffers held during forward/backward.
    if shape.sp:
        comm["sequence-parallel all-gather"] = tok * shape.h * a  # gathered input of a linear
        if rt.sp_gather_buffers:
            comm["persistent all-gather buffers"] = rt.sp_gather_buffers * tok * shape.h * a
    if lay.cp > 1:
        comm.update(context_parallel_buffers(lay, shape))
    if lay.pp > 1:
        comm["pipeline send/recv"] = 2 * res * a  # an activation in, a gradient out
    if lay.ep > 1:
        comm["expert all-to-all"] = 2 * tok * shape.top_k * shape.h * a  # dispatch + combine
    if lay.zero >= 3 and shard > 1:
        # The layer being computed and the next one prefetched, gathered whole; in backward the
        # full gradient of a layer before its reduce-scatter.
        comm["ZeRO-3 gathered layers"] = 2 * one_layer * p_b + one_layer * acc_b
    elif reduced and rt.grad_bucket_copy:
        comm["gradient bucket"] = min(lay.bucket_mb * 2**20, psi * acc_b)
    if lay.zero == 2 and shard > 1 and rt.zero2_full_grads_in_backward:
        comm["ZeRO-2 gradients before reduce-scatter"] = psi * acc_b - grads
    persistent = comm.get("persistent all-gather buffers", 0)

    # Optimizer step: ZeRO-1/2 gather the updated parameters back to every rank.
    opt_comm: dict[str, float] = {"persistent all-gather buffers": persistent} if persistent else {}
    if lay.zero in (1, 2) and shard > 1 and rt.zero_gather_copy != "none":
        whole = psi * p_b if rt.zero_gather_copy == "full" else 0
        opt_comm["ZeRO all-gather copy"] = whole + psi * p_b / shard

    steady = params + grads + optimizer + rt.workspace
    comm_fb = sum(comm.values())
    fb = steady + activations + comm_fb
    opt = steady + sum(opt_comm.values())
    phase = "forward/backward" if fb >= opt else "optimizer step"
    # What the caching allocator reserves: tensors that come and go within a step fragment it.
    dynamic = activations + comm_fb - persistent
    reserved = max(fb + rt.fragmentation * dynamic, opt)
    return {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "comm": comm if phase == "forward/backward" else opt_comm, "acts": acts,
        "phases": {"forward/backward": fb, "optimizer step": opt}, "phase": phase,
        "total": max(fb, opt), "reserved": reserved, "experts": experts,
    }


def context_parallel_buffers(lay: Layout, shape: Shape) -> dict[str, float]:
    """What context-parallel attention holds while one layer's backward runs (its peak), beside
    the saved activations (parallel/ring_attention.py, context.py): dq, dK/dV are accumulated in
    fp32."""
    a, tok = shape.act, shape.b * shape.s
    kv = 2 * tok * shape.kv  # this rank's K and V
    dq = tok * shape.heads * shape.head_dim * 4
    if lay.cp_mode == "ring":
        # The block in hand and the next one arriving; our own dK/dV, the accumulator being sent
        # on and the one arriving.
        return {"context-parallel k/v blocks": 2 * kv * a,
                "context-parallel dq, dk/dv (fp32)": dq + 3 * kv * 4}
    if lay.cp_mode == "all_gather":
        # The gathered K and V, every block's dK/dV before the reduce-scatter, our share after.
        return {"context-parallel gathered k/v": lay.cp * kv * a,
                "context-parallel dq, dk/dv (fp32)": dq + (lay.cp + 1) * kv * 4}
    # Ulysses: the contiguous copy sent and the buffer received of q, k and v (and of their
    # gradients in backward).
    q = tok * shape.heads * shape.head_dim
    return {"context-parallel all-to-all buffers": 2 * (q + 2 * tok * (shape.attn_kv or shape.kv))
            * a}


@lru_cache(maxsize=8192)
def _estimate(m: ModelShape, lay: Layout, rt: Runtime, pp_layers: tuple[int, ...] | None,
              stage: int | None) -> MemoryEstimate:
    check_layout(m, lay, pp_layers)
    layers = stage_layers(m, lay, pp_layers)
    kinds = _layer_kinds(m, lay, rt)
    norm = _layer_parts(kinds["dense"].shape, "none", rt).get("MLP norm", 0)
    if stage is not None:
        candidates = [stage]
    elif pp_layers is None:
        # Even split: a middle stage holds the layers of the first, fewer or as many micro-batches
        # (every schedule's in-flight count is non-increasing in the rank) and no embedding, so
        # the most loaded rank is the first or the last stage.
        candidates = sorted({0, lay.pp - 1})
    else:
        candidates = range(lay.pp)
    # Part-by-part detail only when one stage is asked for or the candidates are few.
    detail = len(candidates) <= 2
    results = {c: _stage(m, lay, rt, layers, c, kinds, norm, detail)
               for c in candidates}
    pick = max(candidates, key=lambda c: results[c]["reserved"])
    r = results[pick] if detail else _stage(m, lay, rt, layers, pick, kinds, norm, True)

    if lay.pp == 1:
        desc = "every rank (no pipeline parallel)"
    else:
        desc = f"pp stage {pick} of {lay.pp}"
        if pick == 0:
            desc += " (embedding)"
        elif pick == lay.pp - 1:
            desc += " (output head and loss)"
    comm = {k: int(v) for k, v in r["comm"].items()}
    parts = {k: int(v) for k, v in r["acts"].items()}
    params, grads, optimizer = int(r["params"]), int(r["grads"]), int(r["optimizer"])
    peak_acts = sum(parts.values())
    binding_fb = r["phase"] == "forward/backward"
    activations = peak_acts if binding_fb else 0
    total = params + grads + optimizer + activations + sum(comm.values()) + rt.workspace
    return MemoryEstimate(
        params=params, grads=grads, optimizer=optimizer, activations=activations,
        comm_buffers=sum(comm.values()), other=rt.workspace, total=total, rank_desc=desc,
        fits=None, device_memory=None, stage=pick, phase=r["phase"],
        phases={k: int(v) for k, v in r["phases"].items()}, activation_parts=parts,
        comm_parts=comm, runtime=rt.name, activations_peak=peak_acts,
        reserved=max(int(r["reserved"]), total),
        experts={k: int(v) for k, v in r["experts"].items()},
    )


def estimate(model, layout: Layout, *, device_memory: int | None = None,
             runtime: Runtime | str = ULTRASCALE, stage: int | None = None,
             pp_layers: list[int] | tuple[int, ...] | None = None,
             headroom: float = 0.0) -> MemoryEstimate:
    """Per-device memory of `model` (a ModelConfig) trained with `layout`.

    stage: the pipeline stage to report (default: the most loaded one). pp_layers: layers per
    stage when the split is uneven. fits: whether `reserved` (the peak plus the runtime's
    allocator fragmentation) <= device_memory * (1 - headroom); the headroom is for what no tensor
    count sees (the CUDA context, NCCL's own buffers) when the device size given is the raw one.
    """
    rt = RUNTIMES[runtime] if isinstance(runtime, str) else runtime
    if stage is not None and not 0 <= stage < layout.pp:
        raise LayoutError(f"stage={stage} is not a pipeline stage of pp={layout.pp}.")
    est = _estimate(model_shape(model), layout, rt, tuple(pp_layers) if pp_layers else None,
                    stage)
    fits = None if device_memory is None else est.reserved <= device_memory * (1.0 - headroom)
    # A copy: the cached estimate stays untouched whatever the caller does with its own.
    return replace(est, fits=fits, device_memory=device_memory,
                   phases=dict(est.phases), activation_parts=dict(est.activation_parts),
                   comm_parts=dict(est.comm_parts), experts=dict(est.experts))


def with_runtime(rt: Runtime, **changes) -> Runtime:
    return replace(rt, **changes)
