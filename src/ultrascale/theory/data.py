"""Data parallelism and ZeRO (parallel/data.py, zero.py, zero3.py), and every other sum of a
gradient over copies of a weight (context parallel's ranks, a tied embedding's two stages).

Bytes: what a rank holds of its parameters, gradients and optimizer state, each kind at the bytes
per parameter the precision and the optimizer give (`ParamBytes`), divided as the playbook does
over the dp_shard x cp ranks that hold the same weights (stage 1 shards the optimizer state, 2
also the gradients, 3 also the parameters; expert weights over dp / ep of them); and the buffers
of the reduction and of ZeRO's gathers (under pp, or gathered once a step, what the rank's
program holds gathered at its peak: theory/gathering.py). Seconds: ZeRO-3's gathers each
micro-batch (or once a step: `parallel.zero3_gather`), gradient accumulation, and after the last
micro-batch the reduction, the tied embedding's exchange and ZeRO-1/2's all-gather of the updated
parameters. Torch-free.
"""

from __future__ import annotations

import math

from ultrascale.layout import DTYPE_BYTES, Layout, storage_bytes
from ultrascale.params import layer_params, mtp_rank_params, stage_matrix_params
from ultrascale.rules import zero3_gathers_per_step
from ultrascale.theory.gathering import Gathering, gathering, rank_units
from ultrascale.theory.rates import collective_time, memory_time, ring_steps
from ultrascale.theory.term import Bytes, Carried, Pass, Seconds, Stage, Step, Term


def shard_group(lay: Layout) -> int:
    """The ranks ZeRO shards over: every rank that holds the same weights and sees other tokens,
    dp (or the dp_shard group) x cp."""
    return (lay.dp_shard or lay.dp) * lay.cp


def per_step(lay: Layout) -> bool:
    """ZeRO-3 gathers each unit once a step and holds it to the step's end
    (`parallel.zero3_gather`; auto: under pp)."""
    return lay.zero == 3 and zero3_gathers_per_step(lay.zero3_gather, lay.pp)


ZERO3_GRADS = "ZeRO-3 gradients before reduce-scatter"
ZERO2_GRADS = "ZeRO-2 gradients before reduce-scatter"


def replayed(lay: Layout) -> bool:
    """Whether ZeRO-3's gathering is replayed over the rank's program (`gathering.replay`): under
    pp, or gathering once a step. (One process's micro-batches, gathered for each use, keep the
    closed form: two layers and one layer's gradient.)"""
    return lay.zero == 3 and (lay.pp > 1 or per_step(lay))


def gathering_of(model, lay: Layout, rank: int, layers: int, first: int, embedding: bool,
                 head: bool, whole_kv: bool) -> Gathering:
    """ZeRO-3's gathering of pipeline rank `rank` over one step (`gathering.gathering`)."""
    units, chunks = rank_units(model, lay, rank, layers, first, embedding, head, whole_kv,
                               storage_bytes(lay.dtype))
    schedule = lay.pp_schedule if lay.pp > 1 else "1f1b"  # one process: F, B per micro-batch
    return gathering(schedule, lay.pp, lay.grad_accum, lay.pp_virtual_stages, rank, units, chunks,
                  per_step(lay))


def stage_gathering(stage: Stage) -> Gathering:
    return gathering_of(stage.model, stage.layout, stage.index, stage.layers, stage.first,
                        stage.embedding, stage.head, stage.impl.whole_kv)


def costed_gathering(step: Step) -> Gathering:
    """The costed rank's: the one holding the head (the last, or dualpipev's rank 0, which also
    embeds) with the busiest rank's layers."""
    lay = step.lay
    rank = next(r for r in range(lay.pp) if step.schedule.ends(r, lay.pp)[1])
    embedding = step.schedule.ends(rank, lay.pp)[0]
    return gathering_of(step.model, lay, rank, step.layers, rank * step.layers, embedding, True,
                        step.impl.whole_kv)


# ------------------------------------------------------------------------------------------------
# Bytes


