"""ZeRO-3 under pipeline parallel: parameters gathered once a step and kept through the
micro-batches (`parallel.zero3_gather: step`) against gathered for each forward and backward
(`micro_batch`).

Same Llama as benchmarks/bench_pipeline.py (8 layers, hidden 512, untied), dp x pp gloo ranks of
this machine (default dp2 x pp2, 1F1B), m micro-batches per pipeline, one thread a rank. Both
runtimes live in every rank, built from the same weights, and alternate one step at a time (the
mode going first swaps every round) after a warm-up step each; a step is timed from a barrier to
the end of the optimizer step on the slowest rank, and its CPU time summed over the ranks. For one
more step of each mode it counts, per rank:

- the parameter all-gathers (calls and bytes, distributed/comm.py's counters): the whole stage
  once a step, against 2m times for every unit whose forward and backward gather it;
- the most parameter bytes held gathered at once (`FullyShardedDataParallel.peak_gathered_bytes`:
  the stage's parameters whole, against a unit or two), and the peak of every other tensor the
  step creates (activations, gradients, temporaries: `memory.measure.LiveTensorMeter`), whose sum
  bounds the step's memory above what the rank holds between steps (shards, optimizer state).

The two modes must give the same losses (the same numbers gathered at other times).

    python benchmarks/bench_pipeline_zero3.py --dp 2 --pp 2 --microbatches 8 --rounds 20
    python benchmarks/bench_pipeline_zero3.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from _spawn import spawn
from bench_pipeline import BETAS, LR, SEED, WD, batches, micro_batches, timed

MODES = ("step", "micro_batch")


def config(args, mode: str):
    from ultrascale.config import build_config
    return build_config({
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 8, "num_kv_heads": 8, "ffn_hidden_size": 3 * args.hidden,
                  "vocab_size": 256, "tie_embeddings": False},
        "training": {"seq_len": args.seq_len, "micro_batch_size": args.mbs,
                     "grad_accum_steps": args.microbatches, "grad_clip": None, "steps": 10,
                     "warmup_steps": 0, "seed": SEED},
        "parallel": {"pp": args.pp, "dp": args.dp, "zero": 3, "zero3_gather": mode,
                     "pp_schedule": args.schedule,
                     "pp_virtual_stages": 2 if args.schedule in ("interleaved", "dualpipev")
                     else 1},
        "precision": {"dtype": "fp32"}, "device": "cpu",
    }, [])


class Mode:
    """Our runtime in one gathering mode, driven the way train/trainer.py drives it."""

    def __init__(self, args, mode: str, ctx):
        from ultrascale.models.llama import build_model
        from ultrascale.parallel.apply import parallelize
        cfg = config(args, mode)
        self.rt = parallelize(build_model(cfg.model, SEED), ctx, cfg)
        self.rt.build_optimizer(LR, BETAS, WD)
        self.args, self.dp_rank = args, ctx.coord("dp")
        # 1 / global tokens: every data-parallel rank runs m micro-batches.
        self.scale = 1.0 / (args.dp * args.microbatches * args.mbs * args.seq_len)

    def step(self, x, y) -> float:
        """This data-parallel rank's share of the batch; the summed token loss on the last
        stage, 0 elsewhere."""
        x, y = x.chunk(self.args.dp)[self.dp_rank], y.chunk(self.args.dp)[self.dp_rank]
        loss = self.rt.forward_backward(micro_batches(self.args, x, y), self.scale)
        self.rt.finish_gradients()
        self.rt.optimizer_step(LR)
        return float(loss)


def counted_step(mode: Mode, x, y, comm) -> dict:
    """One step with its gathers counted and its memory metered."""
    from ultrascale.memory.measure import LiveTensorMeter
    owner = mode.rt.data_parallel
    owner.peak_gathered_bytes = 0
    dist.barrier()
    with comm.counting() as c, LiveTensorMeter() as live:
        mode.step(x, y)
    gathers = [v for (k, _), v in c.counters.items() if k == "all_gather"]
    return {"gather_calls": sum(v.calls for v in gathers),
            "gather_bytes": sum(v.bytes for v in gathers),
            "peak_gathered_bytes": owner.peak_gathered_bytes,
            "peak_other_bytes": live.peak_bytes,
            "held_between_steps": {k: v for k, v in mode.rt.memory_report().items()
                                   if k != "experts"}}


def theory(args, mode: str, pp_rank: int) -> tuple[float, float]:
    """(bytes all-gathered in a step, most held gathered) of this pipeline rank as the estimator
    and the planner count them (theory/gathering.py's replay of its program)."""
    from ultrascale.theory import data
    from ultrascale.theory.shape import model_shape
    from ultrascale.theory.terms import schedule_of
    cfg = config(args, mode)
    lay = cfg.layout()
    layers = cfg.model.num_layers // lay.pp
    g = data.gathering_of(model_shape(cfg.model), lay, pp_rank, layers, layers * pp_rank,
                          *schedule_of(lay).ends(pp_rank, lay.pp), False)
    return g.total, g.peak


def worker(args) -> dict:
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    ctx = init_parallel(config(args, "step"))
    comm.set_context(ctx)
    modes = {m: Mode(args, m, ctx) for m in MODES}
    data = list(batches(argparse.Namespace(microbatches=args.dp * args.microbatches,
                                           mbs=args.mbs, seq_len=args.seq_len),
                        args.rounds + 1))
    times = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    losses = {m: [modes[m].step(*data[0])] for m in MODES}  # warm-up, not timed
    for r in range(args.rounds):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            dt, cpu_s, loss = timed(modes[m], *data[1 + r])
            times[m].append(dt)
            cpu[m].append(cpu_s)
            losses[m].append(loss)
    out = {"times": times, "cpu": cpu, "losses": losses,
           "round_ratios": [a / b for a, b in zip(times["step"], times["micro_batch"])],
           "counted": {m: counted_step(modes[m], *data[1], comm) for m in MODES},
           "pp_rank": ctx.coord("pp"), "dp_rank": ctx.coord("dp")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b",
                    choices=["1f1b", "interleaved", "afab", "zero_bubble", "dualpipev"])
    ap.add_argument("--microbatches", type=int, default=8, help="per pipeline")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that it runs")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    if args.smoke:
        least = 2 * args.pp if args.schedule == "dualpipev" else 2  # the V needs 2 pp
        args.layers, args.hidden, args.seq_len, args.microbatches, args.rounds = 4, 64, 16, least, 1
    results = spawn(args.dp * args.pp, worker, args, timeout=3600)
    ranks = [results[r] for r in sorted(results)]
    loss_ranks = [r for r in ranks if any(r["losses"]["step"])]
    same = all(r["losses"]["step"] == r["losses"]["micro_batch"] for r in loss_ranks)
    first = ranks[0]
    rr = first["round_ratios"]
    q = statistics.quantiles(rr, n=4) if len(rr) > 1 else rr * 3
    print(f"ZeRO-3, dp={args.dp} x pp={args.pp} {args.schedule}, Llama {args.layers} layers x "
          f"hidden {args.hidden}, {args.microbatches} micro-batches of {args.mbs} x "
          f"{args.seq_len} tokens per pipeline, {args.rounds} rounds alternated\n")
    print("| zero3_gather | median step s | CPU s per step (all ranks) | step / micro_batch "
          "(median per-round, quartiles) |")
    print("| --- | --- | --- | --- |")
    for m in MODES:
        ratio = f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})" if m == "step" else "1"
        print(f"| {m} | {statistics.median(first['times'][m]):.3f} | "
              f"{statistics.median(first['cpu'][m]):.2f} | {ratio} |")
    print("\nper rank (pp, dp): all-gathers per step (calls, bytes) | peak gathered parameters "
          "bytes | the theory's two figures | peak of the step's other tensors MB | held between "
          "steps (params + grads + optimizer) MB")
    for r in ranks:
        for m in MODES:
            c = r["counted"][m]
            held = sum(c["held_between_steps"][k] or 0 for k in
                       ("params_bytes", "grads_bytes", "optimizer_bytes"))
            moved, peak = theory(args, m, r["pp_rank"])
            print(f"  ({r['pp_rank']}, {r['dp_rank']}) {m:11s}: {c['gather_calls']:4d}, "
                  f"{c['gather_bytes']:10d} | {c['peak_gathered_bytes']:9d} | theory "
                  f"{moved:10.0f}, {peak:9.0f} | {c['peak_other_bytes'] / 1e6:7.2f} | "
                  f"{held / 1e6:7.2f}")
    print(f"\nlosses equal in both modes: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if not same:
        raise SystemExit("the two gathering modes gave different losses")


if __name__ == "__main__":
    main()
