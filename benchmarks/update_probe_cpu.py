"""Why `ultrascale calibrate` keeps freed memory (`probes.steady_allocator`): the optimizer
update probe in a fresh process, with and without it, against the same work inside trainer ranks.

    python benchmarks/update_probe_cpu.py [--ranks 4] [--steps 8]
    python benchmarks/update_probe_cpu.py --smoke     # 2 ranks of a tiny model: it runs

1. The calibration's update probe (the runtime's update over 4M parameters: the fp64-accumulated
   gradient norm and the fused AdamW, `probes.update_call`; then the per-tensor path it timed
   before 2026-11-28),
   one process on one thread, fresh (each multi-megabyte temporary is a new mmap: page faults on
   every call) and with `steady_allocator()`: ns per parameter.
2. `--ranks` trainer ranks (gloo, dp = ranks, the sweep's 16.8M-parameter Llama, micro-batch 2 of
   256 tokens), ZeRO-0 and ZeRO-1 steps alternated: median seconds of each phase of the step
   (forward+backward, gradient reduction, norm, optimizer update), then the same update probe run
   inside those ranks, every rank at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MODEL = {"preset": None, "hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "ffn_hidden_size": 1536, "vocab_size": 4096, "tie_embeddings": False}


def probe_ns(steady: bool, impl: str = "fused", samples: int = 4) -> float:
    """ns per parameter of the update probe (`impl`: the optimizer path it runs), in this
    process (one thread): the fastest of `samples`."""
    import torch

    from ultrascale.planner.probes import UPDATE_NUMEL, inner_calls, sample, update_call
    from ultrascale.planner.probes import steady_allocator

    torch.set_num_threads(1)
    if steady:
        steady_allocator()
    update = update_call(impl)
    inner = inner_calls(update)
    return min(sample(update, inner) for _ in range(samples)) / UPDATE_NUMEL * 1e9


def trainer_rank(ranks: int, steps: int, model: dict = MODEL, seq: int = 256) -> dict:
    """One trainer rank (started by `run_ranks`): phase times of ZeRO-0 and ZeRO-1 steps, then
    the update probe inside this process."""
    import torch
    import torch.distributed as dist

    from ultrascale.config import build_config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize
    from ultrascale.planner.probes import UPDATE_NUMEL, update_call

    ctx, rts = None, {}
    for zero in (0, 1):
        cfg = build_config({"model": model, "parallel": {"dp": ranks, "zero": zero},
                            "device": "cpu", "precision": {"dtype": "fp32"},
                            "training": {"seq_len": seq, "micro_batch_size": 2,
                                         "grad_accum_steps": 1}}, [])
        if ctx is None:
            ctx = init_parallel(cfg)
            comm.set_context(ctx)
        rts[zero] = parallelize(build_model(cfg.model, 0), ctx, cfg)
        rts[zero].build_optimizer(1e-4, (0.9, 0.95), 0.1)
    x = torch.randint(0, model["vocab_size"], (2, seq + 1))
    micro = [(x[:, :-1], x[:, 1:])]
    phases: dict[int, list[list[float]]] = {0: [], 1: []}
    for i in range(steps):
        for zero in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate which goes first
            rt = rts[zero]
            t = [time.perf_counter()]
            rt.forward_backward(micro, 1.0 / (2 * seq * ranks))
            t.append(time.perf_counter())
            rt.finish_gradients()
            t.append(time.perf_counter())
            rt.clip_grad_norm(1.0)
            t.append(time.perf_counter())
            rt.optimizer_step(1e-4)
            t.append(time.perf_counter())
            phases[zero].append([b - a for a, b in zip(t, t[1:])])
    update = update_call()  # the calibration's update probe (`compute_probes`' "update")
    samples = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        update()
        samples.append(time.perf_counter() - t0)
    return {"phases": phases, "probe_ns": min(samples[1:]) / UPDATE_NUMEL * 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--probe", choices=["fresh", "steady"], help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=["fused", "per_tensor"], help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="2 ranks of a tiny model, 3 steps: check that it runs")
    args = ap.parse_args(argv)
    model, seq = MODEL, 256
    if args.smoke:
        args.ranks, args.steps, seq = 2, 3, 32
        model = {**MODEL, "hidden_size": 64, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                 "ffn_hidden_size": 128, "vocab_size": 256}
    if args.probe:  # a child: one fresh process per measurement
        ns = probe_ns(args.probe == "steady", args.impl or "fused", 1 if args.smoke else 4)
        print(f"{ns:.3f}")
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for impl in ("fused", "per_tensor"):  # the calibration's (the runtime's default), the old
        for mode in ("fresh", "steady"):
            out = subprocess.run([sys.executable, __file__, "--probe", mode, "--impl", impl]
                                 + (["--smoke"] if args.smoke else []),
                                 env=env, check=True, capture_output=True,
                                 text=True).stdout.split()[-1]
            print(f"update probe ({impl}), one process on one thread, {mode} allocator: "
                  f"{float(out):.1f} ns per parameter")
    from ultrascale.distributed.local_ranks import run_ranks

    res = run_ranks(args.ranks, trainer_rank, args.ranks, args.steps, model, seq, timeout=1200)
    print(f"\n{args.ranks} trainer ranks (dp={args.ranks}), median seconds per step, steps after "
          "the first two:")
    for zero in (0, 1):
        cols = list(zip(*[s for r in res for s in r["phases"][zero][2:]]))
        med = [statistics.median(c) for c in cols]
        print(f"  ZeRO-{zero}: forward+backward {med[0]:.3f}, reduction {med[1]:.3f}, norm "
              f"{med[2]:.3f}, update {med[3]:.3f}; norm + update {med[2] + med[3]:.3f}")
    inside = ", ".join(f"{r['probe_ns']:.1f}" for r in res)
    print(f"update probe inside the ranks, every rank at once: {inside} ns per parameter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
