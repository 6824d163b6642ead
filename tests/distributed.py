"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns.

Usage in a test:

    results = run_ranks(4, train_and_report, cfg_dict)   # list indexed by rank

`fn` must be a module-level function (it is pickled by name); its return value must pickle.
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


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True)
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
