"""The routed experts' grouped GEMM (`grouped_mm`, one `F.grouped_mm` call) against the
per-expert loop (one matmul per expert) on this CPU: one SwiGLU expert layer (gate, up, down) on
rows grouped by expert, forward + backward, for tiny-moe's shape and two larger ones, in fp32 and
bf16. Runs alternate (grouped, loop, grouped, ...) and the table gives medians and their ratio,
with the largest difference of outputs and gradients (relative to the largest value).

    python benchmarks/bench_grouped_gemm_cpu.py [--repeats 7] [--threads 1]
    python benchmarks/bench_grouped_gemm_cpu.py --smoke      # one small shape, once: it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ultrascale.models.grouped_gemm import grouped_mm

# (name, experts, rows = tokens x top_k, hidden, expert width)
SHAPES = [("tiny-moe (8 x 128 x 128, 4096 rows)", 8, 4096, 128, 128),
          ("64 experts x 512 x 256, 8192 rows", 64, 8192, 512, 256),
          ("8 experts x 1024 x 2048, 4096 rows", 8, 4096, 1024, 2048)]


def expert_layer(x, wg, wu, wd, counts, impl):
    gate = grouped_mm(x, wg, counts, impl)
    up = grouped_mm(x, wu, counts, impl)
    return grouped_mm(F.silu(gate) * up, wd, counts, impl)


def run(impl, tensors, counts, upstream):
    leaves = [t.clone().requires_grad_() for t in tensors]
    t0 = time.perf_counter()
    y = expert_layer(*leaves, counts, impl)
    grads = torch.autograd.grad(y, leaves, upstream)
    return time.perf_counter() - t0, y.detach(), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [("smoke (4 x 16 x 8, 64 rows)", 4, 64, 16, 8)] if args.smoke else SHAPES
    if args.smoke:
        args.repeats = 1
    print("| shape | dtype | grouped ms | loop ms | loop / grouped | max diff / max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, e, rows, h, f in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            # Uneven groups, as a router leaves them: one expert without rows among them.
            share = torch.rand(e, generator=g)
            share[1] = 0
            counts = (share / share.sum() * rows).floor().long()
            counts[0] += rows - counts.sum()
            x = torch.randn(rows, h, generator=g).to(dtype)
            ws = [(torch.randn(e, f, h, generator=g) * 0.02).to(dtype),
                  (torch.randn(e, f, h, generator=g) * 0.02).to(dtype),
                  (torch.randn(e, h, f, generator=g) * 0.02).to(dtype)]
            upstream = torch.randn(rows, h, generator=g).to(dtype)
            times = {"grouped": [], "loop": []}
            outs = {}
            run("grouped", [x, *ws], counts, upstream)  # warm-up
            for _ in range(args.repeats):
                for impl in ("grouped", "loop"):
                    dt, y, grads = run(impl, [x, *ws], counts, upstream)
                    times[impl].append(dt)
                    outs[impl] = (y, *grads)
            diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                       for a, b in zip(outs["grouped"], outs["loop"]))
            tg, tl = (statistics.median(times[k]) * 1e3 for k in ("grouped", "loop"))
            print(f"| {name} | {str(dtype).split('.')[1]} | {tg:.1f} | {tl:.1f} | "
                  f"{tl / tg:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
