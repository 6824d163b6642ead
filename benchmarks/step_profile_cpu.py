"""Where a CPU training step's time goes, by the cost model's parts, measured against predicted.

    python benchmarks/step_profile_cpu.py --profile benchmarks/data/planner_sweep_cpu_4ranks_xeon/local.yaml
    python benchmarks/step_profile_cpu.py --profile PROFILE.yaml --threads 2 --mbs 8 --acc 1
    python benchmarks/step_profile_cpu.py --smoke     # a tiny model, the recorded Xeon profile

One process trains the planner sweeps' model (`benchmarks/sweep_cpu_base.yaml`) on `--threads`
threads, at the sweeps' global batch of 8 sequences: forward and backward of each micro-batch under
torch's profiler, then the update (the fp64-accumulated gradient norm and the fused AdamW, as the
trainer's runtime and the calibration's update probe run them), timed apart. The profiler's self times are grouped
like `planner.cost.predict`'s breakdown: `matmul` (aten::mm and friends), `attention` (the
scaled-dot-product kernels), `elementwise` (every other aten op: norms, rotary, SwiGLU, residuals,
embedding, cross-entropy, gradient accumulation), `overhead` (the step's wall time that no aten op
accounts for: Python and autograd's host work) and `optimizer`. The prediction uses the profile
with `host_cores` set to the threads, so that the one rank computes on exactly those cores.

No collectives and no time slices are involved: what differs here is the compute part of the model
(the calibration's probes against the same work inside a training step).

Then the calibration's elementwise probe (`planner.probes`, a block's norms, rotary, SwiGLU and
residual adds, forward and backward) at 256 to 2048 tokens on the same threads, as a fraction of
the profile's copy bandwidth: the calibration runs it at 256 and 2048 tokens, the step's
micro-batches hold 256 x mbs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
GLOBAL_SEQS = 8
SMOKE_PROFILE = BENCH / "data" / "planner_sweep_cpu_4ranks_xeon" / "local.yaml"
SMOKE_MODEL = ["model.hidden_size=64", "model.num_layers=1", "model.num_heads=4",
               "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
               "training.seq_len=32"]


def measure(cfg, threads: int, mbs: int, acc: int, steps: int = 5) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from ultrascale.models.llama import build_model
    from ultrascale.parallel.flat import GradSqSum, adamw

    torch.set_num_threads(threads)
    model = build_model(cfg.model, seed=0)
    params = list(model.parameters())
    opt = adamw(params, [], 1e-4, (0.9, 0.95), 0.1, "fused")
    sq_sum = GradSqSum([1] * len(params), "fused", torch.device("cpu"))
    seq, vocab = cfg.training.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        for _ in range(acc):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()

    def update():
        sq_sum([p.grad for p in params])
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(2):  # warm-up: the allocator's heap and the optimizer state
        forward_backward()
        update()
    walls, updates, parts = [], [], []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            forward_backward()
            walls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        update()
        updates.append(time.perf_counter() - t0)
        got = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0}
        for event in prof.key_averages():
            seconds = event.self_cpu_time_total / 1e6
            if event.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"):
                got["matmul"] += seconds
            elif event.key.startswith("aten::_scaled_dot_product"):
                got["attention"] += seconds
            elif event.key.startswith("aten::"):
                got["elementwise"] += seconds
        parts.append(got)
    # The median step (by its wall time), with the median update beside it.
    mid = sorted(range(steps), key=lambda i: walls[i])[steps // 2]
    out = dict(parts[mid])
    # The profiler itself adds host time; the step's wall time without it is measured apart.
    out["overhead"] = max(0.0, walls[mid] - sum(out.values()))
    out["optimizer"] = statistics.median(updates)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", help="hardware profile YAML (ultrascale calibrate)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--acc", type=int, default=None, help="default: 8 sequences / mbs")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a tiny model, two steps, {SMOKE_PROFILE.relative_to(BENCH.parent)} "
                         "unless --profile: check that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.profile = args.profile or str(SMOKE_PROFILE)
    if not args.profile:
        ap.error("--profile is required (a hardware profile: ultrascale calibrate)")
    acc = args.acc or GLOBAL_SEQS // args.mbs
    if args.mbs * acc != GLOBAL_SEQS or args.threads < 1:
        raise SystemExit(f"--mbs {args.mbs} x --acc {acc} must make {GLOBAL_SEQS} sequences, "
                         "with at least one thread.")

    import yaml

    from ultrascale.config import build_config
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    base = yaml.safe_load((BENCH / "sweep_cpu_base.yaml").read_text())
    cfg = build_config(base, ["parallel.dp=1", f"training.micro_batch_size={args.mbs}",
                              f"training.grad_accum_steps={acc}"]
                       + (SMOKE_MODEL if args.smoke else []))
    hw = get_hardware(args.profile)
    if not hw.host_cores:
        raise SystemExit(f"{args.profile} is not a CPU profile (no host_cores): calibrate first.")
    pred = predict(cfg.model, cfg.layout(), hw.with_(host_cores=args.threads),
                   memory=False).breakdown
    got = measure(cfg, args.threads, args.mbs, acc, steps=2 if args.smoke else 5)
    print(f"one process, {args.threads} thread(s), micro-batch {args.mbs} x {acc}, "
          f"profile {hw.name} ({args.profile})")
    print(f"{'part':<12} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9}")
    for part in ("matmul", "attention", "elementwise", "overhead", "optimizer"):
        m, p = got.get(part, 0.0), pred.get(part, 0.0)
        print(f"{part:<12} {m:10.3f} {p:11.3f} {(p / m if m else float('nan')):9.2f}")
    m, p = sum(got.values()), sum(pred.values())
    print(f"{'step':<12} {m:10.3f} {p:11.3f} {p / m:9.2f}")
    print(f"the calibration's elementwise probe on {args.threads} thread(s), against the profile's "
          f"copy bandwidth (the profile says {hw.hbm_eff:.2f}):")
    sizes = (256,) if args.smoke else (256, 512, 1024, 2048)
    for tokens, eff in elementwise_by_size(hw.with_(hbm_bw=hw.hbm_bw * args.threads), sizes):
        print(f"  {tokens:>5} tokens: {eff:.2f}")
    return 0


def elementwise_by_size(hw, sizes=(256, 512, 1024, 2048)) -> list[tuple[int, float]]:
    """(tokens, efficiency) of the calibration's elementwise probe at each size, timed as the
    calibration times it: the fastest of its rounds."""
    from ultrascale.planner import probes

    probes.steady_allocator()
    out = []
    for tokens in sizes:
        block = dict(probes.BLOCK, tokens=tokens)
        step = probes.elementwise_probe(**block)
        inner = probes.inner_calls(step)
        best = min(probes.sample(step, inner) for _ in range(probes.ROUNDS))
        out.append((tokens, probes.elementwise_efficiency(hw, best, **block)))
    return out


if __name__ == "__main__":
    sys.exit(main())
