"""Our 1F1B, interleaved and DualPipeV pipeline schedules against `torch.distributed.pipelining`.

Same Llama (8 layers, hidden 512 by default, untied embeddings), same initial weights, same
micro-batches, same AdamW (single-tensor); pp gloo ranks on this machine, one thread each:

- ours: the trainer's path, `parallelize(build_model(...), ctx, cfg)` with parallel.pp=pp and
  pp_schedule 1f1b, interleaved or dualpipev (pp_virtual_stages=2 for the last two), timed over
  forward_backward + finish_gradients + optimizer_step;
- theirs: one `PipelineStage` per virtual stage, built from the same layers of a copy of the same
  model and placed as ours are (rank r holds stages r, r+pp, ...; under DualPipeV stages r and
  2pp-1-r), driven by `Schedule1F1B`, `ScheduleInterleaved1F1B` or `ScheduleDualPipeV` (the same
  compute order as ours, tests/test_pipeline_schedules.py checks it action by action), then the
  optimizer step.

Runs alternate (a few steps of ours, then a few of theirs, the side going first swapping every
round) after one warm-up step each, so that load from other processes hits both alike. A step is
timed from a barrier to the end of the optimizer step on the slowest rank; the table gives the
medians, their ratio, and the median of the per-round ratios (ours / theirs in the same round).
It also gives the CPU time of a step summed over the ranks, which other jobs on the machine barely
change. Both sides see the same batch at the same step from the same weights, so their per-step
losses must agree (to float rounding): the check that they do the same work. Our point-to-point
traffic per step and rank comes from the counters of distributed/comm.py; for one more step of
each side, the time every rank spends blocked on point-to-point transfers is printed.

    python benchmarks/bench_pipeline.py --ranks 4 --microbatches 8 --rounds 40 --steps-per-round 1
    python benchmarks/bench_pipeline.py --smoke       # tiny sizes, one round: that it runs

`--cprofile DIR` writes, per rank and side, cProfile's table of a few more steps (sorted by own
time) as text into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from _spawn import slowest, spawn

SEED = 1234
SCHEDULES = {"1f1b": 1, "interleaved": 2, "dualpipev": 2}  # ours -> virtual stages per rank
LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.1


def model_config(args, schedule: str):
    from ultrascale.config import build_config
    return build_config({
        # Untied: torch.distributed.pipelining has no tied-weight exchange between first and last
        # stage; with tied embeddings the two sides would not train the same model.
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 8, "num_kv_heads": 8, "ffn_hidden_size": 3 * args.hidden,
                  "vocab_size": 256, "tie_embeddings": False},
        "training": {"seq_len": args.seq_len, "micro_batch_size": args.mbs,
                     "grad_accum_steps": args.microbatches, "grad_clip": None, "steps": 10,
                     "warmup_steps": 0, "seed": SEED},
        "parallel": {"pp": args.ranks, "dp": 1, "pp_schedule": schedule,
                     "pp_virtual_stages": SCHEDULES[schedule]},
        "precision": {"dtype": "fp32"}, "device": "cpu",
    }, [])


def batches(args, n: int):
    """n global batches of m micro-batches; every rank draws the same ones (the first stage needs
    the inputs, the last the targets)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        seq = torch.randint(0, 256, (args.microbatches * args.mbs, args.seq_len + 1),
                            generator=gen)
        yield seq[:, :-1], seq[:, 1:]


def micro_batches(args, x, y):
    # The same cut torch's schedules make of the whole batch: consecutive rows along dim 0.
    return list(zip(x.split(args.mbs), y.split(args.mbs)))


class Ours:
    """Our pipeline runtime, driven the way train/trainer.py drives it."""

    def __init__(self, args, schedule: str):
        from ultrascale.distributed import comm
        from ultrascale.distributed.mesh import init_parallel
        from ultrascale.models.llama import build_model
        from ultrascale.parallel.apply import parallelize
        cfg = model_config(args, schedule)
        self.ctx = init_parallel(cfg)
        comm.set_context(self.ctx)
        self.comm, self.args = comm, args
        self.rt = parallelize(build_model(cfg.model, SEED), self.ctx, cfg)
        self.rt.build_optimizer(LR, BETAS, WD)
        self.scale = 1.0 / (args.microbatches * args.mbs * args.seq_len)  # 1 / global tokens

    def step(self, x, y) -> float:
        """Returns the summed token loss of the batch (0 on ranks without the last stage)."""
        loss = self.rt.forward_backward(micro_batches(self.args, x, y), self.scale)
        self.rt.finish_gradients()
        self.rt.optimizer_step(LR)
        return float(loss)


