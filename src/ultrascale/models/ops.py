"""The primitive math of the model, as plain functions: the only place that calls `F.linear` and
`scaled_dot_product_attention`.

The primitives: `linear` (and its two gradients), `rms_norm`, `rotary_tables` / `rotary`,
`swiglu`, `attention`, `cross_entropy` (and the chunked `linear_cross_entropy`, which never holds
the full logits). The model and every parallel strategy call these, so a precision recipe or a
fused kernel that replaces one of them changes it everywhere at once. What replaces them lives
beside its one consumer and reaches `F.linear` and SDPA only through these: the FP8 matmuls in
`parallel/fp8.py`, the experts' grouped GEMM in `models/grouped_gemm.py`, the Triton adapters in
`parallel/kernels.py` (tests/test_import_graph.py keeps it so). Tensors are laid out [batch,
seq, heads, head_dim] between the projections and attention (the layout a sequence or head split
cuts).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (bias-free, as Llama)."""
    return F.linear(x, weight)


def linear_grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The input gradient of `linear`: grad @ weight, in the gradient's dtype."""
    return grad.matmul(weight.to(grad.dtype))


def linear_grad_weight(grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """The weight gradient of `linear` over flattened tokens: grad.T @ x, in the gradient's
    dtype."""
    return grad2d.t().matmul(x2d.to(grad2d.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with its statistics in fp32 (stable under half precision), scaled by `weight`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass
class Rope:
    """Rotary tables for the positions a forward sees, computed once and shared by every layer.

    `positions` [seq] are absolute: a context-parallel rank holds two non-adjacent chunks of the
    sequence, and attention masks by these positions, not by index. The tables are fp32; a
    half-precision forward gets one cast of them, made once and shared too."""

    positions: torch.Tensor
    cos: torch.Tensor  # [seq, head_dim]
    sin: torch.Tensor
    _cast: dict = field(default_factory=dict, repr=False)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, scaling=None) -> Rope:
    """cos/sin for the given absolute positions, "rotate half" convention (Llama's). `scaling`: a
    `model.rope_scaling` (Llama 3.1's "llama3" frequencies) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling.factor, scaling.low_freq_factor,
                                      scaling.high_freq_factor, scaling.original_max_positions)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return Rope(positions, angles.cos(), angles.sin())


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's rotary frequencies: wavelengths longer than original_max_positions /
    low_freq_factor are slowed by `factor`, those shorter than original_max_positions /
    high_freq_factor kept, and the band between blended linearly in original / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    slow = original_max_positions / low_freq_factor  # wavelengths above this: scaled
    fast = original_max_positions / high_freq_factor  # below this: kept
    scaled = torch.where(wavelen > slow, inv_freq / factor, inv_freq)
    blend = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor
                                                                      - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelen >= fast) & (wavelen <= slow)
    return torch.where(between, blended, scaled)


def rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by the positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = rope.tables(x.dtype)  # q and k may be half precision: rotate in their dtype
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None, causal: bool = True,
              backend: str | None = None) -> torch.Tensor:
    """Softmax attention on [batch, seq, heads, head_dim]; k/v may have fewer (grouped) heads.

    `causal` masks by index (query i sees keys 0..i, the usual self-attention); `mask`, a boolean
    [q_seq, k_seq] (True = attend), replaces it where queries and keys are not the same positions
    (a context-parallel rank's chunks against gathered keys). `backend`: the SDPA kernel of an
    unmasked call (SDPA_BACKENDS; a measured choice, parallel/attention_backend.py), else
    `attention_backend`'s rule."""
    dtype = q.dtype
    q, k, v = _cpu_core(q, k, v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if backend is None or mask is not None:
        backend = attention_backend(q, mask)
    kernel, _, expand = backend.partition("+")
    if gqa and (kernel == "efficient" or expand):  # a kernel that takes as many kv heads as q
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    with _sdpa_backends(kernel):
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2).to(dtype)


def _cpu_core(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention's operands as its core computes them. PyTorch's fused CPU attention is 3-5x slower
    in half precision than in fp32 (its backward above all; torch 2.13, AVX-512): on a CPU the
    core runs in fp32, softmax included (the playbook's choice anyway); elsewhere as given."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.bfloat16, torch.float16):
        return tuple(t.float() for t in tensors)
    return tensors


# -- attention by blocks: the pieces of context parallel's ring and all-gather attention ----------
# A block is a slice of the queries against a slice of the keys, either wholly visible ("full"),
# causal on its diagonal (the queries and keys at the same positions), or under an explicit
# boolean mask. Each returns the log-sum-exp of its scores, so that blocks merge exactly. Blocks
# are laid out heads first, [b, h, s, d], the layout attention kernels compute in: the callers
# transpose once per attention, not once per block, and the kernels read contiguous rows.


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block and the log-sum-exp of each query's scores.

    q [b, h, sq, d], k/v [b, hk, sk, d] (hk divides h: grouped kv heads); `causal` masks by
    index (query i sees keys 0..i), `mask` bool [sq, sk] (True = attend) replaces it. Returns the
    output [b, h, sq, d] in q's dtype and lse [b, h, sq] in fp32 (-inf where a query sees no key,
    whose output is then 0). On a CPU, PyTorch's fused flash kernel (it takes grouped kv heads);
    elsewhere, and under a mask, the math reference (`_block_math`). On a CPU half-precision
    blocks compute in fp32 as `attention` does, and their output stays fp32 (the callers merge
    it into fp32 accumulators)."""
    q, k, v = _cpu_core(q, k, v)
    if mask is None and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0,
                                                                               causal)
        return out, lse.float()
    p, lse, vf = _block_math(q, k, v, causal, mask)
    return (p @ vf).to(q.dtype), lse


def attention_with_lse_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                causal: bool = False, mask: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block (shapes as `attention_with_lse`, heads first), given `out` and
    `lse` of the queries' WHOLE attention (every block merged): the block's probabilities
    exp(score - lse) are then its share of the full softmax, and the gradients of the blocks add
    up to the full ones (FlashAttention's backward, block by block). On a CPU half-precision
    blocks compute in fp32 (as the forward), and their gradients stay fp32 (the callers add them
    into fp32 accumulators)."""
    grad_out, q, k, v, out = _cpu_core(grad_out, q, k, v, out)
    if mask is None and q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.contiguous(), 0.0, causal)
    p, _, vf = _block_math(q, k, v, causal, mask, lse)
    g = q.shape[1] // k.shape[1]
    do = grad_out.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * q.shape[-1] ** -0.5
    dq = ds @ _expand_heads(k.float(), g)
    dk = ds.transpose(-1, -2) @ q.float()

    def fold(t: torch.Tensor) -> torch.Tensor:  # sum the query heads that share a kv head
        b, h, s, d = t.shape
        return t.view(b, h // g, g, s, d).sum(2) if g > 1 else t

    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _expand_heads(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=1) if g > 1 else t


def _block_math(q, k, v, causal, mask, lse=None):
    """The math reference of a block (heads first), in fp32: probabilities [b, h, sq, sk], the
    lse (computed, or the given one, e.g. the whole attention's) and v with one head per query
    head."""
    g = q.shape[1] // k.shape[1]
    kf = _expand_heads(k.float(), g)
    vf = _expand_heads(v.float(), g)
    scores = (q.float() @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal and mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)  # a row that sees nothing: probabilities 0
    return torch.exp(scores - safe.unsqueeze(-1)), lse, vf


def merge_attention_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor) -> None:
    """Merge a block's (out, lse) into a running (acc_out [b, h, s, d], acc_lse [b, h, s], fp32)
    in place: the output of attention over the union of the keys, each part weighted by its share
    of the softmax mass. Stable: the weights are exp(lse_part - lse_union) <= 1, and a part whose
    lse is -inf (no key seen yet) weighs 0."""
    new = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    safe = new.masked_fill(torch.isinf(new), 0.0)
    w_old = torch.exp(acc_lse - safe).unsqueeze(-1)
    w_new = torch.exp(lse.to(acc_lse.dtype) - safe).unsqueeze(-1)
    acc_out.mul_(w_old).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


def attention_backend(q: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """The SDPA kernel `attention` runs for queries q [batch, heads, seq, head_dim] and a mask:
    on CUDA "flash" (FlashAttention-2: half precision, no explicit mask, head_dim a multiple of 8
    up to 256) where it applies, else "efficient" (memory-efficient attention, which takes a
    mask; kv heads are then expanded, as only flash takes grouped kv heads). Both are chosen
    explicitly, so PyTorch's math backend, which builds the seq x seq scores, never runs on a
    GPU. "cpu" elsewhere (PyTorch's fused CPU kernel). Decided from shapes and dtypes only (no
    device query), so that a compiled block traces through it."""
    return sdpa_backend(q.device.type, q.dtype, q.shape[-1], mask is not None)


def sdpa_backend(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """`attention_backend`'s rule, from the inputs' properties."""
    if device_type != "cuda":
        return "cpu"
    half = dtype in (torch.float16, torch.bfloat16)
    return "flash" if half and not masked and head_dim % 8 == 0 and head_dim <= 256 \
        else "efficient"


# The SDPA kernels a run may choose on CUDA ("+expand": grouped kv heads expanded to one per query
# head first, for a kernel that refuses them).
SDPA_BACKENDS = ("cudnn", "cudnn+expand", "flash", "efficient")


def _sdpa_backends(kernel: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([chosen[kernel]]) if kernel in chosen else nullcontext()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")


# -- the chunked linear + cross-entropy: the full logits never exist ----------------------------


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of fp32 logits: the max, and the sum of exp(logit - max)."""
    mx = logits.max(dim=-1).values
    return mx, (logits - mx.unsqueeze(-1)).exp_().sum(-1)


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Overwrite fp32 logits with exp(logit - lse) - onehot(target): the gradient of the summed
    cross-entropy. A target of -1 (not among these columns) has no onehot."""
    logits.sub_(lse.unsqueeze(-1)).exp_()
    mine = targets >= 0
    rows = torch.arange(logits.shape[0], device=logits.device)[mine]
    logits[rows, targets[mine]] -= 1.0
    return logits


def _row_passes(impl: str):
    if impl == "triton":
        from ultrascale.kernels import cross_entropy
        return cross_entropy.row_stats, cross_entropy.softmax_grad_
    return row_stats, softmax_grad_


LOSS_CHUNKS = 8  # chunks of the chunked loss (torchtitan's ChunkedLossWrapper takes 8 too)


def default_chunk_tokens(tokens: int) -> int:
    """Tokens per chunk: a few large chunks (at most LOSS_CHUNKS), a power of two of at least 256
    tokens. Each chunk adds a pass over the fp32 weight-gradient sum (vocabulary x hidden) and
    re-reads the head weight, so many small chunks cost more time than the memory they save: at
    8192 tokens and a 128k vocabulary, 8 chunks hold 0.5 GB of fp32 logits at a time where the
    plain head holds 4.2 GB."""
    per_chunk = -(-tokens // LOSS_CHUNKS)
    return min(tokens, max(256, 1 << (per_chunk - 1).bit_length()))


@dataclass(frozen=True)
class VocabColumns:
    """Which columns of the head this rank holds: rows start.. of the full vocabulary, of which the
    first `valid` are real tokens (the rest is padding up to a multiple of tp)."""

    start: int = 0
    valid: int | None = None  # None: every column


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of hidden @ weight.T, a chunk of tokens at a time.

    Each chunk's logits are made, reduced to (max, sum of exponentials, target logit), turned into
    their gradient in place, and multiplied back into the gradients of the hidden states and of
    the weight at once; then they are dropped. So forward holds one chunk of logits at a time and
    saves the two gradients (tokens x hidden, vocab x hidden in fp32) for backward, which only
    scales them: no matmul runs twice. `reduce` (vocabulary parallel) combines the per-row
    statistics of the ranks holding the other columns."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, impl, columns, reduce):
        stats, grad_ = _row_passes(impl)
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        valid = weight.shape[0] if columns.valid is None else columns.valid
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for lo in range(0, h.shape[0], chunk):
            hc, tc = h[lo:lo + chunk], t[lo:lo + chunk]
            logits = linear(hc, weight)  # the compute dtype (bf16 under autocast)
            lf = logits[:, :valid].float()  # fp32 logits: a view, overwritten below
            local = tc - columns.start
            local = torch.where((local >= 0) & (local < valid), local, -1)
            target_logit = lf.gather(1, local.clamp(min=0).unsqueeze(1)).squeeze(1)
            target_logit = target_logit.masked_fill(local < 0, 0.0)
            if valid:
                mx, sumexp = stats(lf)
            else:  # a slice of padding only
                mx = lf.new_full((lf.shape[0],), float("-inf"))
                sumexp = lf.new_zeros(lf.shape[0])
            if reduce is not None:
                mx, sumexp, target_logit = reduce(mx, sumexp, target_logit)
            lse = mx + sumexp.log()
            loss += (lse - target_logit).sum()
            if not want_grad:
                continue
            g = grad_(lf, lse, local) if valid else lf
            if valid < weight.shape[0]:  # padded columns get no gradient
                g = torch.nn.functional.pad(g, (0, weight.shape[0] - valid))
            g = g.to(logits.dtype)
            grad_h[lo:lo + chunk] = (g @ weight.to(g.dtype)).to(h.dtype)
            grad_w += g.t() @ hc.to(g.dtype)  # each chunk's product summed in fp32
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w)
            ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = (grad_h * grad_loss.to(grad_h.dtype)).view(ctx.hidden_shape)
        return grad_h, (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         impl: str = "torch", chunk_tokens: int | None = None,
                         columns: VocabColumns = VocabColumns(), reduce=None) -> torch.Tensor:
    """`cross_entropy(linear(hidden, weight), targets)` without the full logits: chunks of
    `chunk_tokens` tokens (`default_chunk_tokens` if None), the row passes of `impl` ("torch" or
    "triton"). Under vocabulary parallel, `weight` holds `columns` of the vocabulary and
    `reduce(max, sumexp, target_logit)` combines the ranks' statistics."""
    tokens = hidden.numel() // hidden.shape[-1]
    chunk = chunk_tokens or default_chunk_tokens(tokens)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, impl, columns, reduce)
