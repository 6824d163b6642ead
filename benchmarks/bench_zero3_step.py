"""Our ZeRO-3 step alone, timed by phase, for comparing two versions of the code on one machine
(the engine-seams refactor's check, issue 27): the data-parallel benchmark's model (8 layers,
hidden 512, 27.5 M parameters) on 4 gloo ranks, one thread each, forward + backward,
finish_gradients and the optimizer step, medians of 6 steps after 2 warm-up steps, rank 0.

    PYTHONPATH=/tmp/old/src python benchmarks/bench_zero3_step.py   # a checkout's src/ (old and
    PYTHONPATH=/tmp/new/src python benchmarks/bench_zero3_step.py   # new alternated: only ratios
                                                                    # mean much)
    python benchmarks/bench_zero3_step.py --smoke                   # 2 ranks, 3 steps: it runs

The version is the one Python imports (PYTHONPATH first), in this process and in its ranks (both
need `ultrascale.distributed.local_ranks`, the spawner).

Only the runtime's public calls of both versions are used (parallelize, forward_backward,
finish_gradients, optimizer_step), so the harness is the same for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

RANKS = 4


def worker(world: int, steps: int) -> dict | None:
    """One rank (started by `local_ranks.run_ranks` on one thread); rank 0's medians."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from ultrascale.config import build_config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = build_config({
        "model": {"preset": None, "hidden_size": 512, "num_layers": 8, "num_heads": 8,
                  "num_kv_heads": 8, "ffn_hidden_size": 1536, "vocab_size": 256,
                  "tie_embeddings": False},
        "training": {"seq_len": 64, "micro_batch_size": 1, "grad_accum_steps": 1,
                     "grad_clip": None, "steps": 10, "warmup_steps": 0},
        "parallel": {"dp": world, "zero": 3, "bucket_mb": 25.0},
        "precision": {"dtype": "fp32"}, "device": "cpu"}, [])
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, 1234), ctx, cfg)
    rt.build_optimizer(1e-3, (0.9, 0.95), 0.1)
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"forward_backward": [], "finish": [], "step": []}
    for i in range(steps):
        seq = torch.randint(0, 256, (1, 65), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        rt.forward_backward([(seq[:, :-1], seq[:, 1:])], 1e-3)
        t1 = time.perf_counter()
        rt.finish_gradients()
        t2 = time.perf_counter()
        rt.optimizer_step(1e-3)
        t3 = time.perf_counter()
        if i >= 2:
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key].append(dt)
    dist.barrier()
    if rank != 0:
        return None
    return {k: round(statistics.median(v), 4) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 ranks, 3 steps: check that it runs")
    args = ap.parse_args(argv)
    import ultrascale
    from ultrascale.distributed.local_ranks import run_ranks

    ranks, steps = (2, 3) if args.smoke else (RANKS, 8)
    medians = run_ranks(ranks, worker, ranks, steps, timeout=1800.0)[0]
    print(os.path.dirname(ultrascale.__file__), medians, "total", round(sum(medians.values()), 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
