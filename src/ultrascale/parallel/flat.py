"""The optimizer path of the data-parallel owners (replicated.py, data.py, zero.py, zero3.py):
gradients in flat buffers, the gradient norm and clipping on the device, a fused AdamW over the
fp32 masters, the low-precision parameters refreshed in one multi-tensor copy.

    backward   each gradient lands in its slice of one flat buffer in the accumulation dtype
               (Megatron's `main_grad`; a data-parallel bucket is a slice of it, ZeRO's reduced
               shards are slices of one flat shard buffer). The first micro-batch of a step copies
               its gradient in, later ones add: the buffer is never zero-filled.
    norm       each tensor's norm accumulated in fp64 from its fp32 elements in one multi-tensor
               kernel (`torch._foreach_norm(..., dtype=float64)`: 4 bytes read a parameter, no
               fp64 copy; on a CPU, fp64 dots over 1M-element pieces, 8x faster there); their
               squares, weighted by 1 / (identical copies across the mesh),
               summed in fp64, then over the ranks (the runtime's one all-reduce). fp32
               accumulation is not enough: torch's CPU fp32 norm of a 16M-element tensor is off
               by ~1e-3.
    clip       the coefficient min(1, max_norm / (norm + 1e-6)) (and fp16's unscaling) stays a
               device tensor: no host sync. The fused AdamW takes it as its `grad_scale` (the
               gradients divided by 1 / coefficient inside its kernel, no separate pass; on
               a CPU, none when the coefficient is 1).
    step       `torch.optim.AdamW(fused=True)` over the masters (one multi-tensor kernel on CUDA,
               torch's vectorised fused kernel on a CPU).
    refresh    the low-precision parameters from the masters in one `torch._foreach_copy_`.

`training.optimizer_impl=per_tensor` keeps the path this one replaced, numerically: torch's
for-loop AdamW (`foreach=False`), the norm element by element in fp64, the clip a separate
multiply. It is the reference the fused path is tested against (tests/test_optimizer_path.py)
and the GPU suite's baseline.
"""

from __future__ import annotations

import torch

IMPLS = ("fused", "per_tensor")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same element of one storage (compared by storage, not
    by data pointer: a fake tensor, which `ultrascale memory --measure` runs, has none)."""
    return a.untyped_storage() is b.untyped_storage() and a.storage_offset() == b.storage_offset()


def storage_key(t: torch.Tensor) -> int:
    """An identity of t's storage while it lives (torch keeps one Python object per storage);
    fake tensors have one too, where their data pointers are all 0."""
    return id(t.untyped_storage())


def flat_views(flat: torch.Tensor, shapes, offsets=None) -> list[torch.Tensor]:
    """Views of `flat` shaped as `shapes`, laid end to end (or at `offsets`)."""
    views, o = [], 0
    for i, shape in enumerate(shapes):
        start = o if offsets is None else offsets[i]
        n = 1
        for d in shape:
            n *= d
        views.append(flat[start:start + n].view(shape))
        o = start + n
    return views


def flat_copy(tensors: list[torch.Tensor], dtype: torch.dtype,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat tensor of `dtype` holding copies of `tensors` end to end, and its views."""
    total = sum(t.numel() for t in tensors)
    device = device if device is not None else (tensors[0].device if tensors else "cpu")
    flat = torch.empty(total, dtype=dtype, device=device)
    views = flat_views(flat, [t.shape for t in tensors])
    with torch.no_grad():
        for v, t in zip(views, tensors):
            v.copy_(t.detach())
    return flat, views


