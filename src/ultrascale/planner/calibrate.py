"""`ultrascale calibrate`: measure this machine and write the hardware profile the cost model reads.

Starts `--ranks` processes, each with the threads the launcher would give a rank (cores // ranks,
at least one, set in OMP_NUM_THREADS as the launcher does), and measures as a training step runs:
every rank busy at once (probes sampled in rounds; compute keeps each probe's fastest round, the
collectives their median round; then the median over ranks).

- the matmul rate of a linear layer's forward and backward across sizes for each dtype, fitted to
  rate(F) = peak * F / (F + F_half), which gives the peak per dtype and the efficiency curve
  (`matmul_half_flops`);
- causal attention (scaled_dot_product_attention, forward and backward), as a fraction of the peak;
- copy bandwidth (a large copy); the fixed host cost of one transformer layer's forward and
  backward (a block run on a handful of tokens); the efficiency of a block's elementwise work
  (the block's own norms, rotary, SwiGLU and residual adds, forward and backward, against the bytes
  the cost model counts for them) at 256 and 2048 tokens, which with the core's L2 size gives its
  rate out of that cache (`hbm_eff`, the regime of the copy probe and of most training steps) and
  in it (`cached_eff`, small micro-batches: 0.69 against 0.43 on a Xeon core); the cost of the
  optimizer update per parameter (the runtime's gradient norm and per-tensor AdamW), as bytes at
  the out-of-cache rate;
- all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point between the processes on
  gloo (or NCCL on GPUs), at a small and a large size: the small one gives the latency, the
  difference the bus bandwidth. They go through `ultrascale.distributed.comm`, the project's one
  door for communication, so the figures are those the trainer's collectives see.

Compute figures are stored per core (`host_cores` records the machine's cores): a rank measured on
its share of the cores (4 ranks on 2 cores: half a core each) is scaled back to one core, and the
cost model gives each rank of a layout its share again. The cores that compute also run gloo's
transfers and reductions, so a CPU profile overlaps nothing (`dp_overlap` 0). Calibrate with the
rank count you will train with: collectives slow down as more ranks share the cores.

    ultrascale calibrate [--out PATH] [--ranks 2] [--quick]
    python -m ultrascale.planner.calibrate ...

torch and numpy are imported inside the functions that use them: the CLI imports this module to
register the subcommand, and `ultrascale memory` must not pay for torch.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

from ultrascale.planner.hardware import (
    COLLECTIVES, GPU_OUTSIDE_ALLOCATOR, LOCAL_PROFILE, Hardware, Link,
)

DTYPES = ("fp32", "bf16")
SMALL, LARGE = 4 * 2**10, 8 * 2**20  # collective sizes (bytes) for latency and bandwidth
# Each timed sample repeats the call for at least this long (a single call of a small kernel mostly
# measures the timer). A compute sample runs on every rank at once, the same number of calls, from
# one barrier to the next: the time it takes all of them (one rank may get ahead of its fair share
# of a core for a while, the slowest cannot). The probes are sampled in rounds, each round going
# once through all of them, and each compute probe keeps its fastest round: other jobs on a shared
# machine only ever slow a round down, and load that comes and goes then weighs on no probe in
# particular. Collectives keep their median round (their latency varies with scheduling even among
# our own ranks).
MIN_SAMPLE_S = 0.1
ROUNDS = 4
COLLECTIVE_ROUNDS = 9
MATMUL_SIZES = [64, 128, 192, 256, 384, 512, 768]
QUICK_SIZES = [64, 128, 256, 512]
BLOCK = dict(hidden=512, heads=8, kv_heads=4, ffn=1536, tokens=256)  # a small training block
# The same block's elementwise work at 2048 tokens: its widest activation (12 MiB) is several
# times a core's L2, as the copy probe's 64 MiB are, so it runs out of that cache where BLOCK may
# run in it.
BLOCK_OUT_OF_CACHE = dict(BLOCK, tokens=2048)
UPDATE_NUMEL = 2**22
# AdamW on fp32 reads the parameter, gradient and both moments and writes three back.
ADAMW_MIN_BYTES = 28.0
ATTENTION = dict(seq=256, heads=8, dim=64)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_cache_bytes() -> float | None:
    """A core's own cache, its L2 (bytes), as the C library or Linux's sysfs reports it; None where
    neither says."""
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
        if size > 0:
            return float(size)
    except (AttributeError, ValueError, OSError):
        pass
    path = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    try:
        text = path.read_text().strip().upper()
    except OSError:
        return None
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    digits = text.rstrip("KM")
    return float(digits) * scale if digits.isdigit() else None


def cache_efficiencies(eff_small: float, eff_large: float, cache_bytes: float | None,
                       small: dict = BLOCK, large: dict = BLOCK_OUT_OF_CACHE
                       ) -> tuple[float, float | None]:
    """(hbm_eff, cached_eff) from the elementwise probe's efficiency at two sizes. The small probe
    runs wholly in a core's L2, so its efficiency is the in-cache one; the large one runs the share
    `cost.cached_share` gives its working set at that rate and the rest out of the cache, which
    leaves one unknown. Without a cache size, or when the sizes do not tell the rates apart (the
    larger not slower: noise; or a cache that holds most of the large probe too), the large
    probe's figure alone: (eff_large, None). Also where the small probe does not fit in the cache
    (a 512 KiB L2 against its 1.5 MiB): solving two mostly out-of-cache probes for the in-cache
    rate turned their few percent of noise into the answer (no figure, 0.85 and 1.0 in three
    calibrations on a 2-core EPYC within five minutes)."""
    from ultrascale.planner.cost import block_working_set

    if not cache_bytes:
        return eff_large, None
    c_small, c_large = (
        min(1.0, cache_bytes / block_working_set(b["tokens"], b["hidden"], b["ffn"], 4))
        for b in (small, large))
    if c_small < 1.0 or c_large > 0.9 or eff_large >= eff_small:
        return eff_large, None
    # 1 / eff_large = c_large / eff_small + (1 - c_large) / hbm_eff
    hbm_eff = (1 - c_large) / (1 / eff_large - c_large / eff_small)
    return min(1.0, hbm_eff), min(1.0, eff_small)


def _inner(fn) -> int:
    """Calls per sample: enough for MIN_SAMPLE_S (after a warm-up call: allocations, kernels)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, min(1000, int(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))


