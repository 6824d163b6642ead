"""The primitive math of the model, as plain functions: the only place that calls `F.linear` and
`scaled_dot_product_attention`.

The model and every parallel strategy call these, so a precision recipe or a fused kernel that
replaces one of them changes it everywhere at once. Tensors are laid out [batch, seq, heads,
head_dim] between the projections and attention (the layout a sequence or head split cuts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (bias-free, as Llama)."""
    return F.linear(x, weight)


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


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> Rope:
    """cos/sin for the given absolute positions, "rotate half" convention (Llama's)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return Rope(positions, angles.cos(), angles.sin())


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
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
