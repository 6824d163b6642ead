"""Context parallel's attention blocks on a GPU: PyTorch's FlashAttention-2 kernel with its
log-sum-exp, forward and backward (`ops.flash_attention_with_lse` calls these off a CPU).

A ring or all-gather attention computes each query block against each key block and merges the
blocks by their log-sum-exp; the backward of a block takes the output and log-sum-exp of the
queries' WHOLE attention, so that the blocks' gradients add up to the full ones. FlashAttention's
kernels take exactly these: the forward returns the natural-log lse [b, h, sq] in fp32, the
backward recomputes each probability as exp(score - lse) and its correction term from the output
given. Without them a block ran the math reference, whose fp32 scores [b, h, sq, sk] a GPU then
made per block (4 x 32 heads x 4096^2 x 4 B = 8.6 GB at 4k tokens a rank).

Where the kernel does not apply (fp32, widths other than one multiple of 8 up to 256, a causal
block that is not square) or refuses at launch, None: the caller computes the math reference.
Grouped kv heads go to the kernel as they are (FlashAttention-2 takes them; its dK, dV come back
per kv head)."""

from __future__ import annotations

import warnings

import torch


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """From shapes and dtypes: CUDA, half precision, one head width for q, k and v that
    FlashAttention-2 takes, and a causal block on its diagonal (as many keys as queries)."""
    d = q.shape[-1]
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and k.shape[-1] == d and v.shape[-1] == d and d % 8 == 0 and d <= 256
            and (not causal or q.shape[2] == k.shape[2]))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32) of heads-first blocks, or None."""
    if not applies(q, k, v, causal):
        return None
    try:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    except RuntimeError as exc:  # a GPU or build without the kernel: the math reference
        _refused(exc)
        return None
    return res[0], res[1]


def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """dq, dk, dv of a block given the output and lse of the queries' whole attention, or None.
    The merged output may be an fp32 accumulator: the kernel takes q's dtype."""
    if not applies(q, k, v, causal):
        return None
    # Random-number state for dropout, which is 0: read by no kernel, but the op takes it.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    try:
        return tuple(torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(), None, None,
            q.shape[2], k.shape[2], 0.0, causal, seed, offset))
    except RuntimeError as exc:
        _refused(exc)
        return None


def _refused(exc: RuntimeError) -> None:
    """Said once per place (Python's default warning filter): the blocks run slower, and make
    their scores, from here on."""
    warnings.warn(f"FlashAttention refused a context-parallel block ({str(exc)[:200]}): its "
                  "blocks run the math reference", RuntimeWarning, stacklevel=3)
