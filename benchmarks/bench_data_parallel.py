"""Our data parallel against torch's DDP, and our ZeRO-3 against FSDP2 `fully_shard`.

Same Llama (8 layers, hidden 512 by default), same initial weights, same batches, same AdamW
(single-tensor); gloo ranks on this machine. Runs are alternated (a few steps of ours, then a few of
theirs, repeated) so that load from other processes hits both alike. A step is timed from a
barrier to the end of the optimizer step on the slowest rank; the table gives the median.
The losses of the two implementations are compared step by step as a check that they do the same
work. Our traffic per step and rank comes from the counters of distributed/comm.py.

    python benchmarks/bench_data_parallel.py --ranks 4 --rounds 4 --steps-per-round 3
    python benchmarks/bench_data_parallel.py --smoke          # 2 ranks, a tiny model: it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from _spawn import slowest, spawn


def model_config(args, zero: int):
    from ultrascale.config import build_config
    return build_config({
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 8, "num_kv_heads": 8, "ffn_hidden_size": 3 * args.hidden,
                  "vocab_size": 256, "tie_embeddings": False},
        "training": {"seq_len": args.seq_len, "micro_batch_size": args.mbs,
                     "grad_accum_steps": 1, "grad_clip": None, "steps": 10, "warmup_steps": 0},
        "parallel": {"dp": args.ranks, "zero": zero, "bucket_mb": 25.0},
        "precision": {"dtype": "fp32"}, "device": "cpu",
    }, [])


def batches(args, rank: int, n: int):
    gen = torch.Generator().manual_seed(rank)
    for _ in range(n):
        seq = torch.randint(0, 256, (args.mbs, args.seq_len + 1), generator=gen)
        yield seq[:, :-1], seq[:, 1:]


class Ours:
    def __init__(self, args, zero: int):
        from ultrascale.distributed import comm
        from ultrascale.distributed.mesh import init_parallel
        from ultrascale.models.llama import build_model
        from ultrascale.parallel.apply import parallelize
        cfg = model_config(args, zero)
        ctx = init_parallel(cfg)
        comm.set_context(ctx)
        self.comm = comm
        self.rt = parallelize(build_model(cfg.model, 1234), ctx, cfg)
        self.rt.build_optimizer(1e-3, (0.9, 0.95), 0.1)
        self.scale = 1.0 / (args.ranks * args.mbs * args.seq_len)

    def step(self, x, y) -> float:
        loss = self.rt.forward_backward([(x, y)], self.scale)
        self.rt.finish_gradients()
        self.rt.optimizer_step(1e-3)
        return float(loss)


class Theirs:
    def __init__(self, args, kind: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        from ultrascale.models.llama import build_model
        model = build_model(model_config(args, 0).model, 1234)
        if kind == "ddp":
            self.model = DistributedDataParallel(model, bucket_cap_mb=25)
        else:
            mesh = init_device_mesh("cpu", (args.ranks,))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        # DDP and FSDP2 average the gradients over ranks where we sum them (our loss is already
        # divided by the global token count): scale up so both optimizers see the same gradient.
        self.scale = 1.0 / (args.mbs * args.seq_len)

    def step(self, x, y) -> float:
        from ultrascale.models.ops import cross_entropy
        loss = cross_entropy(self.model(x), y)
        (loss * self.scale).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


def timed(impl, x, y) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = impl.step(x, y)
    return slowest(time.perf_counter() - t0), loss


def compare(args, ours, theirs, rank: int) -> dict:
    n = args.rounds * args.steps_per_round + 1
    data = list(batches(args, rank, n))
    times = {"ours": [], "theirs": []}
    losses = {"ours": [], "theirs": []}
    for impl, name in ((ours, "ours"), (theirs, "theirs")):  # warm-up step, not timed
        losses[name].append(impl.step(*data[0]))
    i = 1
    for _ in range(args.rounds):
        for name, impl in (("ours", ours), ("theirs", theirs)):
            for k in range(args.steps_per_round):
                dt, loss = timed(impl, *data[i + k])
                times[name].append(dt)
                losses[name].append(loss)
        i += args.steps_per_round
    comm = ours.comm
    with comm.counting() as c:  # one more step of ours, counted
        ours.step(*data[1])
    # time_s: launching plus waiting, i.e. the communication time the step did not hide.
    traffic = {f"{k}/{d}": {"bytes": v.bytes, "wire_bytes": int(v.wire_bytes),
                            "time_s": v.time_s}
               for (k, d), v in c.counters.items() if d == "dp"}
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["theirs"]))
    return {"ours_median_s": statistics.median(times["ours"]),
            "theirs_median_s": statistics.median(times["theirs"]),
            "ours_times": times["ours"], "theirs_times": times["theirs"],
            "ours_losses": losses["ours"], "theirs_losses": losses["theirs"],
            "max_rel_loss_diff": diff, "traffic_per_rank": traffic,
            "params": sum(b.numel for b in ours.rt.data_parallel.buckets),
            "memory": ours.rt.memory_report()}


def worker(args) -> dict:
    """One rank (started by `_spawn.spawn`, in a gloo process group)."""
    rank = dist.get_rank()
    return {"dp_vs_ddp": compare(args, Ours(args, 0), Theirs(args, "ddp"), rank),
            "zero3_vs_fsdp2": compare(args, Ours(args, 3), Theirs(args, "fsdp2"), rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(ranks=2, layers=2, hidden=64, seq_len=16, rounds=1, steps_per_round=1)
    results = spawn(args.ranks, worker, args, timeout=3600)
    r0 = results[0]
    print(f"{args.ranks} gloo ranks, Llama {args.layers} layers x hidden {args.hidden}, "
          f"{r0['dp_vs_ddp']['params'] / 1e6:.1f} M params, batch {args.mbs} x {args.seq_len} "
          f"tokens per rank, {args.rounds} rounds x {args.steps_per_round} steps alternated\n")
    print("| ours vs theirs | ours median s | theirs median s | ratio ours/theirs | "
          "max rel. loss diff | our bytes/rank/step (payload; wire) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, label in (("dp_vs_ddp", "DP (zero=0) vs DDP"),
                       ("zero3_vs_fsdp2", "ZeRO-3 vs FSDP2 fully_shard")):
        r = r0[key]
        traffic = "; ".join(f"{k} {v['bytes'] / 1e6:.1f} MB ({v['wire_bytes'] / 1e6:.1f} MB)"
                            for k, v in sorted(r["traffic_per_rank"].items()))
        print(f"| {label} | {r['ours_median_s']:.3f} | {r['theirs_median_s']:.3f} | "
              f"{r['ours_median_s'] / r['theirs_median_s']:.2f} | {r['max_rel_loss_diff']:.1e} | "
              f"{traffic} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
