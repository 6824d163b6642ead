"""Run a function on N local processes (ranks) and collect what each returns: the one spawner of
`ultrascale calibrate`, the multi-process tests and the benchmarks.

    results = run_ranks(4, fn, *args)        # list indexed by rank

`fn` must be a module-level function (it is pickled by name); its return value must pickle. Each
rank finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment (so
`init_process_group()` and `init_parallel` need no arguments), computes on `threads` threads, and
takes the caller's environment as it is when the ranks start.

The ranks are forked from one fork server per process that has already imported torch and the
trainer: a spawned rank spends ~2 s of a core importing them, a forked one ~0.05 s, and the test
suite starts a few hundred ranks. The server holds no threads and has run no torch op (nor
initialised CUDA), so forking it is safe. It starts with OMP_NUM_THREADS=1 in its environment
(the OpenMP runtime reads it once, at torch's import, and sizes its pool for every core without
it); a rank then asks for its `threads`.

No rank outlives its caller: the fork server exits when its caller does, and every rank asks the
kernel to kill it when the fork server goes (`rank_guard`). The first rank that fails stops the
others (they would wait in a collective for it) and its traceback is raised here.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from contextlib import contextmanager

import torch.multiprocessing as mp

# What the fork server imports once, before any rank is forked from it.
PRELOAD = ["torch", "torch.distributed", "ultrascale.train.trainer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context():
    """The multiprocessing context the ranks start from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextmanager
def _environment(**values: str):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(rank: int, world: int, port: int, threads: int, fn, args, queue, env: dict) -> None:
    from ultrascale.rank_guard import LAUNCHER_PID_ENV, guard_rank

    os.environ.clear()
    os.environ.update(env)  # the caller's, now: the fork server's is from its own start
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    os.environ[LAUNCHER_PID_ENV] = str(os.getppid())  # the fork server: die when it does
    guard_rank()
    del os.environ[LAUNCHER_PID_ENV]  # not a launcher of ours to anything this rank starts
    import torch
    torch.set_num_threads(threads)
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


def run_ranks(world: int, fn, *args, timeout: float = 300.0, threads: int = 1) -> list:
    """`fn(*args)` on `world` local ranks; what each returned, by rank. `timeout`: the most
    seconds to wait for each rank's result."""
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, threads, fn, args, queue, env),
                         daemon=True) for r in range(world)]
    with _environment(OMP_NUM_THREADS="1"):  # what the fork server starts with, if it starts now
        for p in procs:
            p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception:  # queue.Empty: a rank hangs (or died without a word)
                dead = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0)]
                errors.append(f"no result within {timeout:.0f} s from ranks "
                              f"{sorted(set(range(world)) - set(results))}"
                              + (f" ({'; '.join(dead)})" if dead else ""))
                break
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
                p.join(timeout=5)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
