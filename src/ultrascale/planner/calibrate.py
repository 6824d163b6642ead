"""`ultrascale calibrate`: measure this machine and write the hardware profile the cost model reads.

Measures, in well under a minute on a small CPU box:

- matmul rate across sizes for each dtype, fitted to rate(F) = peak * F / (F + F_half), which gives
  the profile's peak per dtype and its efficiency curve (`matmul_half_flops`);
- causal attention (scaled_dot_product_attention) rate, as a fraction of the matmul peak;
- memory bandwidth (a large copy);
- all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point between processes on gloo
  (or NCCL on GPUs), at a small and a large size: the small one gives the latency, the difference the
  bus bandwidth. They go through `ultrascale.distributed.comm`, the project's one door for
  communication, so the figures are those the trainer's collectives see.

    ultrascale calibrate [--out PATH] [--ranks 2] [--quick]
    python -m ultrascale.planner.calibrate ...
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ultrascale.planner.hardware import COLLECTIVES, LOCAL_PROFILE, Hardware, Link

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMALL, LARGE = 4 * 2**10, 2 * 2**20  # collective sizes (bytes) for latency and bandwidth


def _timed(fn, repeats: int) -> float:
    """Best-of-`repeats` wall time of fn(): the least disturbed run on a shared machine."""
    fn()  # warm-up (allocations, kernel selection)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul(sizes: list[int], dtype: str, repeats: int = 3) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of square GEMMs of each size."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, dtype=DTYPES[dtype])
        b = torch.randn(n, n, dtype=DTYPES[dtype])
        t = _timed(lambda: torch.mm(a, b), repeats)
        out.append((2.0 * n**3, 2.0 * n**3 / t))
    return out


def fit_efficiency_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit rate = peak * F / (F + half) to the measured points, in relative (log) error so that the
    small sizes weigh as much as the large ones. Returns (peak, half)."""
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


def measure_attention(peak: float, seq: int = 512, heads: int = 4, dim: int = 64) -> float:
    q = torch.randn(1, heads, seq, dim)
    t = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
               3)
    flops = 2 * 2 * seq * seq * heads * dim * 0.5  # QK^T and PV over the causal half
    return min(1.0, flops / t / peak)


def measure_memory_bandwidth(nbytes: int = 64 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), 5)
    return 2 * nbytes / t  # read + write


# ------------------------------------------------------------------------------------------------
# Collectives, one process per rank


