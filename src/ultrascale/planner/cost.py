"""Step time of a layout, from FLOPs, bytes and bandwidths.

The model, per device:

* compute of one micro-batch on one pipeline stage: every GEMM of a block costed at an achieved rate
  that grows with its size (`Hardware.matmul_eff_max`, `matmul_half_flops`), causal flash attention
  at `attention_eff`, elementwise work (norms, residuals, rotary, SwiGLU, cross-entropy, fp32
  gradient accumulation) as HBM traffic, recomputation as extra forward work;
* waits against device work: the host work of each layer and the per-step latencies of collectives
  overlap the device's FLOPs and bytes per micro-batch; the longer counts in full and
  `Hardware.host_overlap` of the shorter hides (a GPU runs ahead of its host; 0 on a CPU);
* tensor-parallel collectives (all-reduce, or all-gather/reduce-scatter with sequence parallel), the
  cp ring exchange (hidden under attention where it can be; an MoE's per-sequence balance
  statistics too) and the ep all-to-all, each costed on the link it crosses (inside a node or
  between nodes, from the rank order tp, cp, dp, pp; between nodes a group gets its share of the
  node's links, `inter_share`), every tp ring step waiting
  `Hardware.tp_step_wait_s` on a cluster in a state that stalls them;
* the pipeline: forward/backward times of a stage fed to the schedule simulator, whose total time
  contains the bubble; point-to-point activation transfers added to each stage time;
* after the last micro-batch: the data-parallel gradient reduction (bucketed, each bucket paying
  its ring steps, overlapped with the last backward; reduce-scatter with ZeRO), the optimizer
  update (HBM traffic of Adam over the local shard) and the ZeRO-1/2 parameter all-gather; with
  ZeRO-3 the per-micro-batch gathers, prefetched under compute;
* on a CPU profile (`Hardware.host_cores`), each rank computes on its share of the node's cores:
  when ranks outnumber cores they time-share them, so every rank's compute slows by ranks / cores,
  and a pipeline's idle ranks hand their cores to the busy ones (the bubble shrinks to what the
  node's total work leaves).

Everything is physical (FLOPs, bytes, bandwidths, latencies); the only fitted numbers are the
efficiency constants of the hardware profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from ultrascale import params as model_params
from ultrascale.config import ModelConfig
from ultrascale.layout import DTYPE_BYTES, STORAGE_DTYPE, Layout, storage_bytes
from ultrascale.memory.estimator import RUNTIMES, Runtime, estimate
from ultrascale.planner.hardware import Hardware
from ultrascale.rules import layers_per_stage

# Fused Adam: read fp32 param, grad, m, v (16); write param, m, v (12); write bf16 copy (2). The
# default of `Hardware.optimizer_bytes_per_param`.
ADAM_BYTES_PER_PARAM = 30
CE_BYTES_PER_LOGIT = 16  # fp32 logits written, read for softmax, read/written again in backward


# ------------------------------------------------------------------------------------------------
# Collectives


def collective_parts(hw: Hardware, kind: str, nbytes: float, n: int,
                     stride: int = 1) -> tuple[float, float]:
    """(wait, transfer) of one collective over `n` ranks spaced `stride` apart in rank order: the
    per-step latencies (and a CPU rank's time-slice wait), and the bytes over the bus bandwidth.

    `nbytes` is the full buffer of one rank (the gathered tensor for all-gather/reduce-scatter, the
    reduced tensor for all-reduce, the sent tensor for all-to-all and point-to-point). The group
    crosses nodes when n * stride exceeds a node; it then runs at the inter-node bus bandwidth, of
    which it gets its share of the node's links (`inter_share`).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    gpn = hw.devices_per_node
    local = max(1, min(n, gpn // stride)) if stride < gpn else 1
    nodes = math.ceil(n / local)
    link = hw.inter if nodes > 1 else hw.intra
    factor = {"all_reduce": 2.0 * (n - 1) / n, "p2p": 1.0}.get(kind, (n - 1) / n)
    latency = hw.intra.latency_s * math.log2(local) + hw.inter.latency_s * math.log2(nodes)
    if kind == "p2p":
        return link.latency_s + hw.wakeup_s, nbytes / link.bw(kind, nodes)
    bw = link.bw(kind, nodes, inter_share(local, gpn) if nodes > 1 else 1.0)
    return latency + hw.wakeup_s, factor * nbytes / bw


def inter_share(local: int, devices_per_node: int) -> float:
    """The share of a node's network links that one group crossing nodes gets, when the group has
    `local` ranks on each node: the node's other devices_per_node / local groups of the same kind
    run the same collective at the same time (every tp rank's data-parallel group reduces at once),
    so a data-parallel ring with one GPU per node runs on one GPU's NIC, not on all eight. The
    inter-node bus bandwidth of a profile is the node's (nccl-tests with every GPU of each node
    taking part)."""
    return max(1, local) / devices_per_node


def ring_steps(kind: str, n: int) -> int:
    """Steps of a ring collective over n ranks: n - 1 for an all-gather, reduce-scatter or
    all-to-all, 2 (n - 1) for an all-reduce (a reduce-scatter, then an all-gather)."""
    return (2 if kind == "all_reduce" else 1) * (n - 1)


def tp_collective_parts(hw: Hardware, kind: str, nbytes: float, tp: int) -> tuple[float, float]:
    """(wait, transfer) of one tensor-parallel collective: `collective_parts`, plus the cluster's
    wait per ring step of a tp collective (`Hardware.tp_step_wait_s`; 0 on a healthy cluster)."""
    wait, transfer = collective_parts(hw, kind, nbytes, tp)
    if tp > 1:
        wait += ring_steps(kind, tp) * hw.tp_step_wait_s
    return wait, transfer


def collective_time(hw: Hardware, kind: str, nbytes: float, n: int, stride: int = 1) -> float:
    """Time of one collective (see `collective_parts`): its waits plus its transfer."""
    return sum(collective_parts(hw, kind, nbytes, n, stride))


def p2p_time(hw: Hardware, nbytes: float, crosses_node: bool) -> float:
    link = hw.inter if crosses_node else hw.intra
    return link.latency_s + hw.wakeup_s + nbytes / link.bw("p2p")


# ------------------------------------------------------------------------------------------------
# Compute


def gemm_time(hw: Hardware, m: float, n: float, k: float, dtype: str) -> float:
    """One GEMM (m x k) @ (k x n): the slower of its FLOPs at the size-dependent achieved rate and its
    HBM traffic."""
    flops = 2.0 * m * n * k
    if flops <= 0:
        return 0.0
    eff = hw.matmul_eff_max * flops / (flops + hw.matmul_half_flops)
    bytes_moved = DTYPE_BYTES[dtype] * (m * k + k * n + m * n)
    return max(flops / (hw.peak(dtype) * eff), bytes_moved / (hw.hbm_bw * hw.hbm_eff))


def cached_share(hw: Hardware, working_set: float | None) -> float:
    """The share of a memory-bound pass's traffic served by a core's own cache: all of it while
    its tensors (`working_set` bytes) fit, cache_bytes / working_set beyond (a pass streams through
    tensors larger than the cache, which keeps about its size of them). 0 without a cache model."""
    if not (hw.cache_bytes and hw.cached_eff and working_set):
        return 0.0
    return min(1.0, hw.cache_bytes / working_set)


def block_working_set(tokens: float, hidden: int, ffn: int, dtype_bytes: int, tp: int = 1,
                      sp_div: int = 1) -> float:
    """The widest activation of a block's elementwise work (bytes per rank): what a core's cache
    must hold for that work to run in it."""
    return dtype_bytes * tokens * max(hidden / sp_div, ffn / tp)


def memory_time(hw: Hardware, nbytes: float, working_set: float | None = None) -> float:
    """Memory-bound work: `nbytes` of traffic at the copy bandwidth times `hbm_eff`, the share that
    a core's cache serves (`cached_share`) at `cached_eff` instead. Without `working_set`, tensors
    as large as a model's parameters or logits: out of any cache."""
    c = cached_share(hw, working_set)
    return nbytes / hw.hbm_bw * ((c / hw.cached_eff if c else 0.0) + (1 - c) / hw.hbm_eff)


@dataclass
class Prediction:
    """Predicted step of one layout. Times in seconds; `breakdown` holds the exposed time of each
    part over one optimizer step (they sum to `step_time_s`)."""

    layout: Layout
    hardware: str
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)
    memory_bytes: float | None = None
    fits: bool | None = None
    # Why ultrascale's engine would refuse this layout (rules.engine_violations), when a plan for
    # another runtime ranks it; empty for what our engine runs.
    unsupported: list[str] = field(default_factory=list)

    @property
    def dominant(self) -> str:
        return max(self.breakdown, key=self.breakdown.get)

    def shares(self) -> dict[str, float]:
        return {k: v / self.step_time_s for k, v in self.breakdown.items()}

    def as_dict(self) -> dict:
        out = {"layout": self.layout.short(), "layout_fields": self.layout.as_dict(),
               "hardware": self.hardware, "step_time_s": self.step_time_s,
               "tokens_per_s": self.tokens_per_s,
               "tokens_per_s_per_device": self.tokens_per_s_per_device, "mfu": self.mfu,
               "breakdown_s": self.breakdown, "dominant": self.dominant,
               "memory_bytes": self.memory_bytes, "fits": self.fits}
        if self.unsupported:
            out["ultrascale_refuses"] = list(self.unsupported)
        return out


@dataclass
class MicroBatchShape:
    """Per-rank sizes of one micro-batch, derived once per layout (`micro_batch_shape`)."""

    tokens: float  # tokens a rank's GEMMs see (micro-batch x seq / cp)
    h: int
    kv: int  # k/v projection width
    f: int
    v: int
    tp: int
    dtype: str  # the blocks' matmuls (fp8: quantised inputs, fp8 rates)
    sp_div: int  # tp when sequence parallel shards norms and residuals, else 1

    @property
    def store(self) -> str:
        """The dtype of activations, parameters and everything but the blocks' matmuls (bf16
        under fp8: layout.STORAGE_DTYPE)."""
        return STORAGE_DTYPE[self.dtype]


def micro_batch_shape(model: ModelConfig, lay: Layout) -> MicroBatchShape:
    return MicroBatchShape(tokens=lay.mbs * lay.seq_len / lay.cp, h=model.hidden_size,
                           kv=model.num_kv_heads * model.head_dim, f=model.ffn_hidden_size,
                           v=model.vocab_size, tp=lay.tp, dtype=lay.dtype,
                           sp_div=lay.tp if lay.sequence_parallel else 1)


def block_times(model: ModelConfig, lay: Layout, hw: Hardware,
                sh: MicroBatchShape | None = None) -> dict[str, float]:
    """Forward and backward time of one transformer block for one micro-batch, by part:
    matmul_f/_b, attention_f/_b, elementwise_f/_b and recompute (seconds). `sh` defaults to
    `micro_batch_shape(model, lay)`. For a mixture of experts whose first `first_k_dense` layers
    are dense, the model's average block."""
    sh = sh or micro_batch_shape(model, lay)
    if not model.num_experts:
        return _block_times(model, lay, hw, sh, moe=False)
    moe = _block_times(model, lay, hw, sh, moe=True)
    dense = model_params.dense_layers(model)
    if not dense:
        return moe
    plain = _block_times(model, lay, hw, sh, moe=False)
    w = dense / model.num_layers
    return {k: w * plain[k] + (1 - w) * moe[k] for k in moe}


def _block_times(model: ModelConfig, lay: Layout, hw: Hardware, sh: MicroBatchShape,
                 moe: bool) -> dict[str, float]:
    T, h, kv, f, tp, dt = sh.tokens, sh.h, sh.kv, sh.f, sh.tp, sh.dtype
    fwd_mm = (gemm_time(hw, T, (h + 2 * kv) / tp, h, dt)  # q, k, v
              + gemm_time(hw, T, h, h / tp, dt))  # output projection
    act_f = 1
    if moe:
        # Each rank runs its E/ep experts (of width moe_ffn_hidden_size) on the tokens routed to
        # them, T * top_k rows in all: one grouped GEMM per projection, each expert's share as
        # fast as a GEMM of its rows. The routed experts are not linear layers: under fp8 they
        # stay in bf16 (docs/precision.md); shared experts are, and run in fp8. The router
        # multiplies in fp32 (models/moe.py).
        f = model_params.expert_ffn(model)
        e_local = model.num_experts / lay.ep
        per_expert = T * model.experts_top_k / e_local
        fwd_mm += e_local * (gemm_time(hw, per_expert, 2 * f / tp, h, sh.store)
                             + gemm_time(hw, per_expert, h, f / tp, sh.store))
        fwd_mm += gemm_time(hw, T, model.num_experts, h, "fp32")  # router
        if model.shared_experts:
            fwd_mm += model.shared_experts * (gemm_time(hw, T, 2 * f / tp, h, dt)
                                              + gemm_time(hw, T, h, f / tp, dt))
        act_f = model.experts_top_k + model.shared_experts
    else:
        fwd_mm += gemm_time(hw, T, 2 * f / tp, h, dt) + gemm_time(hw, T, h, f / tp, dt)
    # Causal attention: QK^T and PV over half the (T x seq) score matrix; the backward runs five such
    # products (flash attention recomputes the scores).
    attn_flops = 2 * 2 * T * lay.seq_len * (h / tp) * 0.5
    attn_f = attn_flops / (hw.peak(sh.store) * hw.attention_eff)  # attention stays in bf16
    b = DTYPE_BYTES[sh.store]
    elem_bytes = b * T * (10 * h / sh.sp_div + 2 * (h + kv) / tp + 3 * act_f * f / tp)
    if dt == "fp8":
        # Quantising each matmul's inputs (models/ops.py): a pass for the scales and one for the
        # 8-bit copy, reading the bf16 input twice and writing one byte, of the four distinct
        # activation inputs forward (the two norm outputs, whole sequences under sequence
        # parallel, the attention output, the SwiGLU product); the backward quantises the
        # gradients and transposed copies, about twice that (elementwise_b). The weights, a
        # small share at these token counts, are left out.
        elem_bytes += (2 * b + 1) * T * (2 * h + h / tp + act_f * f / tp)
    elem_f = memory_time(hw, elem_bytes, block_working_set(T, h, f, b, tp, sh.sp_div))
    out = {"matmul_f": fwd_mm, "matmul_b": 2 * fwd_mm, "attention_f": attn_f,
           "attention_b": 2.5 * attn_f, "elementwise_f": elem_f, "elementwise_b": 2 * elem_f}
    if lay.recompute == "full":
        out["recompute"] = fwd_mm + attn_f + elem_f
    elif lay.recompute == "selective":
        out["recompute"] = attn_f
    else:
        out["recompute"] = 0.0
    return out


def rank_share(hw: Hardware, ranks_on_node: int) -> tuple[float, float]:
    """(shared, alone): the cores one rank computes on when every rank of its node is busy, and
    when it runs alone. On a CPU profile each rank gets cores // ranks threads (at least one, as
    the launcher sets OMP_NUM_THREADS); ranks that outnumber the cores time-share them, each getting
    cores / ranks of a core while all compute. A GPU computes on its own: (1, 1)."""
    if not hw.host_cores:
        return 1.0, 1.0
    n = max(1, ranks_on_node)
    threads = max(1, hw.host_cores // n)
    return min(float(threads), hw.host_cores / n), float(threads)


def rank_hardware(hw: Hardware, share: float, alone: float | None = None) -> Hardware:
    """The profile as one rank sees it: a CPU profile's per-core compute and memory rates scaled
    to the rank's share of the cores; the host overhead per layer (one Python thread) only slows
    down when the rank gets less than a core; the wake-up after each blocking transfer only counts
    when the ranks outnumber the cores (share below the rank's threads, `alone`). Links are
    measured with every rank running, as is."""
    if not hw.host_cores:
        return hw
    crowded = share < (alone if alone is not None else 1.0)
    return hw.with_(peak_flops={k: v * share for k, v in hw.peak_flops.items()},
                    hbm_bw=hw.hbm_bw * share,
                    layer_overhead_s=hw.layer_overhead_s / min(1.0, share),
                    wakeup_s=hw.wakeup_s if crowded else 0.0)


def pp_crosses_nodes(lay: Layout, hw: Hardware) -> bool:
    """Whether neighbouring pipeline stages sit on different nodes (pp is outermost)."""
    return lay.pp > 1 and lay.tp * lay.cp * lay.dp >= hw.devices_per_node


def _tp_layer_comm(lay: Layout, hw: Hardware, sh: MicroBatchShape,
                   parts: list[tuple[float, float]]) -> tuple[float, float]:
    """(wait, transfer) of the tp (and sequence-parallel) collectives of one block that show,
    forward plus backward (`tp_block_collectives` counts them); `parts`: `_tp_kinds`. Every ring
    step waits `Hardware.tp_step_wait_s` on a cluster that has such a wait (`tp_collective_parts`)."""
    if lay.tp == 1:
        return 0.0, 0.0
    counts = _block_collectives(lay, hw, sh, parts)
    return tuple(sum(c * p[i] for c, p in zip(counts, parts)) for i in (0, 1))


def _tp_kinds(lay: Layout, hw: Hardware, sh: MicroBatchShape) -> list[tuple[float, float]]:
    """(wait, transfer) of one tp collective of the micro-batch's activations, for each kind a
    block runs: [all-gather, reduce-scatter] with sequence parallel, [all-reduce] without."""
    act = sh.tokens * sh.h * DTYPE_BYTES[sh.store]
    kinds = ("all_gather", "reduce_scatter") if lay.sequence_parallel else ("all_reduce",)
    return [tp_collective_parts(hw, kind, act, lay.tp) for kind in kinds]


def _block_collectives(lay: Layout, hw: Hardware, sh: MicroBatchShape,
                       parts: list[tuple[float, float]]) -> tuple[float, ...]:
    """See `tp_block_collectives`; `parts`: `_tp_kinds`."""
    # The column-parallel linears' backward GEMMs each cost what their forward GEMM does.
    column_gemms = (gemm_time(hw, sh.tokens, (sh.h + 2 * sh.kv) / lay.tp, sh.h, sh.dtype),
                    gemm_time(hw, sh.tokens, 2 * sh.f / lay.tp, sh.h, sh.dtype))
    if not lay.sequence_parallel:
        return (2 + sum(1 - hidden_share(parts[0], g, hw) for g in column_gemms),)
    gather, scatter = parts
    return (4 + sum(1 - hidden_share(gather, g, hw) for g in column_gemms),
            2 + sum(1 - hidden_share(scatter, g, hw) for g in column_gemms))


def tp_block_collectives(model: ModelConfig, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """How many tp collectives of one block show, forward plus backward: (all-gathers,
    reduce-scatters) with sequence parallel, (all-reduces, 0) without; fractions where a GEMM
    hides part of one.

    With sequence parallel, forward: an all-gather into each of the two column-parallel linears
    (qkv, gate/up) and a reduce-scatter out of each row-parallel one (output, down). Backward: an
    all-gather of each row-parallel output's gradient; and in each column-parallel linear, which
    keeps only its sharded input, an all-gather of that input again beside the input-gradient
    GEMM, then the reduce-scatter of the input gradient beside the weight-gradient GEMM
    (parallel/tensor_layers.py `_ColumnParallel`; nanotron's asynchronous column linear with its
    default `tp_recompute_allgather` runs the same). Without sequence parallel: an all-reduce out of
    each row-parallel linear forward, and one of each column-parallel input gradient backward,
    beside the weight-gradient GEMM. A collective beside a GEMM shows as far as it outlasts it
    (`hidden_share`): a block shows 6 to 10 collectives (2 to 4 without sequence parallel)."""
    if lay.tp == 1:
        return 0.0, 0.0
    sh = micro_batch_shape(model, lay)
    counts = _block_collectives(lay, hw, sh, _tp_kinds(lay, hw, sh))
    return (counts[0], counts[1] if len(counts) > 1 else 0.0)


def _tp_ends_comm(lay: Layout, hw: Hardware, sh: MicroBatchShape, parts: list[tuple[float, float]],
                  head_f: float, loss_all_reduces: int
                  ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(wait, transfer) of the tp collectives outside the blocks, per micro-batch, forward plus
    backward: (on the stage with the output head, on the stage with the embedding); `parts`:
    `_tp_kinds`.

    The head is a column-parallel linear over the vocabulary (as in `tp_block_collectives`: its
    input gathered forward, gathered again beside its input-gradient GEMM and its input gradient
    reduced beside its weight-gradient GEMM; without sequence parallel only that reduction), and
    the vocabulary-parallel cross-entropy all-reduces a few fp32 numbers per token
    (`loss_all_reduces` of them: latency). The vocabulary-parallel embedding sums its partial rows
    forward (a reduce-scatter, or an all-reduce), and with sequence parallel gathers its gradient
    backward."""
    if lay.tp == 1:
        return (0.0, 0.0), (0.0, 0.0)
    loss = tp_collective_parts(hw, "all_reduce", sh.tokens * DTYPE_BYTES["fp32"], lay.tp)
    if lay.sequence_parallel:
        gather, scatter = parts
        gathers = 2 - hidden_share(gather, head_f, hw)
        scatters = 1 - hidden_share(scatter, head_f, hw)
        embedding = tuple(g + s for g, s in zip(gather, scatter))
    else:
        gather = scatter = embedding = parts[0]
        gathers, scatters = 0.0, 1 - hidden_share(scatter, head_f, hw)
    head = tuple(gathers * g + scatters * s + loss_all_reduces * lo
                 for g, s, lo in zip(gather, scatter, loss))
    return head, embedding


def hidden_share(collective: tuple[float, float], gemm: float, hw: Hardware) -> float:
    """The share of a collective (wait, transfer) that hides under a GEMM of `gemm` seconds
    running beside it: all of it, or as much as the GEMM lasts, on a GPU (the collective's
    kernels run beside the GEMM's); none on a CPU profile (`Hardware.host_cores`), whose cores do
    both the GEMM and the transfer."""
    if hw.host_cores:
        return 0.0
    total = sum(collective)
    return min(1.0, gemm / total) if total > 0 else 1.0


def _cp_layer_comm(lay: Layout, hw: Hardware, sh: MicroBatchShape, attn_f: float,
                   attn_b: float) -> float:
    """Context-parallel attention's transfers of one block, forward plus backward, as the engine
    runs them (parallel/ring_attention.py, parallel/context.py):

    - ring: cp-1 shifts of the local K and V forward, each hidden under the attention of the
      block in hand where it is long enough; backward, cp-1 shifts of K and V again and of the
      dK/dV accumulators (fp32);
    - all_gather: K and V gathered forward and again backward (the own block computed under each
      gather), dK/dV (fp32) reduce-scattered;
    - ulysses: all-to-alls of q, k, v and the output forward, of their gradients backward, in the
      critical path (attention waits for them)."""
    cp = lay.cp
    if cp == 1:
        return 0.0
    b = DTYPE_BYTES[sh.store]
    kv = 2 * sh.tokens * sh.kv / sh.tp  # elements of this rank's K and V
    if lay.cp_mode == "all_gather":
        gather = collective_time(hw, "all_gather", cp * kv * b, cp, stride=lay.tp)
        scatter = collective_time(hw, "reduce_scatter", cp * kv * 4, cp, stride=lay.tp)
        return (max(0.0, gather - attn_f / cp) + max(0.0, gather - attn_b / cp) + scatter)
    if lay.cp_mode == "ulysses":
        q = sh.tokens * sh.h / sh.tp
        return 2 * collective_time(hw, "all_to_all", (2 * q + kv) * b, cp, stride=lay.tp)
    step = collective_time(hw, "p2p", kv * b, 2, stride=lay.tp)
    dkv = collective_time(hw, "p2p", kv * 4, 2, stride=lay.tp)
    fwd = (cp - 1) * max(0.0, step - attn_f / cp)
    bwd = (cp - 1) * max(0.0, step + dkv - attn_b / cp)
    return fwd + bwd


def moe_cp_layer_comm(model: ModelConfig, lay: Layout, hw: Hardware) -> float:
    """What an MoE layer adds to context parallel's transfers, per the model's average block,
    forward plus backward, as parallel/context.py runs it: the sequence-wise auxiliary loss
    all-reduces its per-sequence expert counts ([micro-batch, E] fp32) over cp, and a capacity
    factor all-gathers the choices (micro-batch x seq_len / cp x top_k int64 per rank), once per
    forward (twice under full recomputation, whose replay runs them again). Small and in the
    critical path: their latency, mostly."""
    if not model.num_experts or lay.cp == 1:
        return 0.0
    moe_share = 1 - model_params.dense_layers(model) / model.num_layers
    per_forward = 0.0
    if model.balance == "aux_loss" and model.aux_loss_coeff:
        per_forward += collective_time(hw, "all_reduce", lay.mbs * model.num_experts * 4, lay.cp,
                                       stride=lay.tp)
    if model.capacity_factor is not None:
        per_forward += collective_time(hw, "all_gather",
                                       lay.mbs * lay.seq_len * model.experts_top_k * 8, lay.cp,
                                       stride=lay.tp)
    return moe_share * (2 if lay.recompute == "full" else 1) * per_forward


def _ep_layer_comm(model: ModelConfig, lay: Layout, hw: Hardware, sh: MicroBatchShape) -> float:
    """Token dispatch and combine all-to-alls of the model's average block, forward plus
    backward: `expert_alltoall_bytes` (what parallel/expert.py sends) in each of the four
    exchanges, six under full recomputation (its forward replays them); dense layers none."""
    if not model.num_experts or lay.ep == 1:
        return 0.0
    moe_share = 1 - model_params.dense_layers(model) / model.num_layers
    exchanges = 6 if lay.recompute == "full" else 4
    # collective_time takes the buffer whose (ep - 1) / ep leaves the rank.
    buffer = sh.tokens * model.experts_top_k * sh.h * DTYPE_BYTES[sh.store] / (
        lay.tp if lay.sequence_parallel else 1)
    return moe_share * exchanges * collective_time(hw, "all_to_all", buffer, lay.ep,
                                                   stride=lay.tp * lay.cp)


def expert_alltoall_bytes(model: ModelConfig, lay: Layout) -> float:
    """Bytes one rank sends in one exchange of one MoE layer and micro-batch, routing balanced:
    the rows of its tokens routed to experts on other ep ranks (tokens x top_k x (ep - 1) / ep),
    hidden_size wide, in the activations' dtype (bf16 under fp8); counted by comm.all_to_all
    exactly so."""
    tokens = lay.mbs * lay.seq_len / lay.cp
    return (tokens * model.experts_top_k * (lay.ep - 1) / lay.ep * model.hidden_size
            * storage_bytes(lay.dtype))


# ------------------------------------------------------------------------------------------------
# Pipeline


@lru_cache(maxsize=4096)
def _simulated_total(schedule: str, pp: int, m: int, v: int, ratio: float) -> float:
    from ultrascale.parallel.pipeline.simulator import simulate

    return float(simulate(schedule, pp, m, v=v, t_f=1.0, t_b=ratio).total_time)


def _pipeline_total_unit(schedule: str, pp: int, m: int, v: int, ratio: float) -> float:
    """Total time of the schedule with a stage forward of 1 and backward of `ratio` (the result
    scales linearly with the stage times).

    Past the warm-up every schedule runs in a steady state, so the total grows linearly with m: for
    long runs two shorter simulations (same m mod pp, so the schedule accepts them) extrapolate.
    """
    short = pp
    if m <= 2 * short:
        return _simulated_total(schedule, pp, m, v, ratio)
    m_a = short + m % pp
    m_b = m_a + pp
    t_a = _simulated_total(schedule, pp, m_a, v, ratio)
    t_b = _simulated_total(schedule, pp, m_b, v, ratio)
    return t_a + (m - m_a) * (t_b - t_a) / (m_b - m_a)


RATIO_STEP = 0.5  # grid of backward/forward ratios the simulator is run at


def pipeline_time(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
    """Total time of the schedule for stage times t_f, t_b (whole stage, all v chunks).

    The simulated total is piecewise linear in t_b / t_f, so it is simulated on a grid of ratios and
    interpolated: thousands of layouts then share a few dozen simulations.
    """
    if pp == 1:
        return m * (t_f + t_b)
    ratio = t_b / t_f
    lo = math.floor(ratio / RATIO_STEP) * RATIO_STEP
    hi = lo + RATIO_STEP
    t_lo = _pipeline_total_unit(schedule, pp, m, v, round(lo, 4))
    t_hi = _pipeline_total_unit(schedule, pp, m, v, round(hi, 4))
    return t_f * (t_lo + (t_hi - t_lo) * (ratio - lo) / RATIO_STEP)


@lru_cache(maxsize=1024)
def shared_pipeline_time(schedule: str, pp: int, m: int, v: int, work_f: tuple[float, ...],
                         work_b: tuple[float, ...], cores: float, threads: float,
                         group: int = 1, t_comm: float = 0.0) -> float:
    """Total time of a pipeline schedule whose ranks share `cores` (processor sharing).

    `work_f[r]`, `work_b[r]`: core-seconds of pipeline rank r's forward and backward of one
    micro-batch (all its chunks). Each rank is a group of `group` processes (its tp x cp ranks) of
    `threads` threads; at every moment the processes of the ranks that can run (their previous
    action done, their inputs arrived) split the cores evenly, each getting at most its threads.
    With as many cores as processes this is the plain schedule; with fewer, a rank left alone in
    the warm-up or the drain runs faster, and imbalance between stages is paid only where the
    dependencies make the others wait. An input from another rank arrives `t_comm` after the
    action that produced it (a transfer: no core is used meanwhile).
    """
    from ultrascale.parallel.pipeline.schedules import build_schedule, dependencies

    programs = [[a for a in prog if a.is_compute] for prog in build_schedule(schedule, pp, m, v)]
    present = {(r, a) for r, prog in enumerate(programs) for a in prog}

    def work(r: int, kind: str) -> float:
        share = {"F": work_f[r], "B": work_b[r], "I": work_b[r] / 2, "W": work_b[r] / 2}
        return share[kind] / v

    pos = [0] * pp
    done: dict = {}  # finished action -> when
    left: dict[int, float] = {}  # remaining work of the action each runnable rank is on
    now = 0.0
    while True:
        runnable, arrival = [], math.inf
        for r in range(pp):
            if pos[r] >= len(programs[r]):
                continue
            a = programs[r][pos[r]]
            deps = [d for d in dependencies(r, a, pp, v) if d in present]
            if not all(d in done for d in deps):
                continue
            ready = max([done[d] + (t_comm if d[0] != r else 0.0) for d in deps], default=0.0)
            if ready <= now + 1e-12:
                runnable.append(r)
                left.setdefault(r, work(r, a.kind))
            else:
                arrival = min(arrival, ready)
        if not runnable:
            if arrival == math.inf:
                break
            now = arrival
            continue
        rate = min(threads, cores / (group * len(runnable)))
        dt = min(min(left[r] for r in runnable) / rate, arrival - now)
        now += dt
        for r in runnable:
            left[r] -= dt * rate
            if left[r] <= 1e-12 * (1 + dt * rate):
                done[(r, programs[r][pos[r]])] = now
                pos[r] += 1
                del left[r]
    if any(pos[r] < len(programs[r]) for r in range(pp)):
        raise ValueError(f"schedule {schedule} with pp={pp}, m={m}, v={v} does not finish")
    return now


# ------------------------------------------------------------------------------------------------
# The step


def _overlapped(device: tuple[dict, dict], waits: tuple[dict, dict],
                overlap: float) -> tuple[dict, dict]:
    """Exposed parts of a micro-batch's (forward, backward) over a stage: the longer of its device
    work and its waits counts in full, `overlap` of the shorter hides under it. A GPU runs ahead
    of its host (kernels queue up through the forward and into the backward) and computes while a
    collective's latency passes; on a CPU nothing hides (`overlap` 0)."""
    d = sum(sum(p.values()) for p in device)
    w = sum(sum(p.values()) for p in waits)
    keep_device, keep_waits = (1.0, 1.0 - overlap) if d >= w else (1.0 - overlap, 1.0)
    passes = []
    for dev, wait in zip(device, waits):
        out = {k: val * keep_device for k, val in dev.items()}
        for k, val in wait.items():
            out[k] = out.get(k, 0.0) + val * keep_waits
        passes.append(out)
    return passes[0], passes[1]


def rank_layers(model: ModelConfig, lay: Layout) -> list[int]:
    """Layers on each pipeline rank: the sum of its virtual stages' shares, split as the engine
    splits them (`rules.layers_per_stage`: the last stages take the extra layers)."""
    split = layers_per_stage(model.num_layers, lay.pp * lay.pp_virtual_stages)
    return [sum(split[rank::lay.pp]) for rank in range(lay.pp)]


def cost_balanced_ranks(model: ModelConfig, pp: int,
                        strict: bool = True) -> list[tuple[int, bool]]:
    """(layers, holds the output head) of each pipeline rank, as nanotron splits a model: its
    blocks (the layers at 4 h^2 + 3 f h each, then the head at vocab x h) go to ranks in order, and
    a rank takes blocks until their summed cost passes its share of the total (the block that
    passes it included). A large head thus gets a rank with few layers or none, and the ranks
    after it hold nothing: 1.34B (the head = 4 layers) on pp 8 puts 3, 3, 2, 3, 2, 3 layers on
    ranks 0-5, the head alone on rank 6, and nothing on rank 7. `strict`: "passes" is > (nanotron's
    current test); False for >=, the version some of the playbook's runs used (they differ only
    on exact ties)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    costs = [4 * h * h + 3 * f * h] * model.num_layers + [model.vocab_size * h]
    total = sum(costs)
    layers, head = [0] * pp, [False] * pp
    rank, cumulative = 0, 0
    for i, cost in enumerate(costs):
        cumulative += cost
        if i < model.num_layers:
            layers[rank] += 1
        else:
            head[rank] = True
        share = total * (rank + 1) / pp
        if (cumulative > share if strict else cumulative >= share) and rank < pp - 1:
            rank += 1
    return list(zip(layers, head))


def busiest_stage_layers(model: ModelConfig, lay: Layout) -> int:
    """Layers on the most loaded pipeline rank (all of its virtual stages)."""
    return max(rank_layers(model, lay))


def stage_params(model: ModelConfig, lay: Layout) -> float:
    """Parameters held by one rank of the busiest stage (the one with the output head), the
    matmul weights split evenly (`params.even_split_params`): the first and last stage each hold
    a vocabulary matrix; a single stage holds two unless tied."""
    vocab_matrices = 2 if lay.pp == 1 and not model.tie_embeddings else 1
    return model_params.even_split_params(model, lay, busiest_stage_layers(model, lay),
                                          vocab_matrices)


def tied_grads_time(model: ModelConfig, lay: Layout, hw: Hardware) -> float:
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


# ------------------------------------------------------------------------------------------------
# The step: a sum of terms, one per dimension
#
# Every term gives one micro-batch's share on the costed pipeline rank (forward and backward device
# seconds, and waits, by breakdown key); the pipeline schedule turns those into the time of all m
# micro-batches, bubble included; the data-parallel reduction, the optimizer and ZeRO's gathers
# follow the last micro-batch.


@dataclass
class _Step:
    """What every term needs, derived once per prediction."""

    model: ModelConfig
    lay: Layout
    hardware: Hardware  # the job's profile (`Hardware.for_job`)
    hw: Hardware  # as one rank sees it (`rank_hardware`)
    runtime: Runtime
    share: float  # the cores a rank computes on (`rank_share`)
    alone: float
    sh: MicroBatchShape
    layer: dict[str, float]  # one block's times (`block_times`)
    head_f: float  # the output head's forward GEMM (vocabulary-parallel over tp)
    ce: float  # the cross-entropy's memory traffic, forward plus backward
    params: float  # parameters of a rank of the busiest stage (`stage_params`)
    layers: int  # layers of the busiest rank, the layers split evenly


@dataclass
class Term:
    """One dimension's part of a micro-batch on the costed pipeline rank, by breakdown key:
    device seconds of the forward and of the backward, and waits (host work, collective
    latencies) that overlap the device's work as far as `Hardware.host_overlap` says."""

    forward: dict[str, float]
    backward: dict[str, float]
    waits: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Placement:
    """What the costed pipeline rank holds: its layers, the output head (1 or 0), the embedding
    (1 or 0), and what the schedule's fill and drain gain when the other ranks are lighter."""

    layers: int
    with_head: float
    with_embedding: float
    fill_gain: float = 0.0


@dataclass(frozen=True)
class _TpCosts:
    """(wait, transfer) of the tp collectives of one micro-batch: of one block, of the ends on the
    rank with the output head and on the rank with the embedding (`_tp_ends_comm`)."""

    block: tuple[float, float]
    head: tuple[float, float]
    embedding: tuple[float, float]


def _setup(model: ModelConfig, lay: Layout, hardware: Hardware, runtime: str) -> _Step:
    world = lay.world_size
    hardware = hardware.for_job(math.ceil(world / hardware.devices_per_node))
    share, alone = rank_share(hardware, min(world, hardware.devices_per_node))
    hw = rank_hardware(hardware, share, alone)
    sh = micro_batch_shape(model, lay)
    return _Step(model=model, lay=lay, hardware=hardware, hw=hw, runtime=RUNTIMES[runtime],
                 share=share, alone=alone, sh=sh, layer=block_times(model, lay, hw, sh),
                 head_f=gemm_time(hw, sh.tokens, sh.v / lay.tp, sh.h, sh.store),  # never fp8
                 ce=memory_time(hw, sh.tokens * sh.v / lay.tp * CE_BYTES_PER_LOGIT),
                 params=stage_params(model, lay), layers=busiest_stage_layers(model, lay))


def _tp_costs(step: _Step) -> _TpCosts:
    lay, hw, sh = step.lay, step.hw, step.sh
    parts = _tp_kinds(lay, hw, sh)  # one collective of each kind the blocks and ends run
    head, embedding = _tp_ends_comm(lay, hw, sh, parts, step.head_f,
                                    step.runtime.loss_all_reduces)
    return _TpCosts(_tp_layer_comm(lay, hw, sh, parts), head, embedding)


def _p2p_per_chunk(step: _Step) -> float:
    """A micro-batch's activation in and gradient out of one pipeline chunk (crosses nodes when
    the inner dimensions fill one)."""
    lay, sh = step.lay, step.sh
    if lay.pp == 1:
        return 0.0
    act = sh.tokens * sh.h * storage_bytes(lay.dtype) / (lay.tp if lay.sequence_parallel else 1)
    return 2 * p2p_time(step.hw, act, crosses_node=pp_crosses_nodes(lay, step.hw))


def _zero3_gathers(step: _Step) -> float:
    """ZeRO-3: gather each layer's parameters forward and backward, every micro-batch, layer by
    layer, prefetched under that micro-batch's compute (as far as the device has room to overlap,
    `dp_overlap`). The gradients accumulate in full and are reduce-scattered once per step, after
    the last micro-batch, like ZeRO-1/2 (`_dp_reduce_time`)."""
    lay, hw, layer, stage_layers = step.lay, step.hw, step.layer, step.layers
    dp_shard = (lay.dp_shard or lay.dp) * lay.cp  # ZeRO shards over dp_shard x cp
    if not (lay.zero == 3 and dp_shard > 1):
        return 0.0
    per_layer = step.params / stage_layers
    stride = lay.tp
    gather = stage_layers * collective_time(hw, "all_gather", per_layer * storage_bytes(lay.dtype),
                                            dp_shard, stride)
    comp_f = stage_layers * (layer["matmul_f"] + layer["attention_f"])
    comp_b = stage_layers * (layer["matmul_b"] + layer["attention_b"])
    return max(0.0, gather - hw.dp_overlap * comp_f) + max(0.0, gather - hw.dp_overlap * comp_b)


def _grad_accum_time(step: _Step) -> float:
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


@dataclass(frozen=True)
class _Loads:
    """One micro-batch through one layer, the output head and the embedding, everything in
    series: what a pipeline rank carries (the cost-balanced split and time-shared cores)."""

    layer_f: float
    layer_b: float
    head_f: float
    head_b: float
    embedding: float


def _loads(step: _Step, tp: _TpCosts, cp_comm: float, ep_comm: float) -> _Loads:
    layer, hw = step.layer, step.hw
    tp_comm = tp.block[0] + tp.block[1]
    head_comm = tp.head[0] + tp.head[1]
    per_layer_f = (layer["matmul_f"] + layer["attention_f"] + layer["elementwise_f"]
                   + (tp_comm + cp_comm + ep_comm + hw.layer_overhead_s) / 2)
    per_layer_b = (layer["matmul_b"] + layer["attention_b"] + layer["elementwise_b"]
                   + layer["recompute"] + (tp_comm + cp_comm + ep_comm + hw.layer_overhead_s) / 2)
    return _Loads(per_layer_f, per_layer_b, step.head_f + (step.ce + head_comm) / 2,
                  2 * step.head_f + (step.ce + head_comm) / 2,
                  tp.embedding[0] + tp.embedding[1])


def _placement(step: _Step, loads: _Loads) -> _Placement:
    """The rank the prediction costs. With the even split, the one with the most layers and the
    output head (the last; without a pipeline it also embeds). When the runtime splits by cost,
    the busiest rank is found, and the schedule's fill and drain pass through the lighter ranks
    at their own pace (`fill_gain`)."""
    lay, model = step.lay, step.model
    if not (lay.pp > 1 and lay.pp_virtual_stages == 1 and step.runtime.pp_partition == "cost"):
        return _Placement(step.layers, 1.0, float(lay.pp == 1))
    ranks = cost_balanced_ranks(model, lay.pp)
    times = [n * (loads.layer_f + loads.layer_b) + (loads.head_f + loads.head_b if holds_head
                                                    else 0.0)
             + (loads.embedding if r == 0 else 0.0) for r, (n, holds_head) in enumerate(ranks)]
    busiest = max(range(lay.pp), key=times.__getitem__)
    # A 1F1B step is about (m - 1) passes of the busiest rank plus one of every rank.
    return _Placement(ranks[busiest][0], float(ranks[busiest][1]), float(busiest == 0),
                      fill_gain=lay.pp * times[busiest] - sum(times))


def _compute_term(step: _Step, at: _Placement) -> Term:
    """GEMMs, attention and elementwise work of the rank's layers and, on the last rank, the
    output head and the loss; recomputation in backward; the host's work per layer (a wait)."""
    n, layer, head = at.layers, step.layer, at.with_head
    return Term(
        forward={"matmul": n * layer["matmul_f"] + head * step.head_f,
                 "attention": n * layer["attention_f"],
                 "elementwise": n * layer["elementwise_f"] + head * step.ce / 2},
        backward={"matmul": n * layer["matmul_b"] + head * 2 * step.head_f,
                  "attention": n * layer["attention_b"],
                  "elementwise": n * layer["elementwise_b"] + head * step.ce / 2,
                  "recompute": n * layer["recompute"]},
        waits={"overhead": n * step.hw.layer_overhead_s / 2})


def _tp_term(step: _Step, at: _Placement, tp: _TpCosts) -> Term:
    """Tensor parallel's collectives: the blocks', the head's and the embedding's; their
    transfers are device time, their latencies waits."""
    def both(i: int) -> float:
        return (at.layers * tp.block[i] + at.with_head * tp.head[i]
                + at.with_embedding * tp.embedding[i]) / 2

    transfer = both(1)
    return Term({"tp_comm": transfer}, {"tp_comm": transfer}, {"tp_comm": both(0)})


def _per_layer_term(key: str, layers: int, per_layer: float) -> Term:
    """A collective of every block, half in the forward, half in the backward (cp's ring
    exchange, ep's all-to-alls)."""
    return Term({key: layers * per_layer / 2}, {key: layers * per_layer / 2})


def _pp_term(step: _Step, p2p: float) -> Term:
    """Pipeline parallel's point-to-point transfers, per chunk of the rank (its bubble is the
    schedule's: `_pipeline_total`)."""
    v = step.lay.pp_virtual_stages
    return Term({"pp_p2p": v * p2p / 2}, {"pp_p2p": v * p2p / 2})


def _sum_terms(terms: list[Term]) -> tuple[dict, dict, dict]:
    """The terms added key by key: (forward, backward, waits) of one micro-batch."""
    out: tuple[dict, dict, dict] = ({}, {}, {})
    for term in terms:
        for total, part in zip(out, (term.forward, term.backward, term.waits)):
            for k, val in part.items():
                total[k] = total[k] + val if k in total else val
    return out


def _shared_pipeline_total(step: _Step, loads: _Loads, zero3: float, accum: float,
                           p2p: float) -> float:
    """Ranks share the node's cores: simulate the schedule with each rank's own stage (layers,
    the head on the last) and the cores divided among the ranks that have work at each moment,
    so that idle stages hand their cores to busy ones."""
    lay, hardware, share = step.lay, step.hardware, step.share
    v = lay.pp_virtual_stages
    common_f, common_b = zero3 / 3, 2 * zero3 / 3 + accum  # transfers: delays below
    split = layers_per_stage(step.model.num_layers, lay.pp * v)
    work_f, work_b = [], []
    for r in range(lay.pp):
        n_layers, last = sum(split[r::lay.pp]), r == lay.pp - 1
        ends_f = (loads.head_f if last else 0.0) + (loads.embedding / 2 if r == 0 else 0.0)
        ends_b = (loads.head_b if last else 0.0) + (loads.embedding / 2 if r == 0 else 0.0)
        work_f.append(share * (n_layers * loads.layer_f + common_f + ends_f))
        work_b.append(share * (n_layers * loads.layer_b + common_b + ends_b))
    group = lay.tp * lay.cp
    ranks_on_node = min(lay.world_size, hardware.devices_per_node)
    cores = hardware.host_cores * lay.pp * group / ranks_on_node  # one pipeline's share
    return shared_pipeline_time(lay.pp_schedule, lay.pp, lay.grad_accum, v, tuple(work_f),
                                tuple(work_b), cores, step.alone, group, p2p / 2)


def _dp_reduce_time(step: _Step, backward_matmul: float) -> float:
    """The data-parallel gradient reduction after the last micro-batch (all-reduce, or
    reduce-scatter with ZeRO, then across the groups of hybrid sharding).

    It runs bucket by bucket as gradients become ready; buckets queue back to back on the
    communication stream, so the transfer time adds up and the start-up latency shows once
    (collective_time of the whole buffer), while each bucket, a collective of its own, pays the
    ring's per-step latency (`Hardware.ring_step_s`); the last bucket stays exposed after the
    backward. The rest overlaps the last micro-batch's backward (the GEMMs of its last chunk,
    `backward_matmul` over the rank's chunks; the Layout has no switch for it: the trainer always
    overlaps), as far as the device has room (`dp_overlap`) and the runtime lets it: nanotron's
    ZeRO reduce-scatter holds the backward up instead."""
    lay, hw = step.lay, step.hw
    if lay.dp * lay.cp == 1:
        return 0.0
    # Gradients are summed over dp x cp (cp ranks saw other tokens of the same sequences), and
    # ZeRO shards over dp_shard x cp; cp sits next to tp, so the group's ranks are tp apart.
    shard = (lay.dp_shard or lay.dp) * lay.cp
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
    if lay.zero > 0 and not step.runtime.zero_reduce_overlaps:
        hidden = 0.0
    return max(reduce / buckets, reduce - hidden)


def _optimizer_time(step: _Step) -> float:
    """The optimizer update: its memory traffic over the rank's shard of the parameters."""
    lay = step.lay
    shard = (lay.dp_shard or lay.dp) * lay.cp if lay.zero >= 1 else 1
    return memory_time(step.hw, step.params / shard * step.hw.optimizer_bytes_per_param)


def _muon_time(step: _Step) -> float:
    """Muon (optim/muon.py): Newton-Schulz on the busiest stage's matrices, in fp32, dealt over
    the ranks that share them (ZeRO's shard group, or without ZeRO the data-parallel replicas, x
    tp), and the all-to-alls that gather each matrix and scatter it back
    (parallel/muon_exchange.py: a rank's share of its matrices, there and back; without ZeRO
    only back, to every replica)."""
    lay, hw, model = step.lay, step.hw, step.model
    if lay.optimizer != "muon":
        return 0.0
    shard = ((lay.dp_shard or lay.dp) if lay.zero >= 1 else lay.dp) * lay.cp
    dense = model_params.dense_layers(model)
    total = 0.0
    for moe, share in ((False, dense / model.num_layers), (True, 1 - dense / model.num_layers)):
        if share <= 0 or (moe and not model.num_experts):
            continue
        for count, rows, cols in model_params.layer_matrix_shapes(model, moe):
            a, b = min(rows, cols), max(rows, cols)
            one = sum(gemm_time(hw, *dims, "fp32") for dims in ((a, a, b), (a, a, a), (a, b, a)))
            total += share * count * model_params.NS_STEPS * one
    compute = total * step.layers / (shard * lay.tp)
    local = model_params.stage_matrix_params(model, lay, step.layers, 0)
    elements = local[0] / shard + local[1] / max(shard // lay.ep, 1)
    if lay.zero >= 1:
        comm = 2 * collective_time(hw, "all_to_all", 4 * elements, shard, lay.tp)
    else:  # each replica's results to all the others: an all-gather's traffic
        comm = collective_time(hw, "all_gather", 4 * elements * shard, shard, lay.tp)
    comm += 2 * collective_time(hw, "all_to_all", 4 * elements, lay.tp)
    return compute + comm


def _zero_allgather_time(step: _Step) -> float:
    """ZeRO-1/2 gather the updated parameters back to every rank of the shard group."""
    lay = step.lay
    dp_shard = (lay.dp_shard or lay.dp) * lay.cp
    if lay.zero not in (1, 2) or dp_shard <= 1:
        return 0.0
    return collective_time(step.hw, "all_gather", step.params * storage_bytes(lay.dtype), dp_shard,
                           lay.tp)


def predict(model: ModelConfig, layout: Layout, hardware: Hardware, nodes: int | None = None,
            memory: bool = True, runtime: str = "ultrascale") -> Prediction:
    """Predict one step of `layout` training `model` on `hardware`.

    `nodes`, when given, is checked against the layout's world size. With `memory`, the memory
    estimator's total and `fits` are attached. `runtime` names the implementation that runs the
    step (ours, or "nanotron" for the playbook runs): its memory, its pipeline split, its loss's
    all-reduces, and whether its ZeRO reduce-scatter overlaps the backward.
    """
    lay = layout
    world = lay.world_size
    if nodes is not None and world > nodes * hardware.devices_per_node:
        raise ValueError(f"layout {lay.short()} needs {world} devices but {nodes} node(s) of "
                         f"{hardware.devices_per_node} hold only "
                         f"{nodes * hardware.devices_per_node}.")
    step = _setup(model, lay, hardware, runtime)
    hw, m = step.hw, lay.grad_accum
    # Each dimension's cost of one micro-batch on one rank.
    tp = _tp_costs(step)
    cp_comm = (_cp_layer_comm(lay, hw, step.sh, step.layer["attention_f"],
                              step.layer["attention_b"]) + moe_cp_layer_comm(model, lay, hw))
    ep_comm = _ep_layer_comm(model, lay, hw, step.sh)
    p2p, zero3, accum = _p2p_per_chunk(step), _zero3_gathers(step), _grad_accum_time(step)
    loads = _loads(step, tp, cp_comm, ep_comm)
    at = _placement(step, loads)
    f_device, b_device, waits = _sum_terms([
        _compute_term(step, at), _tp_term(step, at, tp),
        _per_layer_term("cp_comm", at.layers, cp_comm),
        _per_layer_term("ep_comm", at.layers, ep_comm), _pp_term(step, p2p),
        Term({"zero_gather": zero3 / 3}, {"zero_gather": 2 * zero3 / 3}),
        Term({}, {"elementwise": accum})])
    f_parts, b_parts = _overlapped((f_device, b_device), (waits, waits), hw.host_overlap)
    t_f, t_b = sum(f_parts.values()), sum(b_parts.values())
    # The m micro-batches through the schedule; whatever it takes beyond their work is bubble. (A
    # time-shared pipeline can take less than the busiest stage's work at the shared speed: that
    # stage then runs faster, and its parts shrink in proportion.)
    if lay.pp > 1 and step.hardware.host_cores:
        total_pipe = _shared_pipeline_total(step, loads, zero3, accum, p2p)
    else:
        total_pipe = pipeline_time(lay.pp_schedule, lay.pp, m, lay.pp_virtual_stages, t_f, t_b)
        total_pipe = max(m * (t_f + t_b), total_pipe - at.fill_gain)
    work = m * (t_f + t_b)
    scale = min(1.0, total_pipe / work) if work > 0 else 1.0
    breakdown: dict[str, float] = {}
    for parts in (f_parts, b_parts):
        for k, val in parts.items():
            breakdown[k] = breakdown.get(k, 0.0) + val * m * scale
    breakdown["pp_bubble"] = max(0.0, total_pipe - work)
    # After the last micro-batch: gradient reduction, optimizer step, parameter all-gather.
    breakdown["dp_comm"] = _dp_reduce_time(step, b_device["matmul"])
    breakdown["tied_grads"] = tied_grads_time(model, lay, hw)
    breakdown["optimizer"] = _optimizer_time(step) + _muon_time(step)
    breakdown["zero_gather"] = breakdown.get("zero_gather", 0.0) + _zero_allgather_time(step)
    breakdown = {k: val for k, val in breakdown.items() if val > 0}
    step_time = sum(breakdown.values())

    tps = lay.global_batch_tokens / step_time
    per_dev = tps / world
    mfu = per_dev * model.flops_per_token(lay.seq_len) / hw.peak(lay.dtype)
    pred = Prediction(layout=lay, hardware=hw.name, step_time_s=step_time, tokens_per_s=tps,
                      tokens_per_s_per_device=per_dev, mfu=mfu, breakdown=breakdown)
    if memory:
        est = estimate_memory(model, lay, hw, runtime)
        pred.memory_bytes, pred.fits = est.total, est.fits
    return pred


def estimate_memory(model: ModelConfig, layout: Layout, hw: Hardware, runtime: str = "ultrascale",
                    headroom: float = 0.0):
    """The memory estimator's answer for this layout on this device (bytes, fits): the estimate
    against the device's memory less what the CUDA context and NCCL hold
    (`Hardware.usable_memory_bytes`). `runtime` names the implementation whose tensors are counted
    (ours, or "nanotron" for the playbook runs)."""
    uneven = uneven_pp_layers(model, layout) is not None
    return estimate(model, layout, device_memory=int(hw.usable_memory_bytes), runtime=runtime,
                    headroom=headroom, pp_layers=rank_layers(model, layout) if uneven else None)


def uneven_pp_layers(model: ModelConfig, layout: Layout) -> list[int] | None:
    """The layers of each (virtual) stage the prediction assumes when the stages do not divide the
    layers (`rules.layers_per_stage`, the engine's own split), as `parallel.pp_layers` takes them;
    None when they divide evenly."""
    stages = layout.pp * layout.pp_virtual_stages
    return layers_per_stage(model.num_layers, stages) if model.num_layers % stages else None