def take_grad(view: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """Put a fresh gradient into its slice of the flat buffer: copied in by the step's first
    micro-batch, added by the later ones (so the buffer needs no zero fill between steps)."""
    if first:
        view.copy_(grad.detach())
    else:
        view.add_(grad.detach())  # upcast element by element: no full-precision copy


class GradSqSum:
    """sum_i ||grads[i]||^2 / copies[i] as an fp64 device tensor, for a fixed list of gradients
    (`copies[i]`: the identical copies of gradient i across the mesh, so that summing over all
    ranks counts each element once). fused: the tensors' norms accumulated in fp64 by one
    multi-tensor kernel (on a CPU, one reduction a tensor), combined in fp64; per_tensor: every
    element cast to fp64, squared and summed (the path before)."""

    def __init__(self, copies: list[int], impl: str, device: torch.device):
        self.copies, self.impl, self.device = list(copies), impl, device
        # Made once: a tensor built from a list every step would be a host-to-device copy.
        self.divisors = torch.tensor(self.copies, dtype=torch.float64, device=device)

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if self.impl == "fused" and self.device.type == "cpu":
            return _cpu_sq_sum(grads, self.copies)
        if self.impl == "fused":
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
            return (norms.square() / self.divisors).sum()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for g, n in zip(grads, self.copies):
            total += g.detach().double().pow(2).sum() / n
        return total


# Elements of a gradient squared and summed at once on a CPU: 8 MiB of fp64, cache-sized.
CPU_PIECE = 1 << 20


def _cpu_sq_sum(grads: list[torch.Tensor], copies: list[int]) -> torch.Tensor:
    """The fused sum on a CPU. torch's fp64 norm there converts element by element (0.86 s for a
    347M-parameter model's gradients); pieces copied to fp64 and summed by an fp64 dot
    accumulate the same way (a float32's square is exact in fp64) in 0.10 s
    (benchmarks/bench_optimizer_cpu.py, its "parts")."""
    total = torch.zeros((), dtype=torch.float64)
    for g, n in zip(grads, copies):
        flat = g.detach().reshape(-1)
        part = torch.zeros((), dtype=torch.float64)
        for i in range(0, flat.numel(), CPU_PIECE):
            piece = flat[i:i + CPU_PIECE].double()
            part += torch.dot(piece, piece)
        total += part / n
    return total


def clip_coefficient(sq_sum: torch.Tensor, max_norm: float | None,
                     grad_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm, coefficient) from the global squared sum of gradients that carry `grad_factor`
    (fp16's loss scale, else 1): the norm of the unscaled gradients, and what the gradients are
    multiplied by before the update (the clip and the unscaling in one), both fp64 device
    tensors."""
    norm = sq_sum.sqrt() / grad_factor
    clip = torch.ones_like(norm) if max_norm is None else \
        (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return norm, clip / grad_factor


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], lr: float,
          betas: tuple[float, float], weight_decay: float, impl: str) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm weights are not decayed), as Llama does: fused
    (one multi-tensor kernel per step), or per_tensor (torch's for-loop implementation)."""
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]] or [{"params": [torch.zeros(0)]}]
    how = {"fused": True} if impl == "fused" else {"foreach": False}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **how)


def apply_coefficient(optimizer, grads: list[torch.Tensor], coef: torch.Tensor | None,
                      impl: str) -> None:
    """Make the next `optimizer.step()` use the gradients times `coef`: fused, as the optimizer's
    `grad_scale` (its kernel divides by it); per_tensor, multiplied in place now."""
    if coef is None:
        optimizer.grad_scale = None
        return
    if impl == "fused":
        # On a CPU the fused kernel's division by `grad_scale` writes every gradient back, a
        # second pass over them (8-12% of a 347M model's step: bench_optimizer_cpu.py). Reading
        # a CPU tensor syncs nothing, so a coefficient of exactly 1 (no clip, no loss scale)
        # skips it: dividing by 1 is exact, the update the same bit for bit.
        unit = coef.device.type == "cpu" and bool(coef == 1.0)
        optimizer.grad_scale = None if unit else (1.0 / coef).to(torch.float32)
        return
    optimizer.grad_scale = None
    for g in grads:
        g.mul_(coef.to(g.dtype))


@torch.no_grad()
def refresh(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """The low-precision parameters from their fp32 masters, in one multi-tensor copy."""
    if params:
        torch._foreach_copy_(params, masters)
