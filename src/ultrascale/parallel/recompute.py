"""Activation recomputation: trade compute for memory (`training.recompute`).

- `full`: each block keeps only its input; the whole block runs again in backward (an MoE block's
  routing and, under expert parallel, its exchanges too; its load is recorded once, not replayed).
- `selective`: the parts whose saved activations are large but cheap to recompute run again in
  backward (the attention core, whose softmax probabilities are batch x heads x seq^2, and the
  SwiGLU product, of the dense MLP and of the experts); the matmul outputs are kept, so no matmul
  is recomputed. An activation that recomputes its product itself (`precision.
  fp8_cache_activations`' SwiGLU, from gate and up in e4m3) is left as it is.
- `norms_and_mla_up` (DeepSeek-V3's): the outputs of the RMSNorms and of MLA's up-projections
  are recomputed in backward from the tensors kept anyway (recipes.py).

Built on `torch.utils.checkpoint` (non-reentrant), through the model's seams: selective swaps the
parameterless `inner` and `act` children for checkpointed ones, full rebases each block onto a
subclass whose forward is checkpointed. Parameter names and the plain model are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from contextlib import nullcontext

from ultrascale.models.llama import ATTENTION_TYPES, Block, FeedForward
from ultrascale.models.moe import GroupedExperts, MoE, replaying
from ultrascale.models.ops import Rope
from ultrascale.parallel.recipes import apply_norms_and_mla_up
from ultrascale.parallel.seams import Checkpointed, rebase


class CheckpointedBlock(Block):
    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if isinstance(self.mlp, MoE):  # the replay records no expert load a second time
            return checkpoint(super().forward, x, rope, use_reentrant=False,
                              context_fn=lambda: (nullcontext(), replaying(self)))
        return checkpoint(super().forward, x, rope, use_reentrant=False)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    if mode == "none":
        return model
    if mode == "full":  # every block, the MTP modules' too
        for _, holder, attr in model.block_slots():
            setattr(holder, attr, rebase(getattr(holder, attr), CheckpointedBlock))
        return model
    if mode == "norms_and_mla_up":
        apply_norms_and_mla_up(model)
        return model
    for module in list(model.modules()):
        if isinstance(module, ATTENTION_TYPES):
            module.inner = Checkpointed(module.inner)
        elif isinstance(module, (FeedForward, GroupedExperts)) and not getattr(
                module.act, "recomputes_product", False):
            # FP8's cached SwiGLU (precision runs first) already recomputes the product from
            # its 8-bit gate and up: a checkpoint around it would keep them in bf16 instead.
            module.act = Checkpointed(module.act)
    return model
