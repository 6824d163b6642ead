"""`ultrascale calibrate`: measure this machine and write the hardware profile the cost model reads.

Starts `--ranks` processes, each with the threads the launcher would give a rank (cores // ranks,
at least one, set in OMP_NUM_THREADS as the launcher does), and measures as a training step runs:
every rank busy at once (probes sampled in rounds; compute keeps each probe's fastest round, the
collectives their median round; then the median over ranks).

- the matmul rate of a linear layer's forward and backward across square sizes and narrow
  shapes (a small model's linears) for each dtype, fitted to rate = peak * F / (F + F_half) *
  d / (d + d_half), d the GEMM's smallest dimension: the peak, `matmul_half_flops_by_dtype` and
  `matmul_half_dim_by_dtype`;
- causal attention (scaled_dot_product_attention with grouped kv heads, forward and backward) at
  head dims 32, 64 and 128, as a fraction of each dtype's peak (`attention_eff_by_head_dim`);
- copy bandwidth (a large copy); the fixed host cost of one transformer layer's forward and
  backward (a block run on a handful of tokens) in fp32 and bf16 (`layer_overhead_by_dtype`);
  the efficiency of a block's elementwise work
  (the block's own norms, rotary, SwiGLU and residual adds, forward and backward, against the bytes
  the cost model counts for them) at 256 and 2048 tokens, which with the core's L2 size gives its
  rate out of that cache (`hbm_eff`, the regime of the copy probe and of most training steps) and
  in it (`cached_eff`, small micro-batches: 0.69 against 0.43 on a Xeon core), in fp32 and in bf16
  (`hbm_eff_by_dtype`, `cached_eff_by_dtype`: a CPU's bf16 kernels take about fp32's time per
  element, so per byte they reach less of the bandwidth); the cost of the optimizer update per
  parameter (the runtime's gradient norm and per-tensor AdamW), as bytes at the out-of-cache rate;
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

from ultrascale.devices import local_cores
from ultrascale.layout import DTYPE_BYTES
from ultrascale.planner.hardware import (
    COLLECTIVES, GPU_OUTSIDE_ALLOCATOR, LOCAL_PROFILE, Hardware, Link,
)
from ultrascale.planner.probes import (
    ADAMW_MIN_BYTES, ATTENTION, ATTENTION_HEAD_DIMS, ATTENTION_REFERENCE_DIM, BLOCK,
    BLOCK_OUT_OF_CACHE, DTYPES, ROUNDS, UPDATE_NUMEL, attention_flops, attention_probe,
    cache_efficiencies, core_cache_bytes, elementwise_efficiency, elementwise_probe_name,
    fit_efficiency_curve, matmul_dims, measure_compute, overhead_probe, sample, steady_allocator,
)

SMALL, LARGE = 4 * 2**10, 8 * 2**20  # collective sizes (bytes) for latency and bandwidth
# The collectives are sampled in rounds like the compute probes (probes.py), and keep their median
# round (their latency varies with scheduling even among our own ranks).
COLLECTIVE_ROUNDS = 9


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
                times[key].append(sample(fn, 1))
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
    from ultrascale.theory.rates import rank_share

    comp = fig["compute"]
    link0 = Link({"all_reduce": 1.0}, 0.0)
    probe = Hardware(name="probe", peak_flops={}, memory_bytes=0.0, hbm_bw=0.0,
                     devices_per_node=ranks, intra=link0, inter=link0, host_cores=cores)
    share, _ = rank_share(probe, ranks)
    core = {name: t * share for name, t in comp.items()}  # seconds per call on one core
    peaks, halves, half_dims = matmul_rates(core, log)
    by_dim = attention_effs(core, peaks)
    by_dtype = {dtype: effs[ATTENTION_REFERENCE_DIM] for dtype, effs in by_dim.items()}
    attention = by_dtype["fp32"]
    hbm = 2 * 16 * 2**20 * 4 / core["copy"]  # read + write
    # One Python thread: only time-sharing slows it.
    overheads = {dtype: comp[overhead_probe(dtype)] * min(1.0, share) for dtype in DTYPES
                 if overhead_probe(dtype) in comp}
    overhead = overheads["fp32"]
    hw = Hardware(name="local", peak_flops=peaks, memory_bytes=memory_bytes, hbm_bw=hbm,
                  devices_per_node=max(ranks, cores), intra=link0, inter=link0,
                  matmul_eff_max=1.0, matmul_half_flops=halves["fp32"],
                  matmul_half_flops_by_dtype=halves, matmul_half_dim_by_dtype=half_dims,
                  attention_eff=attention, attention_eff_by_dtype=by_dtype,
                  attention_eff_by_head_dim=by_dim, hbm_eff=1.0, dp_overlap=0.0,
                  layer_overhead_s=overhead, layer_overhead_by_dtype=overheads, host_cores=cores)
    effs = elementwise_efficiencies(hw, core, cache_bytes)
    hbm_eff, cached_eff = effs["fp32"]
    # Bytes per parameter the update moves at the elementwise bandwidth. AdamW on fp32 reads the
    # parameter, gradient and both moments and writes three of them back: 28 bytes is the floor.
    # A lower figure means load from other jobs slowed the bandwidth probe more than the update.
    optimizer = max(ADAMW_MIN_BYTES, core["update"] / UPDATE_NUMEL * hbm * hbm_eff)
    log("per core: attention forward+backward (head dims "
        + "/".join(str(d) for d in ATTENTION_HEAD_DIMS) + ") " + ", ".join(
            "/".join(f"{e:.0%}" for e in effs.values()) + f" of the {d} peak"
            for d, effs in by_dim.items()) + f"; copy bandwidth {hbm / 1e9:.1f} GB/s; fixed "
        "cost per layer forward+backward " + ", ".join(
            f"{t * 1e3:.2f} ms in {d}" for d, t in overheads.items()) + "; "
        "elementwise work of a block at " + ", ".join(
            f"{out:.0%} of the copy bandwidth in {d}"
            + (f" ({cached:.0%} while it fits in a core's {cache_bytes / 2**20:.1f} MiB L2)"
               if cached else "") for d, (out, cached) in effs.items()) + "; optimizer update "
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
                    cached_eff=cached_eff, hbm_eff_by_dtype={d: e[0] for d, e in effs.items()},
                    cached_eff_by_dtype={d: e[1] for d, e in effs.items() if e[1]},
                    source=f"ultrascale calibrate ({backend}, {ranks} ranks on {cores} cores, "
                           f"{time.strftime('%Y-%m-%d %H:%M')}; compute per core, measured with "
                           "every rank busy; one node: inter-node figures copy the intra-node "
                           "ones)")


def matmul_rates(core: dict, log=print) -> tuple[dict, dict, dict]:
    """dtype -> peak FLOP/s, half-rate FLOPs and half-rate smallest dimension of a linear layer's
    GEMMs, fitted (`curves.efficiency_surface`) to the matmul probes' seconds per call on one core
    (`core`): the square sizes and the narrow layers. Without narrow probes (an older set), the
    square sizes alone fit rate(F) with no dimension factor."""
    from ultrascale.planner.curves import efficiency_surface

    peaks, halves, half_dims = {}, {}, {}
    for dtype in DTYPES:
        pts = []
        for name, t in core.items():
            if name.startswith(f"matmul/{dtype}/"):
                tokens, d_in, d_out = matmul_dims(name)
                flops = 2.0 * tokens * d_in * d_out  # each of the three GEMMs
                pts.append((flops, min(tokens, d_in, d_out), 3 * flops / t))
        pts.sort()
        if len({d for _, d, _ in pts}) == len(pts):  # squares only: no second factor to fit
            peaks[dtype], halves[dtype] = fit_efficiency_curve([(f, r) for f, _, r in pts])
            half_dims[dtype] = 0.0
        else:
            peaks[dtype], halves[dtype], half_dims[dtype] = efficiency_surface(pts)
        log(f"matmul {dtype} (linear forward+backward GEMMs), per core: peak "
            f"{peaks[dtype] / 1e9:.1f} GFLOP/s, half-rate size {halves[dtype] / 1e6:.2f} MFLOP, "
            f"half-rate smallest dimension {half_dims[dtype]:.0f} ("
            + ", ".join(f"{r / 1e9:.1f}" for _, _, r in pts) + " GFLOP/s by size)")
    return peaks, halves, half_dims


def attention_effs(core: dict, peaks: dict) -> dict[str, dict[int, float]]:
    """dtype -> {head_dim: fraction of that dtype's peak} of causal attention, forward and
    backward (3.5 times the forward's FLOPs: the backward's five products against the forward's
    two), from the attention probes' seconds per call on one core."""
    a = ATTENTION
    return {dtype: {d: min(1.0, 3.5 * attention_flops(a["seq"], a["heads"], d, a["batch"])
                           / core[attention_probe(dtype, d)] / peaks[dtype])
                    for d in ATTENTION_HEAD_DIMS}
            for dtype in DTYPES if attention_probe(dtype, ATTENTION_HEAD_DIMS[0]) in core}


def elementwise_efficiencies(hw: Hardware, core: dict, cache_bytes: float | None
                             ) -> dict[str, tuple[float, float | None]]:
    """dtype -> (out of a core's cache, in it or None) efficiency of a block's elementwise work,
    from the elementwise probes' seconds per call on one core (`core`), for each dtype measured.
    fp32's decides whether the profile has a cache model at all (its in-cache rate measured, then
    `cache_bytes` kept); without one, every dtype takes its out-of-cache probe's figure alone."""
    out = {}
    for dtype in DTYPES:
        small, large = (elementwise_probe_name(dtype, big) for big in (False, True))
        if small not in core or large not in core:
            continue
        cache = cache_bytes if dtype == "fp32" or out["fp32"][1] else None
        out[dtype] = cache_efficiencies(
            elementwise_efficiency(hw, core[small], **BLOCK, dtype=dtype),
            elementwise_efficiency(hw, core[large], **BLOCK_OUT_OF_CACHE, dtype=dtype),
            cache, dtype_bytes=DTYPE_BYTES[dtype])
    return out


def calibrate(ranks: int = 2, quick: bool = False, backend: str | None = None,
              log=print) -> Hardware:
    import torch

    t0 = time.time()
    cores = local_cores()
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