class StageModule(nn.Module):
    """One virtual stage of the plain model for torch's PipelineStage: the embedding on the first,
    its layers (keyed by global index, as in the model), the final norm and head on the last. The
    forward is Llama.forward restricted to these pieces, as our StageChunk's is."""

    def __init__(self, full, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = full.embed if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in layers})
        self.norm = full.norm if last else None
        self.output = full.output if last else None
        self.head_dim, self.rope_theta = full.cfg.head_dim, full.cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ultrascale.models.ops import rotary_tables
        if self.embed is not None:
            x = self.embed(x)
        rope = rotary_tables(torch.arange(x.shape[1], device=x.device), self.head_dim,
                             self.rope_theta)
        for layer in self.layers.values():
            x = layer(x, rope)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


class Theirs:
    """torch.distributed.pipelining on the same layers, process group and AdamW as ours."""

    def __init__(self, args, schedule: str, group):
        from torch.distributed.pipelining import (
            PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B,
        )

        from ultrascale.models.llama import build_model
        from ultrascale.models.ops import cross_entropy
        from ultrascale.parallel.pipeline.schedules import placement_of, stage_of
        from ultrascale.parallel.pipeline.stage import split_layers
        cfg = model_config(args, schedule)
        pp, v = args.ranks, SCHEDULES[schedule]
        rank = dist.get_rank(group)
        full = build_model(cfg.model, SEED)  # same weights as ours: they depend on the names only
        bounds = split_layers(args.layers, pp, v)  # the same layers per stage as ours
        n = pp * v
        # Our placement (looped: r, r+pp, ...; dualpipev's V: r and 2pp-1-r), in local order.
        stages = [stage_of(rank, c, pp, placement_of(schedule)) for c in range(v)]
        self.is_first, self.is_last = 0 in stages, n - 1 in stages
        mods = [StageModule(full, bounds[s], s == 0, s == n - 1) for s in stages]
        del full  # the stage modules hold this rank's parameters; let the rest go
        # Static shapes, so that no metadata is exchanged at run time (our executor knows them
        # too). requires_grad marks what carries a gradient back: without it no gradient buffer
        # is set up for that tensor.
        act = torch.empty(args.mbs, args.seq_len, args.hidden, requires_grad=True)
        tokens = torch.empty(args.mbs, args.seq_len, dtype=torch.long)
        logits = torch.empty(args.mbs, args.seq_len, 256, requires_grad=True)
        self.stages = [
            PipelineStage(mod, s, n, torch.device("cpu"),
                          input_args=tokens if s == 0 else act,
                          output_args=logits if s == n - 1 else act, group=group)
            for mod, s in zip(mods, stages)]
        self.scale = scale = 1.0 / (args.microbatches * args.mbs * args.seq_len)

        def loss_fn(logits, targets):
            # As ours: summed token cross-entropy times 1 / (global tokens).
            return cross_entropy(logits, targets) * scale

        # scale_grads=False: the loss is already scaled; torch would otherwise divide by m again.
        if v == 1:
            self.schedule = Schedule1F1B(self.stages[0], args.microbatches, loss_fn=loss_fn,
                                         scale_grads=False)
        else:
            runtime = ScheduleDualPipeV if schedule == "dualpipev" else ScheduleInterleaved1F1B
            self.schedule = runtime(self.stages, args.microbatches, loss_fn=loss_fn,
                                    scale_grads=False)
        params = [p for m in mods for p in m.parameters()]
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=1e-8, foreach=False)

    def step(self, x, y) -> float:
        """Returns the summed token loss of the batch (0 on ranks without the last stage)."""
        losses: list[torch.Tensor] = []  # the scaled loss of each micro-batch, on the last stage
        # Outputs are not merged (return_outputs=False): our runtime returns only the loss too.
        self.schedule.step(*((x,) if self.is_first else ()),
                           target=y if self.is_last else None, losses=losses,
                           return_outputs=False)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(sum(l.detach().double() for l in losses)) / self.scale


