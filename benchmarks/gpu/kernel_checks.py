"""Each fused kernel against eager PyTorch on the device: time (forward + backward, median) and the
largest error of both against an fp32 reference, at the shapes of a 1B Llama step (8192 tokens,
hidden 2048, ffn 8192, 32 heads of 64, vocabulary 128256) or tiny ones for the CPU smoke run.
Also which SDPA kernel attention runs, and its time against PyTorch's math backend."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ultrascale.memory.measure import LiveTensorMeter
from ultrascale.models import ops
from ultrascale.parallel.kernels import rms_norm_triton, rotary_triton, swiglu_triton


@dataclass(frozen=True)
class Shapes:
    tokens: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batch: int
    head_tokens: int  # tokens and hidden size of the linear + cross-entropy check
    head_hidden: int


FULL = Shapes(tokens=8192, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64,
              vocab=128256, batch=4, head_tokens=8192, head_hidden=2048)
# The smoke head has more tokens than hidden units, as a real one: only then is there a saving.
SMOKE = Shapes(tokens=32, hidden=48, ffn=80, heads=2, kv_heads=1, head_dim=12, vocab=300,
               batch=2, head_tokens=256, head_hidden=16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(fn, inputs, grad_seed: int = 0):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    g = torch.Generator(device=out.device).manual_seed(grad_seed)
    out.backward(torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype))
    return [out.detach()] + [x.grad for x in leaves if x.grad is not None]


def _max_error(results, reference) -> float:
    """The largest difference over the output and the gradients, each relative to the largest
    value of its reference (a summed loss is large, a gradient small)."""
    return max(float((r.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(
        min=1e-30)) for r, ref in zip(results, reference))


def compare(name: str, eager, fused, inputs, device: torch.device, repeats: int) -> dict:
    """Time eager and fused forward + backward; errors of both against eager in fp32. A kernel
    that fails gives a row with its error: the suite runs once per lent device, so one broken
    kernel must not hide the others' figures."""
    try:
        return _compare(name, eager, fused, inputs, device, repeats)
    except Exception as exc:
        return {"kernel": name, "dtype": str(inputs[0].dtype).replace("torch.", ""),
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def _compare(name: str, eager, fused, inputs, device: torch.device, repeats: int) -> dict:
    reference = _fwd_bwd(eager, [x.float() if x.is_floating_point() else x for x in inputs])
    t_eager = timed(lambda: _fwd_bwd(eager, inputs), device, repeats)
    t_fused = timed(lambda: _fwd_bwd(fused, inputs), device, repeats)
    return {"kernel": name, "shape": [list(x.shape) for x in inputs],
            "dtype": str(inputs[0].dtype).replace("torch.", ""),
            "eager_ms": t_eager * 1e3, "fused_ms": t_fused * 1e3, "speedup": t_eager / t_fused,
            "eager_max_rel_err_vs_fp32": _max_error(_fwd_bwd(eager, inputs), reference),
            "fused_max_rel_err_vs_fp32": _max_error(_fwd_bwd(fused, inputs), reference)}


def _peak(fn, inputs, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _fwd_bwd(fn, inputs)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveTensorMeter() as meter:
        _fwd_bwd(fn, inputs)
    return meter.peak_bytes


def run(device: torch.device, smoke: bool) -> list[dict]:
    s = SMOKE if smoke else FULL
    half = torch.float32 if smoke else torch.bfloat16  # the interpreter mishandles bf16
    repeats = 3 if smoke else 20
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return torch.randn(shape, generator=g, device=device, dtype=dtype) * scale

    seq = s.tokens // s.batch
    rope = ops.rotary_tables(torch.arange(seq, device=device), s.head_dim, 500000.0)
    out = [
        # Under bf16 autocast the residual stream and the norm run in fp32, the matmul outputs
        # (SwiGLU's inputs, q and k) are bf16.
        compare("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-5),
                lambda x, w: rms_norm_triton(x, w, 1e-5),
                [randn(s.tokens, s.hidden), randn(s.hidden)], device, repeats),
        compare("swiglu", ops.swiglu, swiglu_triton,
                [randn(s.tokens, s.ffn, dtype=half), randn(s.tokens, s.ffn, dtype=half)],
                device, repeats),
        compare("rotary", lambda x: ops.rotary(x, rope), lambda x: rotary_triton(x, rope),
                [randn(s.batch, seq, s.heads, s.head_dim, dtype=half)], device, repeats),
    ]
    hidden = randn(s.head_tokens, s.head_hidden)
    weight = randn(s.vocab, s.head_hidden, scale=0.02)
    targets = torch.randint(0, s.vocab, (s.head_tokens,), device=device, generator=g)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not smoke)

    def plain(h, w):
        with autocast:
            return ops.cross_entropy(ops.linear(h, w), targets)

    def chunked(h, w):
        with autocast:
            # At smoke sizes one default chunk would hold every token: cut it in four.
            return ops.linear_cross_entropy(h, w, targets, impl="triton",
                                            chunk_tokens=s.head_tokens // 4 if smoke else None)

    row = compare("linear_cross_entropy", plain, chunked, [hidden, weight], device,
                  max(1, repeats // 4))
    if "error" not in row:
        row["eager_peak_bytes"] = _peak(plain, [hidden, weight], device)
        row["fused_peak_bytes"] = _peak(chunked, [hidden, weight], device)
    out.append(row)
    out.append(_attention(s, half, randn, device, repeats))
    out.append(_document_attention(s, half, randn, device, repeats))
    out.append(_cp_block_attention(s, half, randn, device, repeats))
    return out


def _attention(s: Shapes, dtype, randn, device: torch.device, repeats: int) -> dict:
    """ops.attention (the backend it chooses) against SDPA's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq = s.tokens // s.batch
    q = randn(s.batch, seq, s.heads, s.head_dim, dtype=dtype)
    k = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)
    v = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)

    def math(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return _math(q, k, v)

    row = compare("attention", math, lambda q, k, v: ops.attention(q, k, v), [q, k, v], device,
                  repeats)
    if "error" not in row:
        row["backend"] = ops.attention_backend(q.transpose(1, 2))
    return row


def _document_attention(s: Shapes, dtype, randn, device: torch.device, repeats: int) -> dict:
    """ops.attention of packed documents (data.document_mask; on CUDA in bf16 the
    variable-length FlashAttention kernel) against SDPA's math backend under the documents'
    mask: documents of uneven lengths, about seq / 8 tokens each."""
    import numpy as np
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ultrascale.data.windows import starts_from_begins
    from ultrascale.models.documents import Documents

    seq = s.tokens // s.batch
    rng = np.random.default_rng(0)
    begins = [np.cumsum(rng.integers(max(1, seq // 16), seq // 4 + 2, size=16)) for _ in
              range(s.batch)]
    docs = Documents.of(np.stack([starts_from_begins(seq, b[b < seq]) for b in begins]), device)
    index = torch.arange(seq, device=device)
    mask = docs.mask(index, index).unsqueeze(1)
    q = randn(s.batch, seq, s.heads, s.head_dim, dtype=dtype)
    k = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)
    v = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)

    def math(q, k, v):
        import torch.nn.functional as F  # the math backend, named: the reference

        with sdpa_kernel([SDPBackend.MATH]):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  enable_gqa=True).transpose(1, 2)

    row = compare("document_attention", math, lambda q, k, v: ops.attention(q, k, v,
                                                                             documents=docs),
                  [q, k, v], device, repeats)
    if "error" not in row:
        row["backend"] = ("varlen" if ops.varlen_applies(device.type, dtype, s.head_dim) else
                          ops.attention_backend(q.transpose(1, 2), mask))
    return row


class _TwoBlocks(torch.autograd.Function):
    """The second half of the queries' causal attention as context parallel computes it: a full
    block over the first half's keys and a causal one over its own, merged by their log-sum-exp;
    the backward block by block from the merged output and lse (parallel/attention_blocks.py; on
    CUDA in bf16 FlashAttention-2 with its lse, models/flash_blocks.py). Sequence first."""

    @staticmethod
    def forward(ctx, q, k, v):
        from ultrascale.parallel.attention_blocks import attention_with_lse, merge_attention_

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # heads first, as the cores call it
        n = k.shape[2] // 2
        out, lse = attention_with_lse(q, k[:, :, :n], v[:, :, :n])
        out, lse = out.float().clone(), lse.float().contiguous().clone()
        merge_attention_(out, lse, *attention_with_lse(q, k[:, :, n:], v[:, :, n:], True))
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        from ultrascale.parallel.attention_blocks import attention_with_lse_backward

        q, k, v, out, lse = ctx.saved_tensors
        n, g = k.shape[2] // 2, grad.transpose(1, 2)
        full = attention_with_lse_backward(g, q, k[:, :, :n], v[:, :, :n], out, lse)
        diag = attention_with_lse_backward(g, q, k[:, :, n:], v[:, :, n:], out, lse, True)
        dq = (full[0].float() + diag[0].float()).to(q.dtype)
        dk, dv = (torch.cat([full[i], diag[i]], 2).to(k.dtype) for i in (1, 2))
        return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


def _cp_block_attention(s: Shapes, dtype, randn, device: torch.device, repeats: int) -> dict:
    """Context parallel's blocks (`_TwoBlocks`) against the math backend's causal attention of
    the same queries (the second half of the sequence) over all keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq = s.tokens // s.batch
    q = randn(s.batch, seq // 2, s.heads, s.head_dim, dtype=dtype)
    k = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)
    v = randn(s.batch, seq, s.kv_heads, s.head_dim, dtype=dtype)

    def math(q, k, v):
        import torch.nn.functional as F  # the math backend, named: the reference

        seen = torch.ones(seq // 2, seq, dtype=torch.bool, device=q.device).tril(seq // 2)
        with sdpa_kernel([SDPBackend.MATH]):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                                  enable_gqa=True).transpose(1, 2)

    row = compare("cp_block_attention", math, _TwoBlocks.apply, [q, k, v], device, repeats)
    if "error" not in row:
        from ultrascale.models import flash_blocks

        row["backend"] = "flash" if flash_blocks.applies(q.transpose(1, 2), k.transpose(1, 2),
                                                         v.transpose(1, 2), False) else \
            ("cpu" if device.type == "cpu" else "math")
    return row


def _math(q, k, v):
    import torch.nn.functional as F  # the math backend, named: the reference, not the model's

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
