"""DualPipeV's paired forward and backward on a CPU: what runs inside a pair, and a step with and
without the turns taken at the expert all-to-alls.

pp2 x dp2 x ep2 on 4 gloo ranks: a small mixture of experts (the first layer dense, the others
MoE), dualpipev over 2 x pp chunks, m micro-batches. Two parts:

- What the engine overlaps (one step, counted, any machine): every collective each rank issues
  (distributed/comm.py's functions, wrapped) with whether it ran inside a paired forward-and-
  backward (`parallel/overlap.py`'s `Turns`) and whether it was waited through `overlap.wait` (the
  expert exchanges, which hand the turn to the other chunk); the executor's paired and unpaired
  compute actions and the turns handed over (`executor.handovers`).
- A timing (a quiet machine only): steps alternating between the executor's `overlap_pairs` on
  (the turns) and off (the pair runs its forward, then its backward), the side going first swapping
  every round, after one warm-up step each; per side the median wall time of a step on the slowest
  rank, the CPU time summed over the ranks, and the time blocked in waits on the expert
  all-to-alls (comm.py times every wait on a work handle). Both sides compute the same step, so
  their losses must agree exactly (the check that they do the same work).

    python benchmarks/dualpipev_overlap_cpu.py --rounds 20 --microbatches 8 --hidden 256
    python benchmarks/dualpipev_overlap_cpu.py --smoke        # tiny sizes, one round: that it runs

On a CPU the overlap is real only as far as gloo moves the bytes in its own threads while the
other chunk computes; with the ranks sharing the cores those bytes are copied by the same cores,
which is why the planner's CPU profiles hide nothing (theory/dualpipev.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist

from _spawn import slowest, spawn

SEED = 1234
LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.1
WRAPPED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "batch_p2p")


def model_config(args):
    from ultrascale.config import build_config
    return build_config({
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 2 * args.hidden,
                  "vocab_size": 256, "tie_embeddings": False, "num_experts": args.experts,
                  "experts_top_k": 2, "moe_ffn_hidden_size": args.hidden, "first_k_dense": 1},
        "training": {"seq_len": args.seq_len, "micro_batch_size": args.mbs,
                     "grad_accum_steps": args.microbatches, "grad_clip": None, "steps": 10,
                     "warmup_steps": 0, "seed": SEED},
        "parallel": {"pp": 2, "dp": 2, "ep": 2, "pp_schedule": "dualpipev",
                     "pp_virtual_stages": 2},
        "precision": {"dtype": "fp32"}, "device": "cpu",
    }, [])


class Run:
    """Our runtime on this rank, driven the way train/trainer.py drives it."""

    def __init__(self, args):
        from ultrascale.distributed import comm
        from ultrascale.distributed.mesh import init_parallel
        from ultrascale.models.llama import build_model
        from ultrascale.parallel.apply import parallelize
        cfg = model_config(args)
        self.ctx = init_parallel(cfg)
        comm.set_context(self.ctx)
        self.comm, self.args = comm, args
        self.rt = parallelize(build_model(cfg.model, SEED), self.ctx, cfg)
        self.rt.build_optimizer(LR, BETAS, WD)
        self.executor = self.rt.schedule.executor
        self.scale = 1.0 / (args.microbatches * args.mbs * args.seq_len * 2)  # dp 2

    def step(self, x, y) -> float:
        self.comm.set_context(self.ctx)  # comm's groups: this runtime's (two share the ranks)
        mbs = list(zip(x.split(self.args.mbs), y.split(self.args.mbs)))
        loss = self.rt.forward_backward(mbs, self.scale)
        self.rt.finish_gradients()
        self.rt.optimizer_step(LR)
        return float(loss)


def batches(args, n: int):
    """n batches of m micro-batches, the same on every rank (the timing, not the loss, is what
    is compared; both sides see the same ones)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        seq = torch.randint(0, 256, (args.microbatches * args.mbs, args.seq_len + 1),
                            generator=gen)
        yield seq[:, :-1], seq[:, 1:]


