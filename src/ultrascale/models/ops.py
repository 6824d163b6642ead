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

import inspect
import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch._guards import detect_fake_mode

from ultrascale.models import flash_blocks
from ultrascale.models.documents import Documents
from ultrascale.models.masks import additive, sequence_offsets, window_mask
from ultrascale.models.swiglu import SwiGLUFunction
from ultrascale.rules.loss import loss_chunk_tokens


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (bias-free, as Llama)."""
    return F.linear(x, weight)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32 whatever their dtypes (a router's scores). Backward keeps x and weight
    as they came and upcasts them again: autograd's own `linear(x.float(), weight.float())` would
    keep an fp32 copy of x (tokens x hidden x 4 bytes a layer in bf16). The same products in the
    same order, so the same gradients, bit for bit."""
    return _LinearFp32.apply(x, weight)


class _LinearFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(
                x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return grad_x, grad_w


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


def swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None = None
           ) -> torch.Tensor:
    """silu(gate) * up, times a per-row `weight` (fp32, gate's shape but its last dim) when
    given: a mixture of experts' routing weights, applied before the down projection (exact by
    its linearity) so that the combine after it need keep no expert output.

    Rounding: silu(gate) and silu * up rounded to the inputs' dtype, as `F.silu(gate) * up`
    (unweighted, bit-identical to it); the weight then multiplied in fp32 and the result
    rounded once more to that dtype (no fp32 copy of the rows is made). Backward keeps gate, up
    (and the weight) only and recomputes silu (autograd's own would keep silu(gate) too); its
    gradients are autograd's through that composition, the weight's summed in fp32."""
    return SwiGLUFunction.apply(gate, up, weight)


@dataclass
class Rope:
    """Rotary tables for the positions a forward sees, computed once and shared by every layer.

    `positions` [seq] are indices into the packed sequence: a context-parallel rank holds two
    non-adjacent chunks of it, and attention masks by these indices, not by the tensor's own.
    With `documents` (models/documents.py) the rotary positions restart at each document, so the
    tables are per sequence ([batch, seq, head_dim]) and attention stays inside documents. The
    tables are fp32; a half-precision forward gets one cast of them, made once and shared too."""

    positions: torch.Tensor
    cos: torch.Tensor  # [seq, head_dim], or [batch, seq, head_dim] with documents
    sin: torch.Tensor
    documents: Documents | None = None
    _cast: dict = field(default_factory=dict, repr=False)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, scaling=None,
                  documents: Documents | None = None) -> Rope:
    """cos/sin for the given sequence indices, "rotate half" convention (Llama's); with
    `documents`, of each token's position within its document. `scaling`: a
    `model.rope_scaling` ("linear", Llama 3.1's "llama3" frequencies, or YaRN's) or None."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    factor = 1.0  # YaRN's attention factor, which scales the tables
    if scaling is not None and scaling.type == "yarn":
        inv_freq = yarn_frequencies(inv_freq, theta, head_dim, scaling)
        factor = yarn_attention_factor(scaling)
    elif scaling is not None and scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor  # every position interpolated alike
    elif scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling.factor, scaling.low_freq_factor,
                                      scaling.high_freq_factor, scaling.original_max_positions)
    rotary_positions = positions if documents is None else documents.rotary_positions(positions)
    angles = rotary_positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return Rope(positions, cos, sin, documents)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling) -> float:
    """What YaRN multiplies the rotary tables by: mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (DeepSeek-V3: 1), else mscale(factor); a config's own
    attention_factor wins."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
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

    low, high = turning_dim(scaling.beta_fast), turning_dim(scaling.beta_slow)
    if scaling.truncate:  # the ramp's ends on whole dimensions, as YaRN's paper rounds them
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the own frequency
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


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
    # [s, d] or [b, s, d] tables against [b, s, heads, d]: one table row for every head
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None, causal: bool = True,
              documents: Documents | None = None, backend: str | None = None,
              kernels: str | None = None, window: int | None = None) -> torch.Tensor:
    """Softmax attention on [batch, seq, heads, head_dim]; k/v may have fewer (grouped) heads,
    and v a head width of its own (multi-head latent attention's): the output has v's.

    `causal` masks by index (query i sees keys 0..i, the usual self-attention); `mask`, a boolean
    [q_seq, k_seq] or [batch, 1, q_seq, k_seq] (True = attend), replaces it where queries and keys
    are not the same positions (a context-parallel rank's chunks against gathered keys).
    `documents` (q, k and v hold the whole sequences, in order) keeps each query inside its own
    document, causally: on CUDA in half precision FlashAttention's variable-length kernel over
    the flattened batch (`varlen_applies`), elsewhere a [batch, 1, seq, seq] mask. `backend`: the
    SDPA kernel of an unmasked call (SDPA_BACKENDS; a measured choice,
    parallel/attention_backend.py), else `attention_backend`'s rule. `window` (causal, q and k
    the whole sequences in order): query i sees keys i - window < j <= i only (Mistral's sliding
    window, as transformers masks it), through the variable-length kernel's window where it
    applies, else one additive mask per micro-batch (`window_mask`); none when it covers the
    sequence.

    Values of their own width (`takes_value_width`): on CUDA the memory-efficient and cuDNN
    kernels take them (`sdpa_backend` picks the former); the fused CPU kernel does not, so on a
    CPU `_PaddedValues` pads them for the kernel alone and keeps every saved tensor at its own
    width; only where no kernel takes them (a width the memory-efficient kernel's alignment
    refuses) are they padded as a whole (`one_width`), the output cut back.

    `kernels`: the device type whose choices it makes (operand dtypes, the SDPA kernel, kv heads
    expanded for it), the tensors' own by default; `ultrascale memory --measure` runs a GPU's on
    fake CPU tensors (the CPU's flash kernel then stands in for the chosen one: both keep the
    output and its log-sum-exp)."""
    kernels = kernels or q.device.type
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if window is not None and (window >= k.shape[1] or mask is not None or not causal):
        window = None  # the window covers every key (a cp core's own mask: see rules/engine.py)
    # The variable-length kernel where the device runs it, and on the fake tensors of `memory
    # --measure` making a GPU's choices (its fake kernel gives a GPU's shapes: no mask is made).
    own = kernels == q.device.type or detect_fake_mode(q) is not None
    if (documents is not None or window is not None) and own \
            and varlen_applies(kernels, q.dtype, qk_dim, v_dim):
        return _varlen_attention(q, k, v, documents, window=window)
    dtype = q.dtype
    if kernels == "cpu":
        q, k, v = cpu_core(q, k, v)
    if documents is not None:
        mask = documents.additive_mask(q.dtype, window)  # one for every layer
    elif window is not None:
        mask = window_mask(q.shape[1], window, q.dtype, q.device)
    if backend is None or mask is not None:
        backend = sdpa_backend(kernels, q.dtype, qk_dim, mask is not None, v_dim)
    kernel, _, expand = backend.partition("+")
    if v_dim != qk_dim and q.device.type == "cpu":
        out = _PaddedValues.apply(*(t.transpose(1, 2) for t in (q, k, v)), mask, causal)
        return out.transpose(1, 2).to(dtype)
    if v_dim != qk_dim and not takes_value_width(kernel, q.dtype, qk_dim, v_dim):
        q, k, v, _ = one_width(q, k, v)
        out = attention(q, k, v, mask, causal, None, None, kernels)
        return out[..., :v_dim]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if gqa and (kernel == "efficient" or expand):  # a kernel that takes as many kv heads as q
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    with _sdpa_backends(kernel if kernels == q.device.type else "cpu"):
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2).to(dtype)


