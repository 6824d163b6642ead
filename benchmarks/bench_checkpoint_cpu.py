"""How long a checkpoint save holds training up, written in place or in the background
(`checkpoint.async_save`): one process saving a state of the given size (fp32 pieces, as a
rank's share of values and Adam moments) with `CheckpointWriter`, the two modes alternated.

For each save: the time `save()` blocks the caller (what a training step waits), and for the
background mode the time until the file is written and the time `poll()` takes to commit.

    python benchmarks/bench_checkpoint_cpu.py [--mib 256] [--rounds 4] [--dir /tmp/ckbench]
    python benchmarks/bench_checkpoint_cpu.py --smoke --dir /tmp/ck   # 1 MiB, one round: it runs
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from ultrascale.checkpoint.index import piece_key
from ultrascale.checkpoint.store import CheckpointMeta, CheckpointWriter
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.train.schedule import LRSchedule


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="state size written per save")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ultrascale-ckbench")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(mib=1, rounds=1)
    comm.set_context(ParallelContext.without_mesh("cpu"))
    names, states, rows = 6, ("param", "exp_avg", "exp_avg_sq"), 1024
    cols = args.mib * 2**20 // (4 * rows * names * len(states))
    state = {piece_key(s, f"w{i}", (0, 0)): torch.randn(rows, cols)
             for i in range(names) for s in states}
    mib = sum(t.numel() * 4 for t in state.values()) / 2**20
    shapes = {f"w{i}": [rows, cols] for i in range(names)}
    root = Path(args.dir)
    results: dict[str, list[tuple[float, float, float]]] = {"in place": [], "background": []}
    for r in range(args.rounds):
        for mode in ("in place", "background") if r % 2 == 0 else ("background", "in place"):
            shutil.rmtree(root, ignore_errors=True)
            writer = CheckpointWriter(root, keep=1, rank=0, world_size=1,
                                      asynchronous=mode == "background")
            meta = CheckpointMeta(1, 1, 1, {}, {}, LRSchedule(1e-3, 0, 1, 0.1).as_dict(), shapes)
            t0 = time.perf_counter()
            writer.save(meta, state)
            blocked = time.perf_counter() - t0
            written = commit = 0.0
            if writer.pending is not None:
                writer.pending.thread.join()
                written = time.perf_counter() - t0
                t1 = time.perf_counter()
                writer.poll()
                commit = time.perf_counter() - t1
            assert writer.close() is not None
            results[mode].append((blocked, written, commit))
    shutil.rmtree(root, ignore_errors=True)
    print(f"state {mib:.0f} MiB, {args.rounds} saves per mode, alternated; medians:")
    print("| mode | save() blocks s | file written after s | commit (poll) s |")
    print("| --- | --- | --- | --- |")
    for mode, runs in results.items():
        med = [statistics.median(x) for x in zip(*runs)]
        later = " | ".join(f"{m:.3f}" if mode == "background" else "-" for m in med[1:])
        print(f"| {mode} | {med[0]:.3f} | {later} |")


if __name__ == "__main__":
    main()
