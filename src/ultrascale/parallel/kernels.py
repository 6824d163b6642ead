"""Fused kernels and the chunked loss (`training.kernels`, `training.chunked_loss`), applied by
`parallelize` through the model's seams: parameterless children swapped for fused ones.

- `RMSNorm.kernel`, `Attention.rotary`, `FeedForward.act` and the experts' `act` (inside a
  selective-recompute checkpoint if there is one) become the Triton kernels of `kernels/` (through
  the adapters below, with the semantics of `models/ops.py`'s references) when the choice is
  "triton" (`auto`: Triton on CUDA when it is installed and blocks are not compiled, since
  inductor then fuses these itself; the PyTorch references otherwise);
- `Llama.criterion` becomes the chunked linear + cross-entropy (`ops.linear_cross_entropy`),
  which never holds the full logits: the plain one, or under tensor parallel the
  vocabulary-parallel one, whose two per-row statistics are combined over tp.

Only the reference classes are swapped: a child another strategy already replaced is left alone
(FP8's cached SwiGLU, `precision.fp8_cache_activations`, keeps the MLPs' activation under `auto`;
rules/precision.py `fp8_swiglu_violations` refuses it beside an explicit `triton`).
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale import kernels
from ultrascale.config import ConfigError
from ultrascale.distributed import comm
from ultrascale.models import ops
from ultrascale.models.llama import (
    ATTENTION_TYPES, FeedForward, LanguageModelLoss, Llama, RMSNorm, RMSNormKernel, Rotary,
    SwiGLUActivation,
)
from ultrascale.models.moe import GroupedExperts
from ultrascale.parallel.seams import Checkpointed
from ultrascale.parallel.tensor_layers import TP, enter_tp
from ultrascale.parallel.vocab_parallel import VocabParallelLoss, VocabShard


# -- the Triton kernels (ultrascale/kernels) as the primitives' signatures -----------------------
# Imported when first called: a machine without triton imports this module (and runs the torch
# references).


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.rms_norm` as one Triton kernel each way (kernels/rms_norm.py)."""
    from ultrascale.kernels.rms_norm import rms_norm as kernel
    return kernel(x, weight, eps)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """`ops.swiglu` as one Triton kernel each way (kernels/swiglu.py), the per-row weight
    multiplied in the kernel (its gradient summed per row in fp32)."""
    from ultrascale.kernels.swiglu import swiglu as kernel
    return kernel(gate, up, weight)


def rotary_triton(x: torch.Tensor, rope: ops.Rope) -> torch.Tensor:
    """`ops.rotary` as one Triton kernel each way (kernels/rotary.py); it rotates in fp32 from the
    fp32 tables and rounds once to x's dtype."""
    from ultrascale.kernels.rotary import rotary as kernel
    return kernel(x, rope.cos, rope.sin)


class TritonRMSNormKernel(RMSNormKernel):
    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_triton(x, weight, eps)


class TritonRotary(Rotary):
    def forward(self, q: torch.Tensor, k: torch.Tensor, rope: ops.Rope
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_triton(q, rope), rotary_triton(k, rope)


class TritonSwiGLU(SwiGLUActivation):
    def forward(self, gate: torch.Tensor, up: torch.Tensor,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu_triton(gate, up, weight)


class ChunkedLoss(LanguageModelLoss):
    """The summed token cross-entropy a chunk of tokens at a time (`impl`: the row passes'
    kernels, "torch" or "triton")."""

    def __init__(self, impl: str = "torch", chunk_tokens: int | None = None):
        super().__init__()
        self.impl, self.chunk_tokens = impl, chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        return ops.linear_cross_entropy(hidden, weight, targets, impl=self.impl,
                                        chunk_tokens=self.chunk_tokens)


def _combine_over_tp(mx: torch.Tensor, sumexp: torch.Tensor, target_logit: torch.Tensor):
    """The per-row statistics of the whole vocabulary from each tp rank's slice: two all-reduces
    of [tokens] floats (the max, then the rescaled sums with the target logit), as the unchunked
    vocabulary-parallel loss does."""
    global_max = mx.clone()
    comm.all_reduce(global_max, TP, op=torch.distributed.ReduceOp.MAX, tag="tp_loss")
    sums = torch.stack([sumexp * (mx - global_max).exp(), target_logit])
    comm.all_reduce(sums, TP, tag="tp_loss")
    return global_max, sums[0], sums[1]


class ChunkedVocabParallelLoss(VocabParallelLoss):
    """The vocabulary-parallel loss a chunk of tokens at a time: each rank makes the logits of its
    vocabulary slice for one chunk, the ranks combine their row statistics, and each computes its
    slice's gradient; the partial gradients of the hidden states sum over tp on the way back
    through `enter_tp`, as in the unchunked one."""

    def __init__(self, shard: VocabShard, sequence_parallel: bool, impl: str = "torch",
                 chunk_tokens: int | None = None):
        super().__init__(shard, sequence_parallel)
        self.impl, self.chunk_tokens = impl, chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        s = self.shard
        return ops.linear_cross_entropy(
            enter_tp(hidden, self.sequence_parallel), weight, targets, impl=self.impl,
            chunk_tokens=self.chunk_tokens, columns=ops.VocabColumns(s.start, s.valid),
            reduce=_combine_over_tp)


def resolve_kernels(choice: str, device: torch.device, compiling: bool) -> str:
    """"triton" or "torch" for `training.kernels`; refuses Triton where it cannot run."""
    usable, why = kernels.triton_usable(device.type)
    if choice == "auto":
        return "triton" if usable and device.type == "cuda" and not compiling else "torch"
    if choice == "triton" and not usable:
        raise ConfigError(f"training.kernels=triton: {why}. Use training.kernels=auto or torch.")
    return choice


def apply_kernels(model: Llama, impl: str, chunked_loss: bool,
                  chunk_tokens: int | None = None) -> None:
    """Swap the reference kernel children of `model` (in place) for `impl`'s, and the loss for the
    chunked one if asked."""
    if impl == "triton":
        for module in list(model.modules()):
            if isinstance(module, RMSNorm) and type(module.kernel) is RMSNormKernel:
                module.kernel = TritonRMSNormKernel()
            elif isinstance(module, RMSNorm) and hasattr(module.kernel, "kernel"):
                # A recompute policy's kernel around the reference (recipes.py): swap inside.
                inner = module.kernel.kernel
                if isinstance(inner, Checkpointed) and type(inner.wrapped) is RMSNormKernel:
                    inner.wrapped = TritonRMSNormKernel()
            elif isinstance(module, ATTENTION_TYPES) and type(module.rotary) is Rotary:
                module.rotary = TritonRotary()
            elif isinstance(module, (FeedForward, GroupedExperts)):
                _swap_activation(module)
    if chunked_loss:
        crit = model.criterion
        if type(crit) is LanguageModelLoss:
            model.criterion = ChunkedLoss(impl, chunk_tokens)
        elif type(crit) is VocabParallelLoss:
            model.criterion = ChunkedVocabParallelLoss(crit.shard, crit.sequence_parallel, impl,
                                                       chunk_tokens)


def _swap_activation(mlp: nn.Module) -> None:
    holder, name = mlp, "act"
    while isinstance(getattr(holder, name), Checkpointed):  # selective recompute wraps it
        holder, name = getattr(holder, name), "wrapped"
    if type(getattr(holder, name)) is SwiGLUActivation:
        setattr(holder, name, TritonSwiGLU())