def census(run: Run, x, y) -> dict:
    """One step with every collective recorded: (kind/dim/tag, in a pair, through overlap.wait)."""
    from ultrascale.parallel import overlap
    comm, seen, waited = run.comm, Counter(), Counter()
    originals = {name: getattr(comm, name) for name in WRAPPED}
    original_wait = overlap.wait
    via_wait = threading.local()

    def wrap(name):
        def call(*a, **kw):
            dim = kw.get("dim", a[2] if name == "all_to_all" and len(a) > 2 else
                         a[1] if len(a) > 1 else "pp")
            paired = getattr(overlap._current, "turns", None) is not None
            seen[(name, str(dim), kw.get("tag", ""), paired)] += 1
            return originals[name](*a, **kw)
        return call

    def wait(work):
        paired = getattr(overlap._current, "turns", None) is not None
        waited[paired] += 1
        via_wait.n = getattr(via_wait, "n", 0) + 1
        return original_wait(work)

    for name in WRAPPED:
        setattr(comm, name, wrap(name))
    overlap.wait = wait
    before = run.executor.handovers
    try:
        run.step(x, y)
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
        overlap.wait = original_wait
    program, _, _ = run.executor.plan(run.args.microbatches)
    compute = [a for a in program if a.is_compute]
    return {"collectives": {f"{k}/{d}/{t}" + (" [in a pair]" if p else ""): n
                            for (k, d, t, p), n in sorted(seen.items())},
            "overlap_wait": {"in a pair": waited[True], "alone": waited[False]},
            "paired_forwards": sum(a.paired for a in compute),
            "forwards": sum(a.kind == "F" for a in compute),
            "handovers": run.executor.handovers - before}


def timed(run: Run, x, y, overlap_on: bool) -> tuple[float, float, float, float]:
    """(wall seconds on the slowest rank, CPU seconds summed over the ranks, seconds this rank
    blocked on the expert all-to-alls, loss) of one step."""
    run.executor.overlap_pairs = overlap_on
    dist.barrier()
    with run.comm.counting() as c:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = run.step(x, y)
        dt, cpu = time.perf_counter() - t0, torch.tensor(time.process_time() - c0)
    dt = slowest(dt)
    dist.all_reduce(cpu)
    return dt, float(cpu), c.total("all_to_all", "ep", what="time_s"), loss


def worker(args) -> dict:
    """One rank (started by `_spawn.spawn`, in a gloo process group)."""
    torch.manual_seed(SEED)
    data = list(batches(args, 2 * args.rounds + 2))
    on, off = Run(args), Run(args)  # the same weights: each side steps its own copy
    out = {"census": census(on, *data[0])}
    off.step(*data[0])  # warm-up of the other side, the same step
    times = {"on": [], "off": []}
    for r in range(args.rounds):
        order = [("on", on, True), ("off", off, False)]
        for name, run, flag in (order if r % 2 == 0 else order[::-1]):
            times[name].append(timed(run, *data[1 + r], flag))
    for name, rows in times.items():
        out[name] = {"median_s": statistics.median(t for t, _, _, _ in rows),
                     "cpu_median_s": statistics.median(c for _, c, _, _ in rows),
                     "ep_wait_median_s": statistics.median(w for _, _, w, _ in rows),
                     "losses": [loss for _, _, _, loss in rows]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write every rank's figures here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.seq_len, args.microbatches, args.rounds = 32, 4, 16, 4, 1
    results = spawn(4, worker, args)
    for rank, r in sorted(results.items()):
        c = r["census"]
        print(f"rank {rank}: {c['paired_forwards']} of {c['forwards']} forwards paired with a "
              f"backward; {c['handovers']} turns handed over; overlap.wait "
              f"{c['overlap_wait']['in a pair']} in a pair, {c['overlap_wait']['alone']} alone")
        for what, n in c["collectives"].items():
            print(f"    {what}: {n}")
    same = all(r["on"]["losses"] == r["off"]["losses"] for r in results.values())
    print(f"\nlosses equal with and without the turns: {same}")
    r0 = results[0]
    print("| overlap_pairs | median step (s) | CPU s (all ranks) | rank 0 blocked on ep a2a (s) |")
    print("|---|---|---|---|")
    for name in ("on", "off"):
        print(f"| {name} | {r0[name]['median_s']:.4f} | {r0[name]['cpu_median_s']:.3f} | "
              f"{r0[name]['ep_wait_median_s']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if not same:
        raise SystemExit("the two sides computed different losses")


if __name__ == "__main__":
    main()
