"""What document masking costs attention, forward and backward, on this machine's device.

    python benchmarks/bench_document_mask.py [--seq 4096] [--batch 2] [--doc 512] [--repeats 8]
    python benchmarks/bench_document_mask.py --smoke      # tiny sizes: proves it runs

`ops.attention` of a packed micro-batch (documents of `--doc` tokens on average, uneven lengths
from a fixed seed) against plain causal attention of the same tensors: on a CPU the masked
fused kernel against the causal one; on CUDA in bf16 the variable-length FlashAttention kernel
against causal flash. Medians of alternated calls, one thread on a CPU (as a rank of a local run
has), and the ratio masked / causal (below 1: the variable-length kernel skips the blocks between
documents that causal attention computes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ultrascale.data.windows import starts_from_begins
from ultrascale.models import ops
from ultrascale.models.documents import Documents


def documents(batch: int, seq: int, mean: int, device) -> Documents:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(batch):
        lengths = rng.integers(max(1, mean // 4), 2 * mean - mean // 4, size=2 * seq // mean + 2)
        begins = np.cumsum(lengths)
        rows.append(starts_from_begins(seq, begins[begins < seq]))
    return Documents.of(np.stack(rows), device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, repeats: int, device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--doc", type=int, default=512, help="mean document length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.batch, args.doc, args.repeats = 256, 1, 32, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.batch, args.seq)
    q = torch.randn(*shape, args.heads, args.head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
            for _ in range(2))
    docs = documents(args.batch, args.seq, args.doc, device)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)

    def step(documents_or_none):
        def run():
            out = ops.attention(*leaves, documents=documents_or_none)
            out.backward(grad)
            for t in leaves:
                t.grad = None
        return run

    causal = masked = 0.0
    for _ in range(2):  # alternated: each sees the other's cache and clock state
        causal += _median_ms(step(None), args.repeats, device)
        masked += _median_ms(step(docs), args.repeats, device)
    path = ("variable-length flash" if ops.varlen_applies(device.type, dtype, args.head_dim)
            else "fused kernel with the mask")
    print(f"{device.type} {dtype}: batch {args.batch} x {args.seq} tokens, documents of "
          f"~{args.doc} tokens ({len(docs.cu_seqlens) - 1} in all), {args.heads} heads "
          f"({args.kv_heads} kv) of {args.head_dim}")
    print(f"  causal attention, forward + backward:  {causal / 2:9.2f} ms")
    print(f"  document-masked ({path}): {masked / 2:9.2f} ms")
    print(f"  masked / causal: {masked / causal:.2f}")


if __name__ == "__main__":
    main()