def _sample(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def fit_efficiency_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit rate = peak * F / (F + half) to the measured points, in relative (log) error so that the
    small sizes weigh as much as the large ones. Returns (peak, half)."""
    import numpy as np
    from scipy.optimize import least_squares

    f = np.array([p[0] for p in points])
    r = np.array([p[1] for p in points])

    def resid(z):
        peak, half = np.exp(z)
        return np.log(peak * f / (f + half)) - np.log(r)

    best = float(r.max())
    z = least_squares(resid, np.log([best, float(np.median(f))])).x
    peak, half = (float(v) for v in np.exp(z))
    if peak > 4 * best:  # no saturation in the measured range: the curve is not identified
        return best, 0.0
    return peak, half


def attention_flops(seq: int, heads: int, dim: int) -> float:
    """Forward FLOPs of causal attention: QK^T and PV over half the score matrix."""
    return 2 * 2 * seq * seq * heads * dim * 0.5


def _block_config(hidden: int, heads: int, kv_heads: int, ffn: int):
    from ultrascale.config import ModelConfig

    return ModelConfig(preset=None, hidden_size=hidden, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=16)


def _block(hidden: int, heads: int, kv_heads: int, ffn: int):
    from ultrascale.models.llama import Block

    cfg = _block_config(hidden, heads, kv_heads, ffn)
    return cfg, Block(cfg)


def compute_probes(quick: bool = False) -> dict:
    """name -> one call of each compute probe (timed per call):

    - `matmul/<dtype>/<n>`: the three GEMMs of a square linear layer's forward and backward
      (y = x W^T, dx = dy W, dW = dy^T x), without autograd's host work (priced apart);
    - `attention`: causal scaled_dot_product_attention, forward and backward;
    - `copy`: a 64 MiB copy;
    - `overhead`: a transformer block's forward and backward on 4 tokens (its host work);
    - `elementwise`: the elementwise work of a block of training size (BLOCK), forward and
      backward, with the model's own pieces: two RMSNorms, rotary on q and k, silu(gate) * up,
      two residual adds; `elementwise_out_of_cache` the same at 2048 tokens;
    - `update`: the runtime's gradient norm (float64) and per-tensor AdamW over UPDATE_NUMEL
      parameters.
    """
    import torch

    from ultrascale.models import ops

    probes = {}
    for dtype in DTYPES:
        for n in (QUICK_SIZES if quick else MATMUL_SIZES):
            x, w, g = (torch.randn(n, n, dtype=_torch_dtype(dtype)) for _ in range(3))
            probes[f"matmul/{dtype}/{n}"] = (
                lambda x=x, w=w, g=g: (torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x)))
    a = ATTENTION
    q, k, v = (torch.randn(1, a["seq"], a["heads"], a["dim"], requires_grad=True)
               for _ in range(3))
    probes["attention"] = lambda: ops.attention(q, k, v, causal=True).sum().backward()
    src = torch.empty(16 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    probes["copy"] = lambda: dst.copy_(src)
    cfg, block = _block(16, 2, 2, 32)
    xb = torch.randn(1, 4, 16, requires_grad=True)
    probes["overhead"] = lambda: block(
        xb, ops.rotary_tables(torch.arange(4), cfg.head_dim, cfg.rope_theta)).sum().backward()
    probes["elementwise"] = _elementwise_probe(**BLOCK)
    probes["elementwise_out_of_cache"] = _elementwise_probe(**BLOCK_OUT_OF_CACHE)
    params = [torch.nn.Parameter(torch.randn(UPDATE_NUMEL // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False)

    def update():
        sum(p.grad.double().pow(2).sum() for p in params)
        opt.step()

    probes["update"] = update
    return probes


def steady_allocator() -> bool:
    """Keep freed memory in the process, as a running trainer's allocator does.

    A fresh process's glibc malloc serves each multi-megabyte temporary (a probe's output, the
    float64 copy of a gradient in the norm) with a new mmap and returns it on free, so every call
    pays page faults; a trainer that has run a step reuses its heap instead. On the 2-core dev
    box the update probe costs 14.4 ns per parameter on one core in a fresh process, 3.5 ns with
    the memory kept (`benchmarks/update_probe_cpu.py`). Returns whether it applied (False without
    glibc, where nothing changes)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # 32 MiB is glibc's largest mmap threshold: bigger blocks are mmapped whatever we ask.
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def measure_compute(quick: bool = False, barrier=lambda: None, agree=lambda n: n,
                    rounds: int = ROUNDS) -> dict:
    """Seconds per call of each compute probe on this process's threads, every rank computing at
    once: the fastest of the rounds. `barrier` lines the ranks up before and after each sample,
    `agree` gives every rank the same number of calls (the largest any rank asks for)."""
    probes = compute_probes(quick)
    inner = {name: agree(_inner(fn)) for name, fn in probes.items()}
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, fn in probes.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            barrier()  # until the slowest rank is done
            times[name].append((time.perf_counter() - t0) / inner[name])
    return {name: min(t) for name, t in times.items()}


