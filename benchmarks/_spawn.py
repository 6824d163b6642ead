"""Spawn-and-collect for the benchmarks that run ours beside PyTorch's peer on local ranks.

    results = spawn(4, worker, args)     # {rank: what worker(args) returned on that rank}

Each rank computes on `args.threads` threads. With `gloo` (the default) it joins a gloo process
group before `worker` runs and meets the other ranks at a barrier after, so that no rank tears the
group down while another still uses it; without, `worker` sets up its own (e.g. `init_parallel`).
`worker` must be a module-level function (it is pickled by name) and return something that
pickles. The ranks are started by `ultrascale.distributed.local_ranks.run_ranks`, the spawner
of calibrate and the tests too.

`slowest(seconds)`: a duration as the slowest rank saw it (a step ends when its last rank is done).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ultrascale.distributed.local_ranks import run_ranks


def _rank(worker, args, gloo: bool):
    if gloo:
        dist.init_process_group("gloo")
    out = worker(args)
    if gloo:
        dist.barrier()
    return out


def spawn(ranks: int, worker, args, timeout: float = 3600.0, gloo: bool = True) -> dict:
    """Run `worker(args)` on `ranks` local processes; {rank: its result}."""
    return dict(enumerate(run_ranks(ranks, _rank, worker, args, gloo, timeout=timeout,
                                    threads=args.threads)))


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective: every rank must call it)."""
    t = torch.tensor(seconds)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