def one_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v ([..., head_dim]) zero-padded to one head width, the wider of q/k and v, for a
    core that takes one; and v's own width, which the caller cuts the output back to. Exact: a
    zero column of q and k adds nothing to a score, a zero column of v gives a zero column of
    the output. Where q and k are the padded ones, q is scaled by sqrt(width / q's width), so
    that a core's default scale 1/sqrt(width) stays 1/sqrt(q's width)."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    width = max(qk_dim, v_dim)
    if width != qk_dim:
        q = q * math.sqrt(width / qk_dim)
    return _pad_to(q, width), _pad_to(k, width), _pad_to(v, width), v_dim


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[-1]
    return F.pad(t, (0, pad)) if pad else t


class _PaddedValues(torch.autograd.Function):
    """PyTorch's fused CPU attention on values of a head width unlike the queries' and keys'.
    The kernel takes one width (sdp_utils_cpp.cpp's check_head_dim_size_cpp; SDPA would fall back
    to its math backend, which keeps the seq x seq probabilities): the narrower operands are
    zero-padded for the kernel alone, in forward and again in backward, with the softmax scale
    given (1/sqrt(q's width)), and what is kept for backward (q, k, v, the output and its fp32
    log-sum-exp) keeps its own width, as a kernel that takes two widths keeps it. Heads first,
    [b, h, s, d]; the output lies in sequence-first memory, as the kernel's own."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal):
        width, v_dim = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        ctx.scale, ctx.causal, ctx.width = q.shape[-1] ** -0.5, causal, width
        added = mask if mask is None or mask.is_floating_point() else additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_to(q, width), _pad_to(k, width), _pad_to(v, width), 0.0, causal and mask is None,
            attn_mask=added, scale=ctx.scale)
        out = out.transpose(1, 2)[..., :v_dim].contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, added)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, added = ctx.saved_tensors
        w = ctx.width
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_to(grad_out, w), _pad_to(q, w), _pad_to(k, w), _pad_to(v, w), _pad_to(out, w),
            lse, 0.0, ctx.causal and added is None, attn_mask=added, scale=ctx.scale)
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        return dq[..., :qk_dim], dk[..., :qk_dim], dv[..., :v_dim], None, None


def _load_varlen():
    """PyTorch's variable-length FlashAttention with a sliding window (torch >= 2.11), or None
    (torch 2.10's takes only `is_causal`: documents then take the masked kernel); and whether it
    takes grouped kv heads (`enable_gqa`: not in torch 2.11's). Read once, at import, so that a
    compiled block traces no signature."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    windowed = "window_size" in inspect.signature(varlen_attn).parameters
    return (varlen_attn if windowed else None), _takes_gqa(varlen_attn)


def _takes_gqa(kernel) -> bool:
    return "enable_gqa" in inspect.signature(kernel).parameters


_VARLEN, _VARLEN_GQA = _load_varlen()


def varlen_applies(device_type: str, dtype: torch.dtype, head_dim: int,
                   v_dim: int | None = None) -> bool:
    """Whether documents take the variable-length kernel: CUDA, half precision, head widths
    FlashAttention takes (one for q, k and v), and a torch that has it (from shapes and dtypes:
    a compiled block traces through it)."""
    return sdpa_backend(device_type, dtype, head_dim, False, v_dim) == "flash" and \
        _VARLEN is not None


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      documents: Documents | None, kernel=None,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention within each document (each sequence without documents) through the
    variable-length kernel: the batch flattened to [tokens, heads, head_dim], each document one
    sequence of it (`documents.cu_seqlens`), each query seeing the `window` - 1 keys before it at
    most. `kernel`: varlen_attn's signature (a test passes a reference)."""
    b, s, h, d = q.shape
    flat = [t.reshape(b * s, t.shape[2], t.shape[3]) for t in (q, k, v)]
    if documents is not None:
        cu, longest = documents.cu_seqlens, documents.max_len
    else:
        cu, longest = sequence_offsets(b, s, q.device), s
    takes_gqa = _VARLEN_GQA if kernel is None else _takes_gqa(kernel)
    kernel = kernel or _VARLEN
    grouped = {"enable_gqa": True} if k.shape[2] != h else {}
    if grouped and not takes_gqa:
        # torch 2.11's kernel has no enable_gqa (seen on an H200, benchmarks/gpu/results/
        # 2026-11-29-h200): each kv head is repeated for its query heads, as SDPA's would be
        flat[1:] = [t.repeat_interleave(h // t.shape[1], dim=1) for t in flat[1:]]
        grouped = {}
    out = kernel(*flat, cu, cu, longest, longest,
                 window_size=(-1 if window is None else window - 1, 0), **grouped)
    return out.view(b, s, h, d)


def cpu_core(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention's operands as its core computes them. PyTorch's fused CPU attention is 3-5x slower
    in half precision than in fp32 (its backward above all; torch 2.13, AVX-512): on a CPU the
    core runs in fp32, softmax included (the playbook's choice anyway); elsewhere as given."""
    if tensors[0].device.type == "cpu" and tensors[0].dtype in (torch.bfloat16, torch.float16):
        return tuple(t.float() for t in tensors)
    return tensors


# -- the fused kernel with its log-sum-exp: what context parallel's blocks compute on --------------
# Heads first, [b, h, s, d]: the layout the kernels compute in (parallel/attention_blocks.py).


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """PyTorch's fused flash kernel of one block (q [b, h, sq, d], k [b, hk, sk, d], v [b, hk,
    sk, dv], grouped kv heads taken): (output [b, h, sq, dv], lse in fp32), or None where it does
    not run (the caller computes the math reference; a GPU's: models/flash_blocks.py). Operands as
    `cpu_core` gives them. Values of a width of their own are zero-padded for the CPU kernel,
    which takes one width (`_PaddedValues`), with the scale given, and the output cut back."""
    if q.device.type != "cpu":
        return flash_blocks.forward(q, k, v, causal)
    width, scale = _kernel_width(q, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _pad_to(q, width), _pad_to(k, width), _pad_to(v, width), 0.0, causal, scale=scale)
    return out[..., :v.shape[-1]], lse.float()


def flash_attention_with_lse_backward(grad_out, q, k, v, out, lse, causal: bool):
    """dq, dk, dv of `flash_attention_with_lse` given the output and lse of the queries' whole
    attention, or None where it does not run."""
    if q.device.type != "cpu":
        return flash_blocks.backward(grad_out, q, k, v, out, lse, causal)
    width, scale = _kernel_width(q, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(_pad_to(t, width) for t in (grad_out, q, k, v, out)), lse.contiguous(), 0.0, causal,
        scale=scale)
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def _kernel_width(q: torch.Tensor, v: torch.Tensor) -> tuple[int, float | None]:
    """The one head width the fused CPU kernel computes at, and the softmax scale to give it (None:
    its default, 1/sqrt(q's width), where nothing is padded)."""
    width = max(q.shape[-1], v.shape[-1])
    return width, (None if width == q.shape[-1] else q.shape[-1] ** -0.5)


def attention_backend(q: torch.Tensor, mask: torch.Tensor | None = None,
                      v_dim: int | None = None) -> str:
    """The SDPA kernel `attention` runs for queries q [batch, heads, seq, head_dim], a mask and
    values `v_dim` wide (None: q's width): on CUDA "flash" (FlashAttention-2: half precision, no
    explicit mask, one head_dim for q, k and v, a multiple of 8 up to 256) where it applies, else
    "efficient" (memory-efficient attention, which takes a mask and values of their own width;
    kv heads are then expanded, as only flash takes grouped kv heads). Both are chosen
    explicitly, so PyTorch's math backend, which builds the seq x seq scores, never runs on a
    GPU. "cpu" elsewhere (PyTorch's fused CPU kernel). Decided from shapes and dtypes only (no
    device query), so that a compiled block traces through it."""
    return sdpa_backend(q.device.type, q.dtype, q.shape[-1], mask is not None, v_dim)


def sdpa_backend(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool,
                 v_dim: int | None = None) -> str:
    """`attention_backend`'s rule, from the inputs' properties."""
    if device_type != "cuda":
        return "cpu"
    half = dtype in (torch.float16, torch.bfloat16)
    one_width = v_dim is None or v_dim == head_dim
    return "flash" if half and one_width and not masked and head_dim % 8 == 0 and \
        head_dim <= 256 else "efficient"


def takes_value_width(kernel: str, dtype: torch.dtype, qk_dim: int, v_dim: int) -> bool:
    """Whether SDPA kernel `kernel` takes values `v_dim` wide beside queries and keys `qk_dim`
    wide, by PyTorch's own checks (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch
    2.10-2.13): FlashAttention-2 wants one width for q, k and v (check_head_dim_size_flash); the
    memory-efficient kernel takes two, each a multiple of its GEMM alignment (8 in half precision
    on sm80 and later, else 4: check_head_dim_size_mem_efficient, minimum_gemm_alignment); cuDNN
    takes two, multiples of 8, up to a limit its version and the GPU set (DeepSeek's 192/128 by
    name on sm90/sm100 from cuDNN 9.11: check_cudnn_tensor_shapes, whose further conditions the
    probe of parallel/attention_backend.py meets by measuring). The fused CPU kernel wants one
    (sdp_utils_cpp.cpp, check_head_dim_size_cpp), hence `_PaddedValues`."""
    half = dtype in (torch.float16, torch.bfloat16)
    if kernel == "efficient":
        align = 8 if half else 4
        return qk_dim % align == 0 and v_dim % align == 0
    if kernel == "cudnn":
        return half and qk_dim % 8 == 0 and v_dim % 8 == 0
    return qk_dim == v_dim


# The SDPA kernels a run may choose on CUDA ("+expand": grouped kv heads expanded to one per query
# head first, for a kernel that refuses them).
SDPA_BACKENDS = ("cudnn", "cudnn+expand", "flash", "efficient")


def _sdpa_backends(kernel: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([chosen[kernel]]) if kernel in chosen else nullcontext()


IGNORE = -100  # a target that counts nothing (the data's IGNORE, data/windows.py)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32; IGNORE targets count nothing."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE)


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
            ignored = (tc < 0).unsqueeze(1)  # IGNORE: no loss, no gradient
            loss += (lse - target_logit).masked_fill(ignored.squeeze(1), 0.0).sum()
            if not want_grad:
                continue
            g = (grad_(lf, lse, local) if valid else lf).masked_fill_(ignored, 0.0)
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
    `chunk_tokens` tokens (rules/loss.py's `loss_chunk_tokens` if None), the row passes of
    `impl` ("torch" or "triton"). Under vocabulary parallel, `weight` holds `columns` of the
    vocabulary and `reduce(max, sumexp, target_logit)` combines the ranks' statistics."""
    tokens = hidden.numel() // hidden.shape[-1]
    chunk = chunk_tokens or loss_chunk_tokens(tokens)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, impl, columns, reduce)
