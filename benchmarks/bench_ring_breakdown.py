"""Where ring attention's time goes on a CPU: the measurements behind its layout choices.

    python benchmarks/bench_ring_breakdown.py [--seq 4096] [--repeats 8]
    python benchmarks/bench_ring_breakdown.py --smoke        # short sequences: it runs

1. kernel layouts (one process, one thread): PyTorch's CPU flash kernel, forward and backward, on
   one rank's share at cp 2 (2048 queries against 2048 keys, 8 heads of 64, no mask) with K/V
   heads first and contiguous against K/V in sequence-first memory, and with the queries (and the
   backward's output and upstream gradient) in either layout; medians of alternated calls.
2. cp 2, the comparison of `bench_context_parallel.py` (load balancing off): for each rank, the
   share of its CPU time spent in the flash kernels, ours and PyTorch's (torch.profiler over
   three steps), and our step's time waiting on ring shifts (the comm counters: posting and
   waiting, per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import bench_context_parallel as bcp
from _spawn import spawn

FLASH = ("aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def kernel_layouts(args) -> dict[str, float]:
    torch.set_num_threads(1)
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.seq // 2, args.head_dim)
    q, k, v, go = (torch.randn(shape, generator=gen) for _ in range(4))
    out, lse = fwd(q, k, v, 0.0, False)

    def seq_first(t):  # the same values in [b, s, h, d] memory, seen heads first
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    sq, sk, sv, sgo, sout = (seq_first(t) for t in (q, k, v, go, out))
    cases = {
        "forward, K/V heads first": lambda: fwd(sq, k, v, 0.0, False),
        "forward, K/V sequence first": lambda: fwd(sq, sk, sv, 0.0, False),
        "forward, all heads first": lambda: fwd(q, k, v, 0.0, False),
        "backward, K/V heads first": lambda: bwd(sgo, sq, k, v, sout, lse, 0.0, False),
        "backward, K/V sequence first": lambda: bwd(sgo, sq, sk, sv, sout, lse, 0.0, False),
        "backward, all heads first": lambda: bwd(go, q, k, v, out, lse, 0.0, False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3):  # rounds, alternating the cases
        for name, fn in cases.items():
            times[name].append(_median_ms(fn, args.repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def cp2_breakdown(args) -> dict:
    from ultrascale.distributed import comm

    ours, theirs, set_rotate = bcp.ring_sides(args)
    set_rotate("alltoall")
    out = {}
    for name, step in (("ours", ours), ("theirs", theirs)):
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        flash = sum(e.self_cpu_time_total for e in events if e.key in FLASH)
        out[f"{name}: flash kernels / CPU time"] = flash / total
    walls, shifts = [], []
    for _ in range(args.repeats):
        dist.barrier()
        with comm.counting() as c:
            t0 = time.perf_counter()
            ours()
            walls.append(time.perf_counter() - t0)
        shifts.append(sum(v.time_s for (kind, dim), v in c.counters.items()
                          if kind == "ring_shift"))
    out["ours: step ms"] = statistics.median(walls) * 1e3
    out["ours: ring shifts, posting and waiting, ms"] = statistics.median(shifts) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(seq=256, heads=2, kv_heads=2, head_dim=16, repeats=1)
    date = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    print(f"{date}, torch {torch.__version__}")
    layouts = kernel_layouts(args)
    for name, ms in layouts.items():
        print(f"{name}: {ms:.1f} ms")
    ranks = spawn(2, cp2_breakdown, args, gloo=False)
    for rank, figures in ranks.items():
        print(f"cp 2, rank {rank}: " + ", ".join(
            f"{k} {v:.2f}" if v < 1 else f"{k} {v:.1f}" for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": date, "torch": torch.__version__, "args": vars(args),
                       "kernel_layouts_ms": layouts, "cp2_by_rank": ranks}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