def stage_bytes(stage: Stage) -> Bytes:
    lay, impl, rates = stage.layout, stage.impl, stage.param_bytes
    dense, expert = stage.dense_params, stage.expert_params
    shard = shard_group(lay)
    shard_e = max(shard // lay.ep, 1)  # expert weights are replicated over dp / ep (x cp) ranks
    psi = dense + expert  # parameters this rank owns before ZeRO

    def zero_split(per_param: float, stage_min: int) -> float:
        if lay.zero >= stage_min:
            return dense * per_param / shard + expert * per_param / shard_e
        return psi * per_param

    def expert_split(per_param: float, stage_min: int) -> float:
        return expert * per_param / (shard_e if lay.zero >= stage_min else 1)

    params = zero_split(rates.params, 3)
    grads = zero_split(rates.grads, 2)
    # What the optimizer keeps per element of a matrix it steps apart (Muon), over its shards.
    muon, muon_e = (stage_matrix_params(stage.model, lay, stage.layers, stage.index,
                                        impl.whole_kv, stage.first)
                    if rates.matrix_optimizer else (0, 0))
    sharded = lay.zero >= 1
    fewer = -rates.matrix_optimizer
    saved = fewer * (muon / (shard if sharded else 1) + muon_e / (shard_e if sharded else 1))
    saved_e = fewer * muon_e / (shard_e if sharded else 1)
    out = Bytes(params=params, grads=grads, optimizer=zero_split(rates.optimizer, 1) - saved,
                experts={"params": expert_split(rates.params, 3),
                         "grads": expert_split(rates.grads, 2),
                         "optimizer": expert_split(rates.optimizer, 1) - saved_e})
    out.comm, out.step_comm = _buffers(stage, psi, grads, shard)
    if lay.zero >= 3 and shard > 1 and replayed(lay) and lay.grad_accum > 1:
        # The gradients accumulate whole over the micro-batches, reduce-scattered after the last;
        # before the first backward only a layer's exist (`_buffers`).
        out.after_first_backward[ZERO3_GRADS] = psi * DTYPE_BYTES[lay.grad_accum_dtype]
    if rates.matrix_optimizer:
        held = muon / (shard if sharded else 1) + muon_e / (shard_e if sharded else 1)
        if not sharded and lay.dp * lay.cp > 1:
            # Without ZeRO the updates of matrices other owners orthogonalise are freed before
            # the results come: every result, and the exchange's buffers.
            out.step_comm["Muon results of every owner"] = 4 * held
            out.step_comm["Muon results copied to every replica"] = _replicated_exchange(
                lay, muon, muon_e)
        else:
            # Muon's step (optim/muon.py) builds the Nesterov update of every matrix piece the
            # rank steps before one exchange orthogonalises them all, and holds the results until
            # it applies them: two fp32 copies of the rank's matrix shards at once.
            out.step_comm["Muon updates and their orthogonalised results"] = 2 * 4 * held
    if lay.zero == 1 and shard > 1 and impl.zero1_reduced_held:
        acc_b = DTYPE_BYTES[lay.grad_accum_dtype]
        out.late["ZeRO-1 reduced gradient shards"] = (dense / shard + expert / shard_e) * acc_b
    if (lay.zero == 2 and shard > 1 and impl.zero2_full_grads_in_backward
            and lay.grad_accum > 1):
        # The full buffers, beside the reduced shard's own flat buffer (parallel/zero.py), made
        # a bucket at a time as the backward reaches them: with micro-batches to accumulate all
        # exist once one backward has run (with one, see `_zero2_buckets`). Where every forward
        # comes first, the first backward has freed its micro-batch's activations by then, and
        # its layers' backward met the first bucket only (llama3-8b 4 layers, dp32 tp2 pp2 afab,
        # 4 micro-batches: +15.7% of the fake step's peak with the buffers whole throughout).
        acc_b = DTYPE_BYTES[lay.grad_accum_dtype]
        out.after_first_backward[ZERO2_GRADS] = psi * acc_b
        first = max(lay.bucket_mb * 2**20, largest_tensor(stage, ends=stage.head) * acc_b)
        out.transient[ZERO2_GRADS] = min(psi * acc_b, first)
    if _backward_starts_without_grads(lay, impl):
        out.fb_grads = 0
    out.transient.update(zero3_backward_transients(stage))
    if lay.zero == 2 and shard > 1 and impl.zero2_full_grads_in_backward and lay.grad_accum == 1:
        out.transient.update(_zero2_buckets(stage, DTYPE_BYTES[lay.grad_accum_dtype]))
    if impl.norm_float64:
        largest = largest_tensor(stage)
        out.norm = 16 * (largest / shard if lay.zero >= 1 else largest)
    return out


def _zero2_buckets(stage: Stage, acc_b: int) -> dict[str, float]:
    """ZeRO-2 with one micro-batch, after the loss's tensors are gone (a transient, as ZeRO-3's
    layer backward): a bucket's full gradient is made by its first gradient and freed once its
    reduce-scatter has landed, which the next bucket's launch checks (parallel/zero.py), so the
    largest bucket meets the one before it. A bucket is `bucket_mb` of one view's gradients
    (dense, or under ep experts) or one larger tensor (parallel/buckets.py); a small model's view
    fits in one. A layer backward's workspace meets the bucket being filled only
    (`ZERO2_BUCKET_FILLED`; fake tensors, tiny-moe cp4 with 0.25 MB buckets)."""
    lay = stage.layout
    cap = lay.bucket_mb * 2**20
    largest = max(cap, largest_tensor(stage) * acc_b)
    before = max(cap, largest_tensor(stage, ends=False) * acc_b)
    dense, experts = stage.dense_params, stage.expert_params
    # Experts have a view of their own under ep only (parallel/expert.py places them).
    views = [v for v in ((dense, experts) if lay.ep > 1 else (dense + experts,)) if v]
    return {ZERO2_BUCKETS: max((min(v * acc_b, largest + before) for v in views), default=0.0),
            ZERO2_BUCKET_FILLED: max((min(v * acc_b, before) for v in views), default=0.0)}


def _replicated_exchange(lay: Layout, dense: float, experts: float) -> float:
    """Without ZeRO every replica holds each matrix whole and its owner (one in n, dealt by
    size) sends its results to all n (parallel/muon_exchange.py): beside every result received,
    the last view's send buffer, its results n times over (the view's matrices: the larger
    view's counted), and the owner's own results, 1/n of each view. fp32."""
    n = lay.dp * lay.cp
    views = [(dense, n), (experts, max(n // lay.ep, 1))]
    return 4 * (max(t for t, _ in views) + sum(t / v for t, v in views))


def _backward_starts_without_grads(lay: Layout, impl) -> bool:
    """Whether the forward/backward peak (the loss's backward, all activations held) finds no
    gradient: one micro-batch, and an owner that drops its gradients after each step."""
    kept = lay.zero == 1 or (lay.zero == 0 and lay.dp * lay.cp > 1)
    return impl.grads_between_steps == "buckets" and lay.grad_accum == 1 and not kept


def largest_tensor(stage: Stage, ends: bool = True) -> int:
    """Elements of the largest parameter on the stage's rank: the embedding or output head (unless
    not `ends`), a projection, or the stacked routed experts of one projection."""
    m, lay = stage.model, stage.layout
    h, tp = m.hidden_size, lay.tp
    sizes = [max(m.ffn_hidden_size, m.num_heads * m.head_dim) * h // tp]
    if ends and (stage.embedding or stage.head):
        sizes.append(-(-m.vocab_size // tp) * h)
    if m.num_experts:
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        sizes.append(m.num_experts // lay.ep * ffn * h // tp)  # split over tp as a dense MLP
    return max(sizes)


def _buffers(stage: Stage, psi: int, grads: float, shard: int) -> tuple[dict, dict]:
    """(during forward/backward, during the optimizer step): ZeRO-3's gathered layers or the
    reduction's bucket, and ZeRO-1/2's copy for gathering the updated parameters."""
    lay, impl = stage.layout, stage.impl
    p_b, acc_b = storage_bytes(lay.dtype), DTYPE_BYTES[lay.grad_accum_dtype]
    reduced = lay.dp * lay.cp > 1  # gradients are summed over dp x cp
    comm: dict[str, float] = {}
    if lay.zero >= 3 and shard > 1 and replayed(lay):
        # What the rank's program holds gathered at its peak (`gathering.replay`), and the
        # gradients of the layer whose backward runs (with micro-batches to accumulate, all of
        # them once one backward has run: `after_first_backward`).
        comm["ZeRO-3 gathered parameters"] = stage_gathering(stage).peak
        comm[ZERO3_GRADS] = stage.largest_layer * acc_b
    elif lay.zero >= 3 and shard > 1:
        comm.update(_zero3_gathered(stage, p_b, acc_b))
    elif reduced and impl.grad_bucket_copy:
        comm["gradient bucket"] = min(lay.bucket_mb * 2**20, psi * acc_b)
    step_comm: dict[str, float] = {}
    if lay.zero in (1, 2) and shard > 1 and impl.zero_gather_copy != "none":
        whole = psi * p_b if impl.zero_gather_copy == "full" else 0
        step_comm["ZeRO all-gather copy"] = whole + psi * p_b / shard
    return comm, step_comm


def _zero3_gathered(stage: Stage, p_b: int, acc_b: int) -> dict[str, float]:
    """ZeRO-3's gathered units at the forward/backward peak. A layer's backward holds it and the
    previous one prefetched, gathered whole, and its full gradient before the reduce-scatter; on
    the stage with the loss, whose backward peaks first, the output head's unit (regathered for
    the loss's backward) and the last layer prefetched. The rest of a layer's backward, which
    comes once the loss's tensors are gone, is a transient of its own (the layout's larger
    transient counts: `estimator._fold`)."""
    layer = stage.largest_layer
    if not stage.head:
        return {"ZeRO-3 gathered layers": _layer_backward(stage, p_b, acc_b)}
    m = stage.model
    head_unit = (-(-m.vocab_size // stage.layout.tp) + 1) * m.hidden_size * p_b
    mtp = _mtp_unit(stage)
    if mtp:
        # Multi-token prediction's blocks run their backward first, every other activation
        # still held: a block gathered (the main model's last layer not yet prefetched: its
        # backward waits for the main loss's), the head kept gathered for the main loss, and
        # the embedding the blocks read (the block's gradients come as its backward goes:
        # `zero3_backward_transients`).
        return {"ZeRO-3 gathered layers": head_unit + (mtp + _embedding_kept(stage)) * p_b}
    return {"ZeRO-3 gathered layers": head_unit + layer * p_b}


def _layer_backward(stage: Stage, p_b: int, acc_b: int) -> float:
    """The most a layer's backward holds: the layer gathered, the unit before it prefetched (the
    layer before, or for the first the embedding), its full gradient, and the full gradient of
    the unit whose backward ran just before (the layer after it; for the last, the head's, which
    multi-token prediction's block shares, so the block's is launched and landed first), whose
    reduce-scatter is in flight until the next one is launched (parallel/zero.py
    `_release_reduced`). The stage's layers in order: its dense ones, then its MoE ones (a lone
    MoE layer after dense ones prefetches a dense one)."""
    m, lay = stage.model, stage.layout
    dense, _ = layer_params(m, lay.tp, lay.ep, stage.impl.whole_kv, moe=False)
    moe = list(layer_params(m, lay.tp, lay.ep, stage.impl.whole_kv))  # (rest, routed experts)
    # Each unit's gradient in the pieces its backward launches one after another: under ep an
    # MoE layer's routed experts (their MLP's backward comes first) apart from the rest, each
    # view its own bucket (parallel/expert.py); otherwise the unit whole.
    moe_pieces = [moe[1], moe[0]] if lay.ep > 1 and moe[1] else [sum(moe)]
    units = [[dense]] * stage.count["dense"] + [moe_pieces] * stage.count["moe"]
    vocab = -(-m.vocab_size // lay.tp) * m.hidden_size
    kept = _embedding_kept(stage)
    before = [vocab if stage.embedding and not kept else 0] + [sum(u) for u in units[:-1]]
    # The piece of the unit whose backward ran just before, its reduce-scatter in flight.
    after = [u[-1] for u in units[1:]] + [vocab + m.hidden_size if stage.head else 0]
    # By a layer's backward, the micro-batch's activations of the layers after it are freed.
    acts = [sum(stage.kinds[k].parts.values()) for k in ("dense", "moe")
            for _ in range(stage.count[k])]
    freed = [sum(acts[i + 1:]) for i in range(len(acts))]
    # The kept embedding: gathered, and the gradient the blocks gave it (compute dtype) waiting
    # for the main embedding's, which comes last.
    return 2 * kept * p_b + max(((sum(u) + b) * p_b + _grads_held(u, a) * acc_b - f
                                 for u, b, a, f in zip(units, before, after, freed)),
                                default=0.0)


def _grads_held(pieces: list[int], after: int) -> int:
    """The most full gradient a unit's backward holds: its piece being made and the one launched
    before it (the unit after's last, then its own), released at the next launch."""
    return max(p + q for p, q in zip(pieces, [after] + pieces[:-1]))


def _embedding_kept(stage: Stage) -> int:
    """Embedding parameters kept gathered through the whole backward: multi-token prediction's
    blocks read the embedding after the main model has (models/mtp.py), so it is gathered again
    with the units the loss's backward needs, and its backward comes last."""
    m = stage.model
    if not (stage.embedding and stage.head and _mtp_unit(stage)):
        return 0
    return -(-m.vocab_size // stage.layout.tp) * m.hidden_size


def _mtp_unit(stage: Stage) -> int:
    """Parameters of one multi-token prediction module on this rank (models/mtp.py: its norms
    and projection, replicated over tp, and its block's share), 0 without them."""
    m, lay = stage.model, stage.layout
    if not getattr(m, "mtp_layers", 0):
        return 0
    return sum(mtp_rank_params(m, lay.tp, lay.ep, stage.impl.whole_kv))


def zero3_backward_transients(stage: Stage) -> dict[str, float]:
    """What the backward gathers beyond what the loss's backward held (the stage with the loss,
    as `_zero3_gathered` says): multi-token prediction's blocks' full gradients while every
    activation is held (`MTP_BLOCK_GRADS`, a phase of its own), and a layer's backward (which no
    longer meets the losses' tensors: the fold takes them off)."""
    lay = stage.layout
    if lay.zero < 3 or shard_group(lay) <= 1 or not stage.head or replayed(lay):
        return {}
    p_b, acc_b = storage_bytes(lay.dtype), DTYPE_BYTES[lay.grad_accum_dtype]
    at_loss = sum(_zero3_gathered(stage, p_b, acc_b).values())
    # The layer's largest weight's gradient in the compute dtype, before it is added into the
    # fp32 buffer (a MoE's stacked experts: a third of the layer).
    cast = largest_tensor(stage, ends=False) * p_b if p_b < acc_b else 0
    mtp = _mtp_unit(stage)
    out = {MTP_BLOCK_GRADS: mtp * acc_b + cast} if mtp else {}
    layer = _layer_backward(stage, p_b, acc_b) + cast - at_loss
    if layer > 0:
        out[ZERO3_LAYER_BACKWARD] = layer
    return out


ZERO2_BUCKETS = "ZeRO-2 gradient buckets before reduce-scatter"
ZERO2_BUCKET_FILLED = "ZeRO-2 gradient bucket being filled"
# The transient of multi-token prediction's blocks' backward under ZeRO-3: after the losses, before
# the layers' backward (memory/estimator.py's phases).
MTP_BLOCK_GRADS = "ZeRO-3 multi-token prediction blocks' gradients"
ZERO3_LAYER_BACKWARD = "ZeRO-3 layer backward"


# ------------------------------------------------------------------------------------------------
# Seconds


def zero3_gathers(step: Step) -> float:
    """ZeRO-3: gather each layer's parameters forward and backward, every micro-batch, layer by
    layer, prefetched under that micro-batch's compute (as far as the device has room to overlap,
    `dp_overlap`). The gradients accumulate in full and are reduce-scattered once per step, after
    the last micro-batch, like ZeRO-1/2 (`reduce_time`). Under pp, or gathering once a step, the
    costed rank's replayed gathers instead (`replayed_gathers`)."""
    lay, hw, layer, stage_layers = step.lay, step.hw, step.layer, step.layers
    dp_shard = shard_group(lay)
    if not (lay.zero == 3 and dp_shard > 1) or replayed(lay):
        return 0.0
    per_layer = step.params / stage_layers
    stride = lay.tp
    gather = stage_layers * collective_time(hw, "all_gather", per_layer * storage_bytes(lay.dtype),
                                            dp_shard, stride)
    comp_f = stage_layers * (layer["matmul_f"] + layer["attention_f"])
    comp_b = stage_layers * (layer["matmul_b"] + layer["attention_b"])
    return max(0.0, gather - hw.dp_overlap * comp_f) + max(0.0, gather - hw.dp_overlap * comp_b)


def grad_accum_time(step: Step) -> float:
    """Gradient accumulation, per micro-batch. fp32 buffer under low-precision compute: each
    micro-batch's gradient is read and added into it. Same dtype: autograd adds the fresh gradient
    into `.grad` in place (read both, write one), every micro-batch when .grad is a view of a
    data-parallel bucket, after the first one otherwise."""
    lay, hw, m = step.lay, step.hw, step.lay.grad_accum
    b_dt, b_acc = storage_bytes(lay.dtype), DTYPE_BYTES[lay.grad_accum_dtype]
    if b_acc > b_dt:
        return memory_time(hw, step.params * (b_dt + 2 * b_acc))
    adds = m if (lay.dp * lay.cp > 1 or lay.zero > 0) else m - 1
    return memory_time(hw, step.params * 3 * b_acc) * adds / m


def replayed_gathers(step: Step) -> tuple[float, float]:
    """ZeRO-3 under pp or gathering once a step: (forward, backward) seconds of the costed rank's
    all-gathers over a step, as its program makes them (`costed_gathering`), each exposed past
    what the compute it is prefetched under hides: a micro-batch's forward or backward, or with
    `step` gathering the first forward alone (the stage then stays gathered)."""
    lay, hw = step.lay, step.hw
    if not (lay.zero == 3 and shard_group(lay) > 1 and replayed(lay)):
        return 0.0, 0.0
    g = costed_gathering(step)
    comp_f = step.layers * (step.layer["matmul_f"] + step.layer["attention_f"])
    comp_b = step.layers * (step.layer["matmul_b"] + step.layer["attention_b"])
    uses = 1 if per_step(lay) else lay.grad_accum  # the passes the gathers spread over
    out = []
    for nbytes, calls, comp in ((g.forward, g.calls_forward, comp_f),
                                (g.backward, g.calls_backward, comp_b)):
        each = collective_time(hw, "all_gather", nbytes / calls, shard_group(lay), lay.tp) \
            if calls else 0.0
        out.append(max(0.0, calls * each - uses * hw.dp_overlap * comp))
    return out[0], out[1]


def seconds(step: Step) -> Seconds:
    """Once per micro-batch: ZeRO-3's gathers (a third forward, two thirds backward; under pp
    those the rank's program makes, spread over the micro-batches unless gathered once a step)
    and the gradient accumulation (backward)."""
    zero3, accum = zero3_gathers(step), grad_accum_time(step)
    z_f, z_b = zero3 / 3, 2 * zero3 / 3
    if not per_step(step.lay):
        f, b = replayed_gathers(step)
        z_f, z_b = z_f + f / step.lay.grad_accum, z_b + b / step.lay.grad_accum
    return Seconds(once=Pass({"zero_gather": z_f}, {"zero_gather": z_b, "elementwise": accum}),
                   carried={"once": Carried(forward=z_f, backward=z_b + accum)})


def reduce_time(step: Step, backward_matmul: float) -> float:
    """The data-parallel gradient reduction after the last micro-batch (all-reduce, or
    reduce-scatter with ZeRO, then across the groups of hybrid sharding).

    It runs bucket by bucket as gradients become ready; buckets queue back to back on the
    communication stream, so the transfer time adds up and the start-up latency shows once
    (collective_time of the whole buffer), while each bucket, a collective of its own, pays the
    ring's per-step latency (`Hardware.ring_step_s`); the last bucket stays exposed after the
    backward. The rest overlaps the last micro-batch's backward (the GEMMs of its last chunk,
    `backward_matmul` over the rank's chunks; the Layout has no switch for it: the trainer always
    overlaps), as far as the device has room (`dp_overlap`) and the implementation lets it:
    nanotron's ZeRO reduce-scatter holds the backward up instead."""
    lay, hw = step.lay, step.hw
    if lay.dp * lay.cp == 1:
        return 0.0
    # Gradients are summed over dp x cp (cp ranks saw other tokens of the same sequences), and
    # ZeRO shards over dp_shard x cp; cp sits next to tp, so the group's ranks are tp apart.
    shard = shard_group(lay)
    stride = lay.tp
    gbytes = step.params * DTYPE_BYTES[lay.grad_accum_dtype]
    buckets = max(1, math.ceil(gbytes / (lay.bucket_mb * 2**20)))
    kind = "all_reduce" if lay.zero == 0 else "reduce_scatter"
    n = lay.dp * lay.cp if lay.zero == 0 else shard
    reduce = collective_time(hw, kind, gbytes, n, stride)
    reduce += buckets * ring_steps(kind, n) * hw.ring_step_s
    if lay.zero > 0 and shard < lay.dp * lay.cp:  # hybrid: all-reduce the shard across groups
        groups = lay.dp * lay.cp // shard
        reduce += (collective_time(hw, "all_reduce", gbytes / shard, groups, stride * shard)
                   + buckets * ring_steps("all_reduce", groups) * hw.ring_step_s)
    hidden = hw.dp_overlap * backward_matmul / lay.pp_virtual_stages
    if lay.zero > 0 and not step.impl.zero_reduce_overlaps:
        hidden = 0.0
    return max(reduce / buckets, reduce - hidden)


def tied_grads_time(model, lay: Layout, hw) -> float:
    """The exchange that keeps a tied embedding's two copies equal under pipeline parallelism: the
    first stage holds it as the embedding, the last as the output head, and after the backward
    each adds the other's gradient (its accumulation buffer, a vocabulary shard per tp rank), an
    all-reduce over those two ranks (ours swaps the two buffers, `pipeline.stage.sync_tied_grads`:
    the same bytes each way). Nothing is left to overlap it with: both run it once the backward
    is over (nanotron's trainer after the data-parallel reduction, ours before it). The two stages
    are (pp - 1) x dp x cp x tp ranks apart, on different nodes as soon as one stage fills a
    node."""
    if lay.pp == 1 or not model.tie_embeddings:
        return 0.0
    grad_bytes = model.vocab_size * model.hidden_size / lay.tp * DTYPE_BYTES[lay.grad_accum_dtype]
    return collective_time(hw, "all_reduce", grad_bytes, 2,
                           (lay.pp - 1) * lay.dp * lay.cp * lay.tp)


def allgather_time(step: Step) -> float:
    """ZeRO-1/2 gather the updated parameters back to every rank of the shard group."""
    lay = step.lay
    dp_shard = shard_group(lay)
    if lay.zero not in (1, 2) or dp_shard <= 1:
        return 0.0
    return collective_time(step.hw, "all_gather", step.params * storage_bytes(lay.dtype), dp_shard,
                           lay.tp)


def after_step(step: Step, backward_matmul: float) -> dict[str, float]:
    """Once a step: the reduction, the tied embedding's exchange, ZeRO-1/2's all-gather, or
    ZeRO-3's gathers where they happen once a step (the first forward waits for them)."""
    once = sum(replayed_gathers(step)) if per_step(step.lay) else 0.0
    return {"dp_comm": reduce_time(step, backward_matmul),
            "tied_grads": tied_grads_time(step.model, step.lay, step.hw),
            "zero_gather": allgather_time(step) + once}


TERM = Term("data", stage_bytes=stage_bytes, seconds=seconds, after_step=after_step)
