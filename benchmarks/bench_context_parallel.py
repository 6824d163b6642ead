"""Our ring attention against PyTorch's, and our three context-parallel modes against each other.

    python benchmarks/bench_context_parallel.py [--cp 2 4] [--seq 4096] [--modes-seq 8192 16384]
                                                [--steps 7] [--json out.json]
    python benchmarks/bench_context_parallel.py --smoke      # cp 2, short sequences: it runs

1. Ring against ring, on the same tensors and ranks: ours (`parallel/ring_attention.py`,
   `ring_attention`) against PyTorch's own kernel, `_templated_ring_attention` and its backward
   from `torch.distributed.tensor.experimental._attention` (`_context_parallel._attention` for the
   backward; the public `context_parallel` API has
   no CPU SDPA sharding rule), both over the CPU fused flash attention
   (`aten._scaled_dot_product_flash_attention_for_cpu`), causal, load balancing off (each rank
   holds one contiguous 1/cp of the sequence: theirs needs `enable_load_balance=False` on a CPU,
   ours `parallel.cp_load_balance=false`). PyTorch passes K/V by all-to-all
   (`set_rotate_method("alltoall")`, a ring) or, its default, by one all-gather; both are timed.
   One step is a forward and a backward of the same upstream gradient; the outputs and gradients
   of the two sides are compared first. Steps alternate (ours, theirs, ...; the first side
   alternates too) after a warm-up; the figure is the median of the per-pair ratios ours / theirs
   (below 1.0: ours is faster), of the slowest rank's wall time and of all ranks' CPU time.
2. Our three modes (ring, all_gather, ulysses; balanced) on the same tensors at longer sequences
   (the tiny preset's attention: 4 heads, 2 kv heads of 32), forward and backward, alternated the
   same way: median time of each per step.

Runs on gloo CPU ranks, one thread each (`--threads`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _spawn import slowest, spawn


def _setup(cp: int):
    from ultrascale.config import build_config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel

    cfg = build_config({"model": {"preset": "tiny"}, "parallel": {"dp": 1, "cp": cp},
                        "training": {"seq_len": 2 * cp}, "device": "cpu",
                        "precision": {"dtype": "fp32"}}, [])
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    return ctx


def _tensors(args, seq: int, heads: int, kv_heads: int, head_dim: int):
    """The whole sequence's q, k, v and upstream gradient [b, s, h, d], the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, seq, heads, head_dim)
    kv_shape = (args.batch, seq, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen), torch.randn(kv_shape, generator=gen),
            torch.randn(kv_shape, generator=gen), torch.randn(shape, generator=gen))


def _timed(step) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of all ranks together: every thread of every
    rank, gloo's included; on a machine shared with other jobs the steadier of the two)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    total = torch.tensor(cpu)
    dist.all_reduce(total)
    return slowest(wall), float(total)


