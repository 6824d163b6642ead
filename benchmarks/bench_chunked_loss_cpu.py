"""The chunked linear + cross-entropy against the plain head on this CPU: the tiny preset's head
(hidden 128) on 4096 tokens, with its byte vocabulary (256) or Llama 3's (128256). Peak bytes of
the tensors alive during forward + backward (`LiveTensorMeter`), time, and the largest differences
of loss and gradients (relative to the largest gradient).

    python benchmarks/bench_chunked_loss_cpu.py [--vocab 256 128256] [--tokens 4096]
    python benchmarks/bench_chunked_loss_cpu.py --smoke      # a tiny head: it runs
"""

from __future__ import annotations

import argparse
import time

import torch

from ultrascale.memory.measure import LiveTensorMeter
from ultrascale.models import ops


def measure(loss_fn, h, w, t):
    a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
    t0 = time.perf_counter()
    with LiveTensorMeter() as meter:
        loss = loss_fn(a, b, t) / t.numel()
        loss.backward()
    return float(loss), a.grad, b.grad, meter.peak_bytes, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[256, 128256])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: check that it runs")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(vocab=[256], tokens=64, hidden=32)
    print("| vocabulary | plain peak MiB | chunked peak MiB | plain s | chunked s | loss diff "
          "| max grad diff / max grad |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for vocab in args.vocab:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(args.tokens, args.hidden, generator=g)
        w = torch.randn(vocab, args.hidden, generator=g) * 0.02
        t = torch.randint(0, vocab, (args.tokens,), generator=g)
        plain = measure(lambda a, b, c: ops.cross_entropy(ops.linear(a, b), c), h, w, t)
        chunked = measure(lambda a, b, c: ops.linear_cross_entropy(a, b, c), h, w, t)
        grad = max(float((x - y).abs().max() / y.abs().max())
                   for x, y in zip(chunked[1:3], plain[1:3]))
        print(f"| {vocab} | {plain[3] / 2**20:.1f} | {chunked[3] / 2**20:.1f} | {plain[4]:.2f} | "
              f"{chunked[4]:.2f} | {abs(plain[0] - chunked[0]):.1e} | {grad:.1e} |", flush=True)


if __name__ == "__main__":
    main()
