"""`ultrascale calibrate`: measure this machine and write the hardware profile the cost model reads.

Measures, in well under a minute on a small CPU box:

- matmul rate across sizes for each dtype on one core (one thread, as each rank of a multi-rank run
  on a small CPU computes), fitted to rate(F) = peak * F / (F + F_half), which gives the profile's
  per-core peak per dtype and its efficiency curve (`matmul_half_flops`);
- causal attention (scaled_dot_product_attention, forward and backward) rate, as a fraction of
  the matmul peak;
- memory bandwidth of one core (a large copy); the fixed host cost of one transformer layer's
  forward and backward (a block run on a handful of tokens); the efficiency of the elementwise work
  of a block (norms, rotary, SwiGLU, residuals: a block of training size, timed, less its GEMMs
  and attention, against the bytes the cost model counts); the memory traffic per parameter of
  the optimizer update (the trainer's AdamW plus the gradient norm);
- all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point between processes on gloo
  (or NCCL on GPUs), at a small and a large size: the small one gives the latency, the difference the
  bus bandwidth. They go through `ultrascale.distributed.comm`, the project's one door for
  communication, so the figures are those the trainer's collectives see; each process uses the
  threads the launcher would give a rank, and the median of several runs is kept (a step sees the
  typical collective, not the luckiest).

The profile records the machine's cores (`host_cores`): the cost model gives each rank its share of
them, so that 4 ranks on 2 cores each compute at half a core's rate. The cores that compute also
run gloo's transfers and reductions, so a CPU profile overlaps nothing (`dp_overlap` 0).

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
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ultrascale.planner.hardware import COLLECTIVES, LOCAL_PROFILE, Hardware, Link

DTYPES = ("fp32", "bf16")
SMALL, LARGE = 4 * 2**10, 8 * 2**20  # collective sizes (bytes) for latency and bandwidth
MIN_SAMPLE_S = 0.01  # each timed sample repeats the call for at least this long


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _timed(fn, repeats: int, stat: str = "best") -> float:
    """Time of one fn() call: each sample repeats it for at least MIN_SAMPLE_S (a single call of a
    small kernel mostly measures the timer and the thread wake-up); the best sample (the least
    disturbed on a shared machine: a device's rate) or the median (what a training step sees of a
    collective)."""
    fn()  # warm-up (allocations, kernel selection)
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(1000, int(MIN_SAMPLE_S / once)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return min(samples) if stat == "best" else statistics.median(samples)


def measure_matmul(sizes: list[int], dtype: str, repeats: int = 3) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of square GEMMs of each size, on the calling thread count."""
    import torch

    out = []
    for n in sizes:
        a = torch.randn(n, n, dtype=_torch_dtype(dtype))
        b = torch.randn(n, n, dtype=_torch_dtype(dtype))
        t = _timed(lambda: torch.mm(a, b), repeats)
        out.append((2.0 * n**3, 2.0 * n**3 / t))
    return out


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


def measure_attention(peak: float, seq: int = 256, heads: int = 8, dim: int = 64) -> float:
    """Causal SDPA forward + backward, as a fraction of `peak`. The cost model charges the backward
    2.5 forwards (five products, scores recomputed), so the pair counts 3.5 forwards of FLOPs."""
    import torch

    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    t = _timed(step, 3)
    return min(1.0, 3.5 * attention_flops(seq, heads, dim) / t / peak)


def measure_memory_bandwidth(nbytes: int = 64 * 2**20) -> float:
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), 5)
    return 2 * nbytes / t  # read + write


def _block(hidden: int, heads: int, kv_heads: int, ffn: int):
    from ultrascale.config import ModelConfig
    from ultrascale.models.llama import Block

    cfg = ModelConfig(preset=None, hidden_size=hidden, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=16)
    return cfg, Block(cfg)


def _block_time(block, tokens: int, hidden: int, repeats: int) -> float:
    import torch

    x = torch.randn(1, tokens, hidden, requires_grad=True)
    positions = torch.arange(tokens)
    return _timed(lambda: block(x, positions).sum().backward(), repeats)


def measure_layer_overhead() -> float:
    """Host time of one transformer block's forward and backward on a token-sized input: the fixed
    cost (Python, dispatch, kernel launches) every layer pays per micro-batch, whatever its size."""
    _, block = _block(16, 2, 2, 32)
    return _block_time(block, 4, 16, 5)


def measure_elementwise_efficiency(hw: Hardware, hidden: int = 512, heads: int = 8,
                                   kv_heads: int = 4, ffn: int = 1536, tokens: int = 256) -> float:
    """Fraction of the copy bandwidth that a block's elementwise work reaches (unfused norms,
    rotary, SwiGLU, residuals; on a CPU several passes per counted byte): a block of training size
    is timed forward and backward, its GEMMs, attention and fixed host cost (as the cost model
    prices them on `hw`) are taken off, and the rest is set against the bytes the model counts."""
    from ultrascale.layout import Layout
    from ultrascale.planner.cost import _layer_times, _Shape

    cfg, block = _block(hidden, heads, kv_heads, ffn)
    t = _block_time(block, tokens, hidden, 3)
    lay = Layout(mbs=1, seq_len=tokens, dtype="fp32")
    sh = _Shape(tokens=tokens, h=hidden, kv=kv_heads * cfg.head_dim, f=ffn, v=16, tp=1,
                dtype="fp32", sp_div=1)
    parts = _layer_times(cfg, lay, hw.with_(hbm_eff=1.0), sh)
    priced = (parts["matmul_f"] + parts["matmul_b"] + parts["attention_f"]
              + parts["attention_b"] + hw.layer_overhead_s)
    counted = parts["elementwise_f"] + parts["elementwise_b"]  # at the full copy bandwidth
    rest = t - priced
    if rest <= counted:  # nothing left to explain: elementwise runs at the copy bandwidth
        return 1.0
    return max(0.05, counted / rest)


