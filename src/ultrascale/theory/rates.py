"""What the hardware charges: a collective on the links it crosses, a GEMM at its size's rate,
memory-bound work at the copy bandwidth, and a rank's share of a CPU node's cores.

Every term's seconds are made of these. `hw` is a `planner.hardware.Hardware` profile (plain
data: the theory reads its fields and never imports it). Torch-free.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ultrascale.layout import DTYPE_BYTES

if TYPE_CHECKING:
    from ultrascale.planner.hardware import Hardware


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
    HBM traffic. The rate: peak x eff_max x F / (F + half_flops), times d / (d + half_dim) for
    its smallest dimension d where the profile measured one (`Hardware.matmul_curve`)."""
    flops = 2.0 * m * n * k
    if flops <= 0:
        return 0.0
    half_flops, half_dim = hw.matmul_curve(dtype)
    eff = hw.matmul_eff_max * flops / (flops + half_flops)
    if half_dim:
        narrow = min(m, n, k)
        eff *= narrow / (narrow + half_dim)
    bytes_moved = DTYPE_BYTES[dtype] * (m * k + k * n + m * n)
    return max(flops / (hw.peak(dtype) * eff), bytes_moved / (hw.hbm_bw * hw.hbm_eff))


def cached_share(hw: Hardware, working_set: float | None, dtype: str = "fp32") -> float:
    """The share of a memory-bound pass's traffic served by a core's own cache: all of it while
    its tensors (`working_set` bytes) fit, cache_bytes / working_set beyond (a pass streams through
    tensors larger than the cache, which keeps about its size of them). 0 without a cache model,
    or without an in-cache rate for `dtype` (`Hardware.elementwise_effs`)."""
    if not (hw.cache_bytes and hw.elementwise_effs(dtype)[1] and working_set):
        return 0.0
    return min(1.0, hw.cache_bytes / working_set)


def block_working_set(tokens: float, hidden: int, ffn: int, dtype_bytes: int, tp: int = 1,
                      sp_div: int = 1) -> float:
    """The widest activation of a block's elementwise work (bytes per rank): what a core's cache
    must hold for that work to run in it."""
    return dtype_bytes * tokens * max(hidden / sp_div, ffn / tp)


def memory_time(hw: Hardware, nbytes: float, working_set: float | None = None,
                dtype: str = "fp32") -> float:
    """Memory-bound work on tensors of `dtype`: `nbytes` of traffic at the copy bandwidth times
    that dtype's elementwise efficiency, the share that a core's cache serves (`cached_share`) at
    its in-cache efficiency instead (`Hardware.elementwise_effs`: a CPU's bf16 kernels reach a
    smaller share of the bandwidth than fp32's; one efficiency for all dtypes on a GPU profile).
    Without `working_set`, tensors as large as a model's parameters or logits: out of any cache."""
    out_eff, in_eff = hw.elementwise_effs(dtype)
    c = cached_share(hw, working_set, dtype)
    return nbytes / hw.hbm_bw * ((c / in_eff if c else 0.0) + (1 - c) / out_eff)


def measured_piecewise(hw: Hardware) -> bool:
    """Whether the profile's constants were measured piece by piece (a CPU profile: `ultrascale
    calibrate`'s probes), so that work no probe covers is priced on its own: the step's small
    all-reduces, the casts of a low-precision run. The GPU profiles' constants were fitted on
    whole steps of runs that do the same work, so they hold it already."""
    return bool(hw.host_cores)


def cast_time(hw: Hardware, elements: float, dtype: str, ways: int = 2) -> float:
    """Casting `elements` between `dtype` and fp32, `ways` times (2: the loss's logits to fp32 and
    their gradient back; 1: the fp32 master weights into the module's copies): each way reads
    one width and writes the other, at `dtype`'s elementwise rate. 0 in fp32 and on profiles
    fitted on whole steps (`measured_piecewise`)."""
    narrow = DTYPE_BYTES[dtype]
    if narrow >= 4 or not measured_piecewise(hw):
        return 0.0
    return memory_time(hw, ways * (narrow + 4) * elements, dtype=dtype)


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
                    layer_overhead_by_dtype={k: v / min(1.0, share)
                                             for k, v in hw.layer_overhead_by_dtype.items()},
                    wakeup_s=hw.wakeup_s if crowded else 0.0)


def hidden_share(collective: tuple[float, float], gemm: float, hw: Hardware) -> float:
    """The share of a collective (wait, transfer) that hides under a GEMM of `gemm` seconds
    running beside it: all of it, or as much as the GEMM lasts, on a GPU (the collective's
    kernels run beside the GEMM's); none on a CPU profile (`Hardware.host_cores`), whose cores do
    both the GEMM and the transfer."""
    if hw.host_cores:
        return 0.0
    total = sum(collective)
    return min(1.0, gemm / total) if total > 0 else 1.0