def _alternate(steps: dict, n: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """Run each side once per round, `n` rounds after `warmup`, rotating which goes first."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(n):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            times[name].append(_timed(steps[name]))
    return times


def ring_sides(args):
    """This rank's two sides of the comparison on the same tensors: (ours, theirs, set_rotate),
    each side one forward + backward returning (out, dq, dk, dv); `set_rotate(method)` picks
    PyTorch's K/V transport."""
    from torch.distributed.tensor.experimental import _attention as torch_cp
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

    from ultrascale.parallel.context import SequenceShards
    from ultrascale.parallel.ring_attention import block_plan, ring_attention

    cp = int(os.environ["WORLD_SIZE"])
    ctx = _setup(cp)
    rank = ctx.coord("cp")
    group = ctx.group("cp")
    q, k, v, g = _tensors(args, args.seq, args.heads, args.kv_heads, args.head_dim)
    idx = SequenceShards(cp, balanced=False).positions(args.seq, rank)
    q, k, v, g = (t[:, idx].contiguous() for t in (q, k, v, g))
    plan = block_plan(SequenceShards(cp, balanced=False), len(idx), rank)
    torch_cp._cp_options.enable_load_balance = False
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    # Theirs is laid out [b, h, s, d] (sequence on dim 2): the same tensors, transposed once.
    qt, kt, vt, gt = (t.transpose(1, 2).contiguous() for t in (q, k, v, g))

    def ours():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = ring_attention(qq, kk, vv, plan, cp)
        out.backward(g)
        return out, qq.grad, kk.grad, vv.grad

    def theirs():
        out, lse = torch_cp._templated_ring_attention(group, 2, fwd, qt, kt, vt, is_causal=True)
        dq, dk, dv = torch_ring._templated_ring_attention_backward(
            group, 2, bwd, gt, "grad_out", qt, kt, vt, out, lse, is_causal=True, dropout_p=0.0)[:3]
        return out, dq, dk, dv

    return ours, theirs, torch_cp.set_rotate_method


def ring_vs_torch(args) -> dict:
    ours, theirs, set_rotate = ring_sides(args)
    results = {}
    for method in args.rotate:
        set_rotate(method)
        a, b = ours(), theirs()
        diff = max(float((x.detach() - y.transpose(1, 2)).abs().max()) for x, y in zip(a, b))
        times = _alternate({"ours": ours, "theirs": theirs}, args.steps, args.warmup)
        ratios = [x[0] / y[0] for x, y in zip(times["ours"], times["theirs"])]
        cpu_ratios = [x[1] / y[1] for x, y in zip(times["ours"], times["theirs"])]
        results[method] = {"max_abs_diff": diff, "ours": times["ours"],
                           "theirs": times["theirs"],
                           "median_ours_s": statistics.median(t for t, _ in times["ours"]),
                           "median_theirs_s": statistics.median(t for t, _ in times["theirs"]),
                           "median_ratio": statistics.median(ratios), "ratios": ratios,
                           "median_cpu_ratio": statistics.median(cpu_ratios)}
    return results


def modes(args) -> dict:
    from ultrascale.parallel.context import MODES, SequenceShards

    cp = int(os.environ["WORLD_SIZE"])
    ctx = _setup(cp)
    rank = ctx.coord("cp")
    out = {}
    for seq in args.modes_seq:
        q, k, v, g = _tensors(args, seq, *args.mode_shape)
        shards = SequenceShards(cp, balanced=True)
        idx = shards.positions(seq, rank)
        q, k, v, g = (t[:, idx].contiguous() for t in (q, k, v, g))
        cores = {name: cls(shards, rank) for name, cls in MODES.items()}

        def step(core):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            core(qq, kk, vv, idx).backward(g)

        steps = {name: (lambda c=core: step(c)) for name, core in cores.items()}
        times = _alternate(steps, args.mode_steps, 1)
        out[seq] = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, default=4096, help="tokens for ours against PyTorch's")
    p.add_argument("--modes-seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mode-shape", type=int, nargs=3, default=[4, 2, 32],
                   metavar=("HEADS", "KV_HEADS", "HEAD_DIM"),
                   help="attention shape of the modes' comparison (default: the tiny preset's)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--mode-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rotate", nargs="+", default=["alltoall", "allgather"],
                   help="PyTorch's K/V transport(s) to time")
    p.add_argument("--skip-modes", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(cp=[2], seq=256, modes_seq=[256], heads=2, kv_heads=2, head_dim=16,
                          steps=1, mode_steps=1, warmup=0)
    summary = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "shape": {k: getattr(args, k) for k in ("batch", "heads", "kv_heads",
                                                       "head_dim", "mode_shape")},
               "ring_vs_torch": {}, "modes": {}}
    for cp in args.cp:
        r = spawn(cp, ring_vs_torch, args, gloo=False)[0]
        summary["ring_vs_torch"][cp] = r
        for method, x in r.items():
            print(f"cp={cp} seq={args.seq}: ours {x['median_ours_s'] * 1e3:.0f} ms, PyTorch "
                  f"({method}) {x['median_theirs_s'] * 1e3:.0f} ms, median ratio "
                  f"{x['median_ratio']:.3f}, CPU seconds {x['median_cpu_ratio']:.3f} (max |diff| "
                  f"{x['max_abs_diff']:.1e})", flush=True)
        if not args.skip_modes:
            m = spawn(cp, modes, args, gloo=False)[0]
            summary["modes"][cp] = m
            for seq, t in m.items():
                print(f"cp={cp} seq={seq}: " + ", ".join(f"{k} {s * 1e3:.0f} ms"
                                                         for k, s in t.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