def measure_optimizer_bytes(hbm_bw: float, numel: int = 2**22) -> float:
    """Memory traffic per parameter of the trainer's update (bytes at `hbm_bw`): the gradient norm
    as the runtime computes it, then torch's AdamW (per tensor, as the runtime builds it)."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False)

    def update():
        sum(p.grad.double().pow(2).sum() for p in params)
        opt.step()

    return _timed(update, 3) * hbm_bw / numel


# ------------------------------------------------------------------------------------------------
# Collectives, one process per rank


def _collective_worker(rank: int, world: int, init_file: str, backend: str, out_dir: str,
                       threads: int) -> None:
    import pickle
    import warnings

    import torch
    import torch.distributed as dist

    from ultrascale.distributed import comm

    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_tensor collectives
    from ultrascale.distributed.mesh import ParallelContext

    torch.set_num_threads(threads)
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
                times.append(_timed(ops[kind], 5, stat="median"))
            except (RuntimeError, NotImplementedError):
                times = None  # this backend lacks the collective
                break
        results[kind] = times
    if rank == 0:
        with open(os.path.join(out_dir, "collectives.pkl"), "wb") as fh:
            pickle.dump(results, fh)
    dist.destroy_process_group()


def _ping(comm, tensor, rank: int) -> None:
    """One transfer from rank 0 to rank 1 (the others idle)."""
    if rank == 0:
        for w in comm.batch_p2p([("send", tensor, 1)], dim="world"):
            w.wait()
    elif rank == 1:
        for w in comm.batch_p2p([("recv", tensor, 0)], dim="world"):
            w.wait()


def measure_collectives(world: int, backend: str,
                        threads: int = 1) -> dict[str, tuple[float, float] | None]:
    """(bus bandwidth bytes/s, latency s per collective) per kind; None where unsupported."""
    import pickle

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_collective_worker, args=(world, init, backend, tmp, threads), nprocs=world,
                 join=True)
        with open(os.path.join(tmp, "collectives.pkl"), "rb") as fh:
            raw = pickle.load(fh)
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
    import torch

    t0 = time.time()
    cores = _cores()
    sizes = [64, 128, 256, 512] if quick else [64, 128, 256, 384, 512, 768, 1024]
    peaks, halves = {}, {}
    with _threads(1):  # one core: the profile's unit; the cost model scales it to a rank's share
        for dtype in DTYPES:
            pts = measure_matmul(sizes, dtype)
            peaks[dtype], halves[dtype] = fit_efficiency_curve(pts)
            log(f"matmul {dtype}, one core: peak {peaks[dtype] / 1e9:.1f} GFLOP/s, half-rate size "
                f"{halves[dtype] / 1e6:.2f} MFLOP ({', '.join(f'{r / 1e9:.1f}' for _, r in pts)} "
                "GFLOP/s by size)")
        attention = measure_attention(peaks["fp32"])
        hbm = measure_memory_bandwidth()
        overhead = measure_layer_overhead()
        optimizer = measure_optimizer_bytes(hbm)
        log(f"attention forward+backward: {attention:.0%} of the fp32 peak; copy bandwidth of one "
            f"core {hbm / 1e9:.1f} GB/s; fixed cost per layer forward+backward "
            f"{overhead * 1e3:.2f} ms; optimizer update {optimizer:.0f} bytes per parameter")
        draft = Hardware(name="local", peak_flops=dict(peaks), memory_bytes=0.0, hbm_bw=hbm,
                         devices_per_node=1, intra=Link({"all_reduce": 1.0}, 0.0),
                         inter=Link({"all_reduce": 1.0}, 0.0), matmul_eff_max=1.0,
                         matmul_half_flops=halves["fp32"], attention_eff=attention,
                         layer_overhead_s=overhead)
        hbm_eff = measure_elementwise_efficiency(draft)
        log(f"elementwise work of a block: {hbm_eff:.0%} of the copy bandwidth")
    backend = backend or ("nccl" if torch.cuda.is_available() and
                          torch.cuda.device_count() >= ranks else "gloo")
    threads = max(1, cores // ranks)  # what the launcher gives each rank (OMP_NUM_THREADS)
    coll = measure_collectives(ranks, backend, threads)
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
    link = Link(busbw=busbw, latency_s=float(statistics.median(lats)) / steps)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    hw = draft.with_(
        memory_bytes=float(mem) / max(1, ranks), devices_per_node=max(ranks, cores), intra=link,
        inter=link, hbm_eff=hbm_eff, dp_overlap=0.0, optimizer_bytes_per_param=optimizer,
        host_cores=cores,
        source=f"ultrascale calibrate ({backend}, {ranks} ranks on {cores} cores, "
               f"{time.strftime('%Y-%m-%d %H:%M')}; peaks and bandwidth per core; one node: "
               "inter-node figures copy the intra-node ones)")
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
    parser = argparse.ArgumentParser(prog="ultrascale calibrate", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