def _collective_worker(rank: int, world: int, init_file: str, backend: str, out_dir: str) -> None:
    import warnings

    import torch.distributed as dist

    from ultrascale.distributed import comm

    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_tensor collectives
    from ultrascale.distributed.mesh import ParallelContext

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    comm.set_context(ParallelContext(mesh=None, device=device, rank=rank, world_size=world,
                                     sizes={}))
    results = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        times = []
        for nbytes in (SMALL, LARGE):
            n = nbytes // 4
            full = torch.ones(n, device=device)
            part = torch.ones(n // world, device=device)
            ops = {
                "all_reduce": lambda: comm.all_reduce(full, "world"),
                "all_gather": lambda: comm.all_gather(full, part, "world"),
                "reduce_scatter": lambda: comm.reduce_scatter(part, full, "world"),
                "all_to_all": lambda: comm.all_to_all(torch.empty_like(full), full, "world"),
                "p2p": lambda: _ping(comm, full, rank),
            }
            try:
                comm.barrier()
                times.append(_timed(ops[kind], 3))
            except (RuntimeError, NotImplementedError):
                times = None  # this backend lacks the collective (gloo: reduce-scatter)
                break
        results[kind] = times
    if rank == 0:
        np.save(os.path.join(out_dir, "collectives.npy"), results, allow_pickle=True)
    dist.destroy_process_group()


def _ping(comm, tensor, rank: int) -> None:
    """One transfer from rank 0 to rank 1 (the others idle)."""
    if rank == 0:
        for w in comm.batch_p2p([("send", tensor, 1)], dim="world"):
            w.wait()
    elif rank == 1:
        for w in comm.batch_p2p([("recv", tensor, 0)], dim="world"):
            w.wait()


def measure_collectives(world: int, backend: str) -> dict[str, tuple[float, float] | None]:
    """(bus bandwidth bytes/s, latency s per collective) per kind; None where unsupported."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_collective_worker, args=(world, init, backend, tmp), nprocs=world, join=True)
        raw = np.load(os.path.join(tmp, "collectives.npy"), allow_pickle=True).item()
    out = {}
    for kind, times in raw.items():
        if times is None:
            out[kind] = None
            continue
        t_small, t_large = times
        factor = {"all_reduce": 2.0 * (world - 1) / world, "p2p": 1.0}.get(kind, (world - 1) / world)
        slope = max(t_large - t_small, 1e-9) / (LARGE - SMALL)
        out[kind] = (factor / slope, max(0.0, t_small - factor * SMALL / (factor / slope)))
    return out


def calibrate(ranks: int = 2, quick: bool = False, backend: str | None = None,
              log=print) -> Hardware:
    t0 = time.time()
    sizes = [64, 128, 256, 512] if quick else [64, 128, 256, 512, 768]
    peaks, halves = {}, {}
    for dtype in DTYPES:
        pts = measure_matmul(sizes, dtype)
        peaks[dtype], halves[dtype] = fit_efficiency_curve(pts)
        log(f"matmul {dtype}: peak {peaks[dtype] / 1e9:.1f} GFLOP/s, half-rate size "
            f"{halves[dtype] / 1e6:.2f} MFLOP ({', '.join(f'{r / 1e9:.1f}' for _, r in pts)} "
            "GFLOP/s by size)")
    attention = measure_attention(peaks["fp32"])
    hbm = measure_memory_bandwidth()
    log(f"attention: {attention:.0%} of the fp32 peak; memory bandwidth {hbm / 1e9:.1f} GB/s")
    backend = backend or ("nccl" if torch.cuda.is_available() and
                          torch.cuda.device_count() >= ranks else "gloo")
    coll = measure_collectives(ranks, backend)
    busbw, lats = {}, []
    for kind, value in coll.items():
        if value is None:
            log(f"{kind}: not supported by {backend}; the profile uses the all-gather figure")
            continue
        busbw[kind], lat = value
        lats.append(lat)
        log(f"{kind}: bus bandwidth {busbw[kind] / 1e9:.2f} GB/s, latency {lat * 1e6:.0f} us")
    for kind in COLLECTIVES:
        busbw.setdefault(kind, busbw.get("all_gather") or busbw["all_reduce"])
    steps = max(1.0, math.log2(ranks))
    link = Link(busbw=busbw, latency_s=float(np.median(lats)) / steps)
    dtype_main = "fp32"
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    hw = Hardware(
        name="local", peak_flops=dict(peaks), memory_bytes=float(mem) / max(1, ranks),
        hbm_bw=hbm, devices_per_node=max(ranks, cores), intra=link, inter=link,
        matmul_eff_max=1.0, matmul_half_flops=halves[dtype_main], attention_eff=attention,
        hbm_eff=1.0, dp_overlap=1.0, microbatch_overhead_s=0.0,
        source=f"ultrascale calibrate ({backend}, {ranks} ranks, {time.strftime('%Y-%m-%d %H:%M')};"
               " one node: inter-node figures copy the intra-node ones)")
    log(f"calibrated in {time.time() - t0:.1f}s")
    return hw


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine, write a hardware profile",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=LOCAL_PROFILE,
                   help=f"profile YAML to write (default {LOCAL_PROFILE}, read by --gpu local)")
    p.add_argument("--ranks", type=int, default=2, help="processes for the collectives (2)")
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
    parser = argparse.ArgumentParser(prog="ultrascale calibrate", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
