"""Activation recomputation: trade compute for memory (`training.recompute`).

- `full`: each block keeps only its input; the whole block runs again in backward.
- `selective`: the parts whose saved activations are large but cheap to recompute run again in
  backward (the attention core, whose softmax probabilities are batch x heads x seq^2, and the
  SwiGLU product); the matmul outputs are kept, so no matmul is recomputed.

Built on `torch.utils.checkpoint` (non-reentrant). Applied by replacing methods on module
instances, so parameter names and the plain model are unchanged.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from ultrascale.models.llama import Attention, Block, SwiGLU


def _checkpointed(fn):
    return partial(checkpoint, fn, use_reentrant=False)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    if mode == "none":
        return model
    for module in model.modules():
        if mode == "full" and isinstance(module, Block):
            module.forward = _checkpointed(module.forward)
        elif mode == "selective" and isinstance(module, Attention):
            module.core = _checkpointed(module.core)
        elif mode == "selective" and isinstance(module, SwiGLU):
            module.activation = _checkpointed(module.activation)
    return model
