"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns.

Usage in a test:

    results = run_ranks(4, train_and_report, cfg_dict)   # list indexed by rank

`fn` must be a module-level function (it is pickled by name); its return value must pickle.

The ranks are forked from one fork server per test session that has already imported torch and the
trainer: a spawned rank spends ~2 s of a shared core importing them, a forked one ~0.05 s, and the
suite starts a few hundred ranks. The server holds no threads and has run no torch op, so forking
it is safe; each rank takes the caller's environment as it is when the ranks start.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports once, before any rank is forked from it.
PRELOAD = ["torch", "torch.distributed", "ultrascale.train.trainer"]


def rank_context():
    """The multiprocessing context the ranks start from (also the benchmarks' spawner's)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world: int, port: int, fn, args, queue, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, now: the fork server's is from its own start
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    try:
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that
        # vanish when this process exits.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report, never hang the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 300.0) -> list:
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the others are probably stuck in a collective; stop them
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