def _elementwise_probe(hidden: int, heads: int, kv_heads: int, ffn: int, tokens: int):
    import torch

    from ultrascale.models import ops
    from ultrascale.models.llama import RMSNorm

    hd = hidden // heads
    norm1, norm2 = RMSNorm(hidden), RMSNorm(hidden)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    q = torch.randn(1, tokens, heads, hd, requires_grad=True)
    k = torch.randn(1, tokens, kv_heads, hd, requires_grad=True)
    gate, up = (torch.randn(1, tokens, ffn, requires_grad=True) for _ in range(2))
    positions = torch.arange(tokens)

    def step():
        rope = ops.rotary_tables(positions, hd, 10000.0)
        r = x + norm1(x)
        out = (norm2(r) + r).sum() + ops.rotary(q, rope).sum()
        out = out + ops.rotary(k, rope).sum() + ops.swiglu(gate, up).sum()
        out.backward()

    return step


def elementwise_efficiency(hw: Hardware, elementwise_s: float, hidden: int, heads: int,
                           kv_heads: int, ffn: int, tokens: int) -> float:
    """Fraction of the copy bandwidth that a block's elementwise work reaches (unfused kernels:
    several passes per byte the cost model counts): the bytes the model counts for one block,
    forward and backward, at the copy bandwidth, over the measured time of that work."""
    from ultrascale.layout import Layout
    from ultrascale.planner.cost import block_times

    cfg = _block_config(hidden, heads, kv_heads, ffn)
    lay = Layout(mbs=1, seq_len=tokens, dtype="fp32")
    # At the full copy bandwidth, whatever cache model the profile has.
    parts = block_times(cfg, lay, hw.with_(hbm_eff=1.0, cache_bytes=None, cached_eff=None))
    counted = parts["elementwise_f"] + parts["elementwise_b"]
    return min(1.0, max(0.01, counted / elementwise_s))


