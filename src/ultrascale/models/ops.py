"""The primitive math of the model, as plain functions: the only place that calls `F.linear` and
`scaled_dot_product_attention`.

The model and every parallel strategy call these, so a precision recipe or a fused kernel that
replaces one of them changes it everywhere at once. Tensors are laid out [batch, seq, heads,
head_dim] between the projections and attention (the layout a sequence or head split cuts).
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


# -- mixture of experts: one matmul per expert over its contiguous rows ---------------------------


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
               impl: str = "grouped") -> torch.Tensor:
    """Rows of x [N, in] grouped by expert (the first counts[0] rows for expert 0, and so on)
    times their expert's weight [E, out, in] (E stacked linear weights), transposed: [N, out].

    impl "grouped" is one `F.grouped_mm` call (PyTorch's grouped GEMM, on CPU in fp32 and bf16);
    "loop" is one `linear` per expert, the reference. The grouped kernel wants rows of a multiple
    of 16 bytes (widths divisible by 4 in fp32, 8 in bf16) and, on CUDA, bf16: other shapes and
    dtypes take the loop, whose results are the same."""
    if impl == "loop" or not grouped_mm_applies(x, weight):
        return grouped_mm_loop(x, weight, counts)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # grouped_mm has no autocast rule: cast as linear is
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    offs = counts.cumsum(0).to(torch.int32)
    return _DenseGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as a loop over the experts: the reference path."""
    parts = x.split(counts.tolist())
    return torch.cat([linear(part, w) for part, w in zip(parts, weight.unbind(0))])


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` takes these operands (see `grouped_mm`)."""
    dtype = torch.get_autocast_dtype(x.device.type) \
        if torch.is_autocast_enabled(x.device.type) else x.dtype
    size = torch.empty((), dtype=dtype).element_size()
    aligned = all(d * size % 16 == 0 for d in (weight.shape[1], weight.shape[2]))
    usable = dtype in (torch.float32, torch.bfloat16) if x.device.type == "cpu" \
        else dtype == torch.bfloat16
    return aligned and usable


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward refuses
    expanded (stride-0) ones, which a plain `.sum()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


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
    `model.rope_scaling` (Llama 3.1's "llama3" frequencies, or YaRN's) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    factor = 1.0  # YaRN's attention factor, which scales the tables
    if scaling is not None and scaling.type == "yarn":
        inv_freq = yarn_frequencies(inv_freq, theta, head_dim, scaling)
        factor = yarn_attention_factor(scaling)
    elif scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling.factor, scaling.low_freq_factor,
                                      scaling.high_freq_factor, scaling.original_max_positions)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return Rope(positions, cos, sin)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling) -> float:
    """What YaRN multiplies the rotary tables by: mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (DeepSeek-V3: 1), else mscale(factor)."""
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor,
                                                                        scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_frequencies(inv_freq: torch.Tensor, theta: float, dim: int, scaling) -> torch.Tensor:
    """YaRN's rotary frequencies: each dimension pair blended between its frequency slowed by
    `factor` (interpolated) and its own (extrapolated) by a linear ramp over the pairs that turn
    between beta_fast and beta_slow times in original_max_positions (those turning more keep
    their frequency, those turning less are slowed)."""
    def turning_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(scaling.original_max_positions / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(turning_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(turning_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the own frequency
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dimensions laid out in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    checkpoints) as halves (x0, x2, ..., x1, x3, ...), where `rotary` turns pair i (x_i,
    x_i+d/2) by frequency i: the same rotation of each pair, its dimensions permuted alike in
    queries and keys (which leaves their products unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


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
              mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Softmax attention on [batch, seq, heads, head_dim]; k/v may have fewer (grouped) heads.

    `causal` masks by index (query i sees keys 0..i, the usual self-attention); `mask`, a boolean
    [q_seq, k_seq] (True = attend), replaces it where queries and keys are not the same positions
    (a context-parallel rank's chunks against gathered keys)."""
    dtype = q.dtype
    q, k, v = _cpu_core(q, k, v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    backend = attention_backend(q, mask)
    if gqa and backend == "efficient":  # its kernel takes as many kv heads as query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    with _sdpa_backends(backend):
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


def _sdpa_backends(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return sdpa_kernel([chosen[backend]]) if backend in chosen else nullcontext()


IGNORE = -100  # a target that adds nothing to the loss (PyTorch's and transformers' ignore index)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32; targets equal to IGNORE add nothing (the
    positions multi-token prediction has no token for)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE)


# -- fused Triton kernels (ultrascale/kernels): the same semantics as the references above --------
# The model reaches them through its parameterless kernel children, which `parallelize` swaps once
# by `training.kernels` (parallel/kernels.py); nothing here is switched globally.


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one Triton kernel each way (kernels/rms_norm.py)."""
    from ultrascale.kernels.rms_norm import rms_norm as kernel
    return kernel(x, weight, eps)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`swiglu` as one Triton kernel each way (kernels/swiglu.py)."""
    from ultrascale.kernels.swiglu import swiglu as kernel
    return kernel(gate, up)


def rotary_triton(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """`rotary` as one Triton kernel each way (kernels/rotary.py); it rotates in fp32 from the fp32
    tables and rounds once to x's dtype."""
    from ultrascale.kernels.rotary import rotary as kernel
    return kernel(x, rope.cos, rope.sin)


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


def default_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: the chunk's logits about the size of the whole hidden input (tokens x
    hidden), a power of two and at least 256 tokens (fewer would re-read the head weight for little
    work)."""
    fit = -(-tokens * hidden // max(vocab, 1))
    return min(tokens, max(256, 1 << (fit - 1).bit_length()))


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
            ignored = tc == IGNORE  # no loss, no gradient
            loss += (lse - target_logit).masked_fill(ignored, 0.0).sum()
            if not want_grad:
                continue
            g = grad_(lf, lse, local) if valid else lf
            g.masked_fill_(ignored.unsqueeze(1), 0.0)
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
    chunk = chunk_tokens or default_chunk_tokens(tokens, hidden.shape[-1], weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, impl, columns, reduce)


# -- FP8 matmuls (precision.dtype=fp8): 8-bit inputs with scales, fp32 accumulation --------------
# A matmul a @ b.T (a [m, k], b [n, k]) quantises both operands along the contraction dim k, each
# in tiles with one fp32 scale per tile, multiplies with fp32 accumulation and returns the compute
# dtype. The recipe sets the tiles: tensorwise (one scale per operand), rowwise (one per row), or
# DeepSeek-V3's blockwise (1 x 128 tiles of activations and gradients, 128 x 128 blocks of
# weights). A linear layer's three matmuls (forward, input gradient, weight gradient) each quantise
# their operands along their own contraction dim; the forward's inputs are e4m3, the gradients
# e5m2 or e4m3. `native` runs the device's scaled matmul (`torch._scaled_mm` for tensor- and
# row-wise scales, `torch.nn.functional.scaled_mm` for blocks); otherwise the exact reference:
# quantise, dequantise, fp32 matmul. The model reaches this through `Linear.matmul` (swapped by
# parallel/precision.py), tensor parallel and zero-bubble through the same child.

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128  # DeepSeek-V3's tile length


@dataclass(frozen=True)
class Tile:
    """The part of a 2-D operand one scale covers: `rows` x `cols` elements, None meaning all of
    them (cols run along the contraction dim)."""

    rows: int | None
    cols: int | None


TENSORWISE, ROWWISE = Tile(None, None), Tile(1, None)
RECIPE_TILES = {  # (activations and gradients, weights)
    "tensorwise": (TENSORWISE, TENSORWISE),
    "rowwise": (ROWWISE, ROWWISE),
    "blockwise": (Tile(1, BLOCK), Tile(BLOCK, BLOCK)),
}


@dataclass(frozen=True)
class Fp8Recipe:
    name: str  # tensorwise, rowwise, blockwise
    backward: str = "e5m2"  # the gradients' format (the forward's inputs are e4m3)
    native: bool = False  # the device's scaled matmul, else the reference

    @property
    def tiles(self) -> tuple[Tile, Tile]:
        return RECIPE_TILES[self.name]


def _tile_shape(shape: tuple[int, int], tile: Tile) -> tuple[int, int]:
    return (shape[0] if tile.rows is None else tile.rows,
            shape[1] if tile.cols is None else tile.cols)


def quantize_fp8(t: torch.Tensor, fmt: str, tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): `t` [r, c] in 8 bits and the fp32 dequantisation scale of each tile, so that
    t ~ q * scale. A tile's scale is its largest magnitude over the format's largest finite value
    (448 for e4m3), so that the tile's extreme maps onto it; a tile of zeros gets a tiny scale.
    scale has one entry per tile: [ceil(r / tile rows), ceil(c / tile cols)] (partial tiles at the
    ends)."""
    dtype = FP8_DTYPES[fmt]
    r, c = t.shape
    tr, tc = _tile_shape((r, c), tile)
    nr, nc = -(-r // tr), -(-c // tc)
    x = t.float()
    if nr * tr != r or nc * tc != c:  # pad with zeros to whole tiles (zeros change no maximum)
        x = F.pad(x, (0, nc * tc - c, 0, nr * tr - r))
    blocks = x.view(nr, tr, nc, tc)
    fmax = torch.finfo(dtype).max
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
    q = (blocks / scale[:, None, :, None]).clamp_(-fmax, fmax).to(dtype)
    q = q.view(nr * tr, nc * tc)[:r, :c]
    return q.contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The fp32 values q * scale, each element times its tile's scale."""
    r, c = q.shape
    tr, tc = _tile_shape((r, c), tile)
    full = scale.repeat_interleave(tr, dim=0).repeat_interleave(tc, dim=1)[:r, :c]
    return q.float() * full


def _native_scaled_mm(qa, sa, qb, sb, tiles: tuple[Tile, Tile], out_dtype):
    """qa @ qb.T on the device's scaled matmul (qb is [n, k]: its transpose is column-major)."""
    ta, tb = tiles
    cpu = qa.device.type == "cpu"
    if ta == TENSORWISE and tb == TENSORWISE and not cpu:
        return torch._scaled_mm(qa, qb.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                                out_dtype=out_dtype)
    if {ta, tb} <= {TENSORWISE, ROWWISE}:
        # torch's CPU kernel for a tensor-wise scale is a slow reference (seconds for what the
        # row-wise one does in milliseconds): there, one scale is passed as every row's. Its
        # row-wise kernel is also faster with an fp32 result (rounded once to the compute dtype
        # after it, as on a GPU).
        sa = sa.expand(qa.shape[0], 1).contiguous()
        sb = sb.expand(qb.shape[0], 1).t().contiguous()
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb,
                               out_dtype=torch.float32 if cpu else out_dtype)
        return out.to(out_dtype)
    kinds = {Tile(1, BLOCK): F.ScalingType.BlockWise1x128,
             Tile(BLOCK, BLOCK): F.ScalingType.BlockWise128x128}
    return F.scaled_mm(qa, qb.t(), sa, kinds[ta], sb.t() if tb == Tile(1, BLOCK) else sb,
                       kinds[tb], output_dtype=out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fmt_a: str, fmt_b: str,
               tiles: tuple[Tile, Tile], native: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] @ b [n, k].T with both operands quantised along k (`tiles`: a's and b's), fp32
    accumulation, the result in `out_dtype`."""
    qa, sa = quantize_fp8(a, fmt_a, tiles[0])
    qb, sb = quantize_fp8(b, fmt_b, tiles[1])
    if native:
        return _native_scaled_mm(qa, sa, qb, sb, tiles, out_dtype)
    return (dequantize_fp8(qa, sa, tiles[0]) @ dequantize_fp8(qb, sb, tiles[1]).t()).to(out_dtype)


def fp8_forward(x2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """x [tokens, in] @ weight [out, in].T, both e4m3."""
    act, w = recipe.tiles
    return fp8_matmul(x2d, weight, "e4m3", "e4m3", (act, w), recipe.native, x2d.dtype)


def fp8_grad_input(grad2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """grad [tokens, out] @ weight [out, in]: the contraction runs over the output features, so
    the weight is quantised along them (its transpose's rows)."""
    act, w = recipe.tiles
    return fp8_matmul(grad2d, weight.t().contiguous(), recipe.backward, "e4m3", (act, w),
                      recipe.native, grad2d.dtype)


def fp8_grad_weight(grad2d: torch.Tensor, x2d: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """grad [tokens, out].T @ x [tokens, in]: the contraction runs over the tokens, so both are
    quantised along them (DeepSeek-V3's 128 x 1 tiles of activations for this product)."""
    act, _ = recipe.tiles
    return fp8_matmul(grad2d.t().contiguous(), x2d.t().contiguous(), recipe.backward, "e4m3",
                      (act, act), recipe.native, grad2d.dtype)


class _Fp8Linear(torch.autograd.Function):
    """x [tokens, in] @ weight.T with each of the three matmuls in FP8. Saves x and the weight in
    their own (compute) dtype: each backward matmul quantises along its own contraction dim."""

    @staticmethod
    def forward(ctx, x2d, weight, recipe):
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        return fp8_forward(x2d, weight, recipe)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        g = grad.to(x2d.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_grad_input(g, weight, ctx.recipe)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_grad_weight(g, x2d, ctx.recipe).to(weight.dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """`linear` with FP8 matmuls forward and backward (`recipe`). The tokens are flattened
    outside the autograd function, so that its output is not a view made inside it (tensor
    parallel reduces a row-parallel output in place)."""
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The input gradient of `linear`: grad @ weight, in the gradient's dtype."""
    return grad.matmul(weight.to(grad.dtype))


def linear_grad_weight(grad2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """The weight gradient of `linear` over flattened tokens: grad.T @ x, in the gradient's
    dtype."""
    return grad2d.t().matmul(x2d.to(grad2d.dtype))
