"""Attention by blocks: the pieces context parallel's ring and all-gather attention compute.

A block is a slice of the queries against a slice of the keys, either wholly visible ("full"),
causal on its diagonal (the queries and keys at the same positions), or under an explicit
boolean mask. Each returns the log-sum-exp of its scores, so that blocks merge exactly
(`merge_attention_`), and its backward takes the output and lse of the queries' whole attention,
so that the blocks' gradients add up to the full ones (FlashAttention's backward, block by block).

Blocks are laid out heads first, [b, h, s, d], the layout attention kernels compute in: the callers
transpose once per attention, not once per block, and the kernels read contiguous rows. Full and
causal blocks run models/ops.py's fused kernel where it runs (a CPU); masked blocks, and every
block elsewhere, the math reference here (`_block_math`).
"""

from __future__ import annotations

import torch

from ultrascale.models import ops


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block and the log-sum-exp of each query's scores.

    q [b, h, sq, d], k/v [b, hk, sk, d] (hk divides h: grouped kv heads; v may have a head
    width of its own, which the output then has); `causal` masks by
    index (query i sees keys 0..i), `mask` bool [sq, sk] (True = attend) replaces it. Returns the
    output [b, h, sq, d] in q's dtype and lse [b, h, sq] in fp32 (-inf where a query sees no key,
    whose output is then 0). On a CPU half-precision blocks compute in fp32 as `ops.attention`
    does, and their output stays fp32 (the callers merge it into fp32 accumulators)."""
    q, k, v = ops.cpu_core(q, k, v)
    if mask is None:
        fused = ops.flash_attention_with_lse(q, k, v, causal)
        if fused is not None:
            return fused
    p, lse, vf = _block_math(q, k, v, causal, mask)
    return (p @ vf).to(q.dtype), lse


def attention_with_lse_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                causal: bool = False, mask: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block (shapes as `attention_with_lse`, heads first), given `out` and
    `lse` of the queries' WHOLE attention (every block merged): the block's probabilities
    exp(score - lse) are then its share of the full softmax. On a CPU half-precision blocks
    compute in fp32 (as the forward), and their gradients stay fp32."""
    grad_out, q, k, v, out = ops.cpu_core(grad_out, q, k, v, out)
    if mask is None:
        fused = ops.flash_attention_with_lse_backward(grad_out, q, k, v, out, lse, causal)
        if fused is not None:
            return fused
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