def timed(impl, x, y) -> tuple[float, float, float]:
    """(wall seconds on the slowest rank, CPU seconds summed over the ranks, loss) of one step.

    The CPU time (every thread of the process, gloo's included) is the second figure because the
    ranks share 2 cores: a step's wall time there is mostly the ranks' total CPU work divided by
    the cores left to them, and the CPU time does not depend on what else the machine runs."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = impl.step(x, y)
    dt, cpu = time.perf_counter() - t0, torch.tensor(time.process_time() - c0)
    dt = slowest(dt)  # the step ends when the slowest rank is done
    dist.all_reduce(cpu)
    return dt, float(cpu), loss


def their_p2p_wait(theirs: Theirs, x, y) -> float:
    """Seconds one step of theirs spends blocked in waits on point-to-point transfers.

    torch's schedules wait on every batch of transfers through `schedules._wait_batch_p2p`; it is
    wrapped for this one step only. (Ours: the wait time comm.py counts on its work handles.)"""
    from torch.distributed.pipelining import schedules
    original, blocked = schedules._wait_batch_p2p, [0.0]

    def timed_wait(works):
        t0 = time.perf_counter()
        original(works)
        blocked[0] += time.perf_counter() - t0

    schedules._wait_batch_p2p = timed_wait
    try:
        theirs.step(x, y)
    finally:
        schedules._wait_batch_p2p = original
    return blocked[0]


def profile_step(impl, x, y, rows: int) -> str:
    """Operator table (self CPU time) of one step of `impl` on this rank."""
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        impl.step(x, y)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def compare(args, schedule: str) -> dict:
    ours = Ours(args, schedule)
    theirs = Theirs(args, schedule, ours.ctx.group("pp"))
    n = args.rounds * args.steps_per_round + 1
    data = list(batches(args, n))
    times = {"ours": [], "theirs": []}
    cpu = {"ours": [], "theirs": []}
    losses = {"ours": [], "theirs": []}
    for name, impl in (("ours", ours), ("theirs", theirs)):  # warm-up step, not timed
        losses[name].append(impl.step(*data[0]))
    i = 1
    for r in range(args.rounds):
        order = (("ours", ours), ("theirs", theirs))
        for name, impl in (order if r % 2 == 0 else order[::-1]):
            for k in range(args.steps_per_round):
                dt, cpu_s, loss = timed(impl, *data[i + k])
                times[name].append(dt)
                cpu[name].append(cpu_s)
                losses[name].append(loss)
        i += args.steps_per_round
    # Per round, the ratio of the two sides' mean step times: adjacent blocks share the machine's
    # load of the moment, so these ratios are steadier than a ratio of overall medians.
    k = args.steps_per_round
    round_ratios = [statistics.mean(times["ours"][j:j + k])
                    / statistics.mean(times["theirs"][j:j + k])
                    for j in range(0, len(times["ours"]), k)]
    dist.barrier()
    with ours.comm.counting() as c:  # one more step of ours, counted
        ours.step(*data[1])
    traffic = {f"{k}/{d}": {"calls": v.calls, "bytes": v.bytes}
               for (k, d), v in c.counters.items() if d == "pp"}
    # Where a rank waits: the time blocked on transfers in that step, ours (comm.py times every
    # wait on a pipeline work handle) and theirs.
    dist.barrier()
    wait = {"ours": c.total(dim="pp", what="time_s"), "theirs": their_p2p_wait(theirs, *data[1])}
    out = {"ours_median_s": statistics.median(times["ours"]),
           "theirs_median_s": statistics.median(times["theirs"]),
           "round_ratios": round_ratios,
           "ours_cpu_median_s": statistics.median(cpu["ours"]),
           "theirs_cpu_median_s": statistics.median(cpu["theirs"]),
           "ours_times": times["ours"], "theirs_times": times["theirs"],
           "ours_cpu": cpu["ours"], "theirs_cpu": cpu["theirs"],
           "ours_losses": losses["ours"], "theirs_losses": losses["theirs"],
           "traffic_per_rank": traffic, "p2p_wait_s": wait,
           "params_on_rank": sum(p.numel() for p in ours.rt.module.parameters())}
    if args.profile:
        out["profile_ours"] = profile_step(ours, *data[1], args.profile)
        out["profile_theirs"] = profile_step(theirs, *data[1], args.profile)
    if args.cprofile:
        for name, impl in (("ours", ours), ("theirs", theirs)):
            cprofile_steps(impl, data[1:1 + args.cprofile_steps], args.cprofile,
                           f"{schedule}-rank{dist.get_rank()}-{name}")
    return out


def cprofile_steps(impl, data, folder: str, name: str) -> None:
    """cProfile's table of these steps of `impl` on this rank, as text: the main thread's CPU time
    per function (own time first; time blocked in a wait is not CPU time), with the process's CPU
    time (gloo's threads too) and the wall time of the same steps above it."""
    import cProfile
    import io
    import pstats
    from pathlib import Path
    dist.barrier()
    prof = cProfile.Profile(time.thread_time)
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    for x, y in data:
        impl.step(x, y)
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime")
    out.write(f"{name}: {len(data)} steps; wall {wall:.3f} s, process CPU {cpu:.3f} s, main "
              f"thread CPU {stats.total_tt:.3f} s (under the profiler)\n")
    stats.print_stats(40)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.txt").write_text(out.getvalue())


def worker(args) -> dict:
    """One rank (started by `_spawn.spawn`, in a gloo process group)."""
    return {s: compare(args, s) for s in args.schedules}


def schedule_floor(args, schedule: str, cores: int) -> float:
    """How far above the CPU floor (all ranks' work / the cores) the schedule itself keeps a step,
    with the ranks sharing `cores` and a backward twice a forward (theory.pipeline's
    processor-sharing replay): no executor, ours or PyTorch's, can beat this; with fewer cores
    than ranks a rank's bubble is mostly filled by the others' work."""
    from ultrascale.theory.pipeline import shared_pipeline_time
    pp, v, m = args.ranks, SCHEDULES[schedule], args.microbatches
    total = shared_pipeline_time(schedule, pp, m, v, (1.0,) * pp, (2.0,) * pp, cores, 1.0)
    return total / (3.0 * m * pp / min(cores, pp))


def last(results: dict, args, schedule: str) -> dict:
    """The results of the rank holding the last stage, where both sides have the loss (rank pp-1,
    or under DualPipeV's V rank 0)."""
    from ultrascale.parallel.pipeline.schedules import owner_of, placement_of
    stage = args.ranks * SCHEDULES[schedule] - 1
    return results[owner_of(stage, args.ranks, placement_of(schedule))[0]][schedule]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks (pp)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps-per-round", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also profile one step of each side per rank, print the top ROWS ops")
    ap.add_argument("--cprofile", metavar="DIR", help="also write cProfile tables of "
                    "--cprofile-steps steps per rank and side into DIR")
    ap.add_argument("--cprofile-steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (2 ranks, 4 layers, hidden 64), one round: that it runs")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.microbatches, args.layers, args.hidden = 2, 4, 4, 64
        args.seq_len, args.rounds, args.steps_per_round = 16, 1, 1
    results = spawn(args.ranks, worker, args, timeout=3600)
    tokens = args.microbatches * args.mbs * args.seq_len
    params = sum(results[r][args.schedules[0]]["params_on_rank"] for r in results)
    print(f"pp={args.ranks} gloo ranks, Llama {args.layers} layers x hidden {args.hidden}, "
          f"{params / 1e6:.1f} M params, {args.microbatches} micro-batches of {args.mbs} x "
          f"{args.seq_len} tokens, {args.rounds} rounds x {args.steps_per_round} steps "
          "alternated\n")
    print("| schedule | ours median s | theirs median s | ratio of medians | median per-round "
          "ratio (quartiles) | CPU s ours / theirs (all ranks) | CPU ratio | max rel. loss diff "
          "| our p2p sent per rank and step (ranks 0..pp-1) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in args.schedules:
        r = last(results, args, s)
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["ours_losses"], r["theirs_losses"]))
        r["max_rel_loss_diff"] = diff
        sent = " / ".join(
            f"{results[q][s]['traffic_per_rank'].get('send/pp', {}).get('bytes', 0) / 1e6:.2f}"
            for q in range(args.ranks))
        label = s + (f" (v={SCHEDULES[s]})" if SCHEDULES[s] > 1 else "")
        rr = r["round_ratios"]
        q1, q2, q3 = statistics.quantiles(rr, n=4) if len(rr) > 1 else rr * 3
        print(f"| {label} | {r['ours_median_s']:.3f} | {r['theirs_median_s']:.3f} | "
              f"{r['ours_median_s'] / r['theirs_median_s']:.2f} | {q2:.2f} ({q1:.2f}-{q3:.2f}) | "
              f"{r['ours_cpu_median_s']:.2f} / "
              f"{r['theirs_cpu_median_s']:.2f} | "
              f"{r['ours_cpu_median_s'] / r['theirs_cpu_median_s']:.2f} | {diff:.1e} | {sent} MB |")
    cores = os.cpu_count() or 1
    floors = [f"{s} {schedule_floor(args, s, cores):.3f} "
              f"({schedule_floor(args, s, args.ranks):.3f})"
              for s in args.schedules]
    print(f"\nthe schedule's own step time over the CPU floor, {args.ranks} ranks on {cores} "
          f"cores (and on one core a rank): " + ", ".join(floors))
    print("\nseconds blocked on point-to-point waits in one step, ours / theirs, ranks 0..pp-1:")
    for s in args.schedules:
        print(f"  {s}: " + ", ".join(f"{results[q][s]['p2p_wait_s']['ours']:.2f}/"
                                     f"{results[q][s]['p2p_wait_s']['theirs']:.2f}"
                                     for q in range(args.ranks)))
    print("\nper-token loss by step (ours, theirs):")
    for s in args.schedules:
        r = last(results, args, s)
        print(f"  {s}: " + ", ".join(f"{a / tokens:.4f}/{b / tokens:.4f}"
                                     for a, b in zip(r["ours_losses"], r["theirs_losses"])))
    if args.profile:
        for s in args.schedules:
            for q in range(args.ranks):
                for side in ("ours", "theirs"):
                    print(f"\n--- {s}, rank {q}, {side} ---\n{results[q][s]['profile_' + side]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