# ------------------------------------------------------------------------------------------------
# One process per rank: compute with every rank busy, then the collectives


def _worker(backend: str, quick: bool) -> dict:
    """One rank (started by `local_ranks.run_ranks`, which set its threads and its environment)."""
    import warnings

    import torch
    import torch.distributed as dist

    from ultrascale.distributed import comm

    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_tensor collectives
    from ultrascale.distributed.mesh import ParallelContext

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    comm.set_context(ParallelContext.without_mesh(device, rank, world))
    def agree(n: int) -> int:
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    steady_allocator()
    results = {"compute": measure_compute(quick, barrier=comm.barrier, agree=agree,
                                          rounds=2 if quick else ROUNDS)}
    ops = {}
    for nbytes in (SMALL, LARGE):
        full = torch.ones(nbytes // 4, device=device)
        part = torch.ones(nbytes // 4 // world, device=device)
        out = torch.empty_like(full)
        ops[("all_reduce", nbytes)] = lambda full=full: comm.all_reduce(full, "world")
        ops[("all_gather", nbytes)] = lambda full=full, part=part: comm.all_gather(full, part,
                                                                                    "world")
        ops[("reduce_scatter", nbytes)] = lambda full=full, part=part: comm.reduce_scatter(
            part, full, "world")
        ops[("all_to_all", nbytes)] = lambda full=full, out=out: comm.all_to_all(out, full,
                                                                                  "world")
        ops[("p2p", nbytes)] = lambda full=full: _ping(comm, full, rank)
    times: dict = {key: [] for key in ops}
    missing = set()
    for _ in range(COLLECTIVE_ROUNDS):
        for key, fn in ops.items():
            if key[0] in missing:
                continue
            try:
                comm.barrier()
                times[key].append(_sample(fn, 1))
            except (RuntimeError, NotImplementedError):
                missing.add(key[0])  # this backend lacks the collective
    results["collectives"] = {
        kind: None if kind in missing else tuple(statistics.median(times[(kind, b)][1:])
                                                 for b in (SMALL, LARGE))
        for kind in dict.fromkeys(k for k, _ in ops)}  # the first round warms up
    results["wakeup"] = measure_wakeup(comm, rank, world, device)
    if device.type == "cuda":  # what the driver has in use beyond PyTorch's allocator
        free, total = torch.cuda.mem_get_info(device)
        results["device_memory"] = (float(total),
                                    float(total - free - torch.cuda.memory_reserved(device)))
    return results


WAKEUP_PINGS = 12
WAKEUP_BYTES = 512 * 2**10  # a pipeline activation of a small model


def measure_wakeup(comm, rank: int, world: int, device) -> tuple[float, float] | None:
    """(idle, busy) one-way time of a WAKEUP_BYTES message between ranks 0 and 1 (median of a
    ping-pong), first with the other ranks idle, then as in training: the two ranks do the same
    work between their transfers (as tp ranks between collectives, pipeline stages between
    micro-batches) while the others compute. When the ranks time-share the cores, one of the two
    is often off its core when the other reaches the transfer, and the data waits for its next
    time slice; the difference is that wait. Rank 0's figures (None elsewhere)."""
    import torch

    msg = torch.ones(WAKEUP_BYTES // 4, device=device)
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            torch.mm(a, b)

    def work() -> None:  # the same work on both ranks (about 10 ms of a core)
        for _ in range(8):
            torch.mm(a, b)

    out = []
    for busy in (False, True):
        comm.barrier()
        if rank in (0, 1):
            times = []
            for _ in range(WAKEUP_PINGS):
                t0 = time.perf_counter()
                _ping(comm, msg, rank, src=0)
                _ping(comm, msg, rank, src=1)
                times.append((time.perf_counter() - t0) / 2)
                if busy:
                    work()
            out.append(statistics.median(times[1:]))
        elif busy:  # the other ranks compute for longer than the pings take
            compute(max(1.0, WAKEUP_PINGS * 0.1))
    comm.barrier()
    return tuple(out) if rank == 0 else None


def _ping(comm, tensor, rank: int, src: int = 0) -> None:
    """One transfer from rank `src` to the other of ranks 0 and 1 (the others idle)."""
    dst = 1 - src
    if rank == src:
        for w in comm.batch_p2p([("send", tensor, dst)], dim="world"):
            w.wait()
    elif rank == dst:
        for w in comm.batch_p2p([("recv", tensor, src)], dim="world"):
            w.wait()


def measure_ranks(world: int, backend: str, threads: int, quick: bool = False) -> list[dict]:
    """Each rank's figures: seconds per call of each compute probe, and the (small, large) times
    of each collective. Each rank computes on `threads` threads, as the launcher would give it
    (OMP_NUM_THREADS in its environment before torch starts: `local_ranks`)."""
    from ultrascale.distributed.local_ranks import run_ranks

    return run_ranks(world, _worker, backend, quick, threads=threads, timeout=3600.0)


def collective_figures(times: dict, world: int) -> dict[str, tuple[float, float] | None]:
    """(bus bandwidth bytes/s, latency s) per kind from the (small, large) times; None where the
    backend lacks the collective."""
    out = {}
    for kind, pair in times.items():
        if pair is None:
            out[kind] = None
            continue
        t_small, t_large = pair
        factor = {"all_reduce": 2.0 * (world - 1) / world, "p2p": 1.0}.get(kind, (world - 1) / world)
        slope = max(t_large - t_small, 1e-9) / (LARGE - SMALL)
        out[kind] = (factor / slope, max(0.0, t_small - factor * SMALL / (factor / slope)))
    return out


def median_over_ranks(ranks: list[dict]) -> dict:
    """The median over ranks of each compute time and of each collective time."""
    comp = {name: statistics.median(r["compute"][name] for r in ranks)
            for name in ranks[0]["compute"]}
    coll = {}
    for kind in ranks[0]["collectives"]:
        pairs = [r["collectives"][kind] for r in ranks]
        coll[kind] = None if any(p is None for p in pairs) else tuple(
            statistics.median(p[i] for p in pairs) for i in range(2))
    return {"compute": comp, "collectives": coll, "wakeup": ranks[0].get("wakeup")}


def device_memory(ranks: list[dict], host_bytes: float) -> tuple[float, float, str]:
    """(memory per device, bytes outside the allocator, a line saying so). On GPUs: the smallest
    capacity the ranks' drivers report, and what they had in use beyond PyTorch's allocator after
    the collectives (the CUDA context, NCCL's buffers), at least the GPU profiles' figure: the
    calibration opens one communicator, a training job one per process group. On CPUs: the
    host's memory shared by the ranks, nothing kept."""
    figs = [r.get("device_memory") for r in ranks]
    if not figs or any(f is None for f in figs):
        return host_bytes / max(1, len(ranks)), 0.0, ""
    total = min(f[0] for f in figs)
    measured = max(f[1] for f in figs)
    outside = max(measured, GPU_OUTSIDE_ALLOCATOR)
    note = (f"device memory {total / 2**30:.1f} GiB; {measured / 2**30:.2f} GiB in use outside "
            f"PyTorch's allocator with one communicator open; the profile keeps "
            f"{outside / 2**30:.1f} GiB free for the CUDA context and NCCL")
    return total, outside, note


def profile_from_figures(fig: dict, ranks: int, cores: int, backend: str, memory_bytes: float,
                         log=print, cache_bytes: float | None = None) -> Hardware:
    """The profile from the ranks' figures: compute normalised to one core (a rank measured on its
    share of the cores: cores // ranks threads, or cores / ranks of a core when they time-share),
    the links as measured. `cache_bytes`: a core's L2, for the in-cache elementwise rate."""
    from ultrascale.planner.cost import rank_share

    comp = fig["compute"]
    link0 = Link({"all_reduce": 1.0}, 0.0)
    probe = Hardware(name="probe", peak_flops={}, memory_bytes=0.0, hbm_bw=0.0,
                     devices_per_node=ranks, intra=link0, inter=link0, host_cores=cores)
    share, _ = rank_share(probe, ranks)
    core = {name: t * share for name, t in comp.items()}  # seconds per call on one core
    peaks, halves = {}, {}
    for dtype in DTYPES:
        pts = sorted((int(name.split("/")[2]), t) for name, t in core.items()
                     if name.startswith(f"matmul/{dtype}/"))
        per_core = [(2.0 * n**3, 3 * 2.0 * n**3 / t) for n, t in pts]
        peaks[dtype], halves[dtype] = fit_efficiency_curve(per_core)
        log(f"matmul {dtype} (linear forward+backward GEMMs), per core: peak "
            f"{peaks[dtype] / 1e9:.1f} GFLOP/s, half-rate size {halves[dtype] / 1e6:.2f} MFLOP "
            f"({', '.join(f'{r / 1e9:.1f}' for _, r in per_core)} GFLOP/s by size)")
    a = ATTENTION
    attention = min(1.0, 3.5 * attention_flops(a["seq"], a["heads"], a["dim"])
                    / core["attention"] / peaks["fp32"])
    hbm = 2 * 16 * 2**20 * 4 / core["copy"]  # read + write
    overhead = comp["overhead"] * min(1.0, share)  # one Python thread: only time-sharing slows it
    hw = Hardware(name="local", peak_flops=peaks, memory_bytes=memory_bytes, hbm_bw=hbm,
                  devices_per_node=max(ranks, cores), intra=link0, inter=link0,
                  matmul_eff_max=1.0, matmul_half_flops=halves["fp32"], attention_eff=attention,
                  hbm_eff=1.0, dp_overlap=0.0, layer_overhead_s=overhead, host_cores=cores)
    hbm_eff, cached_eff = cache_efficiencies(
        elementwise_efficiency(hw, core["elementwise"], **BLOCK),
        elementwise_efficiency(hw, core["elementwise_out_of_cache"], **BLOCK_OUT_OF_CACHE),
        cache_bytes)
    # Bytes per parameter the update moves at the elementwise bandwidth. AdamW on fp32 reads the
    # parameter, gradient and both moments and writes three of them back: 28 bytes is the floor.
    # A lower figure means load from other jobs slowed the bandwidth probe more than the update.
    optimizer = max(ADAMW_MIN_BYTES, core["update"] / UPDATE_NUMEL * hbm * hbm_eff)
    log(f"per core: attention forward+backward {attention:.0%} of the fp32 peak; copy bandwidth "
        f"{hbm / 1e9:.1f} GB/s; fixed cost per layer forward+backward {overhead * 1e3:.2f} ms; "
        f"elementwise work of a block at {hbm_eff:.0%} of the copy bandwidth"
        + (f" ({cached_eff:.0%} while it fits in a core's {cache_bytes / 2**20:.1f} MiB L2)"
           if cached_eff else "") + "; optimizer update "
        f"(gradient norm + AdamW) {core['update'] / UPDATE_NUMEL * 1e9:.1f} ns per parameter, "
        f"i.e. {optimizer:.0f} bytes at that rate")
    busbw, lats = {}, []
    for kind, value in collective_figures(fig["collectives"], ranks).items():
        if value is None:
            log(f"{kind}: not supported by {backend}; the profile uses the all-gather figure")
            continue
        busbw[kind], lat = value
        lats.append(lat)
        log(f"{kind}: bus bandwidth {busbw[kind] / 1e9:.2f} GB/s, latency {lat * 1e6:.0f} us")
    for kind in COLLECTIVES:
        busbw.setdefault(kind, busbw.get("all_gather") or busbw["all_reduce"])
    steps = max(1.0, math.log2(ranks))
    link = Link(busbw=busbw, latency_s=float(statistics.median(lats)) / steps)
    wakeup = 0.0
    if fig.get("wakeup"):
        idle, busy = fig["wakeup"]
        wakeup = max(0.0, busy - idle)
        log(f"a {WAKEUP_BYTES // 2**10} KiB transfer: {idle * 1e3:.2f} ms with the other ranks idle,"
            f" {busy * 1e3:.2f} ms between ranks computing: {wakeup * 1e3:.2f} ms of waiting for a"
            " time slice")
    return hw.with_(intra=link, inter=link, hbm_eff=hbm_eff, optimizer_bytes_per_param=optimizer,
                    wakeup_s=wakeup, cache_bytes=cache_bytes if cached_eff else None,
                    cached_eff=cached_eff,
                    source=f"ultrascale calibrate ({backend}, {ranks} ranks on {cores} cores, "
                           f"{time.strftime('%Y-%m-%d %H:%M')}; compute per core, measured with "
                           "every rank busy; one node: inter-node figures copy the intra-node "
                           "ones)")


def calibrate(ranks: int = 2, quick: bool = False, backend: str | None = None,
              log=print) -> Hardware:
    import torch

    t0 = time.time()
    cores = _cores()
    backend = backend or ("nccl" if torch.cuda.is_available() and
                          torch.cuda.device_count() >= ranks else "gloo")
    threads = max(1, cores // ranks)  # what the launcher gives each rank (OMP_NUM_THREADS)
    log(f"{ranks} ranks on {cores} cores, {threads} thread(s) each, {backend}")
    per_rank = measure_ranks(ranks, backend, threads, quick)
    figures = median_over_ranks(per_rank)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    memory, outside, note = device_memory(per_rank, float(host))
    hw = profile_from_figures(figures, ranks, cores, backend, memory, log,
                              cache_bytes=None if backend == "nccl" else core_cache_bytes())
    if note:
        log(note)
        hw = hw.with_(outside_allocator_bytes=outside)
    log(f"calibrated in {time.time() - t0:.1f}s")
    return hw


# What `ultrascale calibrate --help` tells its user (the module docstring is for the code's readers).
USAGE = """Measure this machine and write the hardware profile that `ultrascale plan --gpu local`
(and a sweep's `predict: local`) reads: the matmul and attention rates, memory bandwidth, and each
collective's latency and bandwidth between --ranks processes, measured while all of them work.

Calibrate with the rank count you will train with: collectives slow down as more ranks share the
cores. It takes under a minute on a 2-core machine.

    ultrascale calibrate [--out PATH] [--ranks 2] [--quick]
    ultrascale plan --preset tiny --gpus 2 --gpu local --global-batch-tokens 8K --seq-len 256
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine, write a hardware profile",
                              description=USAGE, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=LOCAL_PROFILE,
                   help=f"profile YAML to write (default {LOCAL_PROFILE}, read by --gpu local)")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes for the collectives (2); use the rank count you will train "
                        "with: collectives slow down as more ranks share the cores")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on GPUs, else gloo")
    p.add_argument("--quick", action="store_true", help="fewer matmul sizes")


def run(args) -> int:
    if args.ranks < 2:
        print("ultrascale calibrate: --ranks must be at least 2 (collectives need two processes).",
              file=sys.stderr)
        return 2
    hw = calibrate(ranks=args.ranks, quick=args.quick, backend=args.backend)
    path = hw.save(args.out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ultrascale calibrate", description=USAGE,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
