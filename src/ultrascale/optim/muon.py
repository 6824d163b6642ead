"""Muon: momentum orthogonalised by Newton-Schulz, for the blocks' 2-D matrices (Keller Jordan's
Muon with Moonlight's two changes: decoupled weight decay, and the update scaled by
0.2 x sqrt(max(A, B)) so that its RMS matches AdamW's and AdamW's learning rate and weight decay
carry over). Everything else (embeddings, the head, norms, biases, routers) steps with AdamW.

    buf = mu * buf + g                      one momentum buffer per matrix (Adam holds two)
    u   = g + mu * buf                      Nesterov
    O   = NewtonSchulz5(u)                  ~ U V^T of u's SVD, on the WHOLE matrix
    w   = w * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

The momentum and the update are element-wise, so they run on whatever piece of the matrix a rank
holds (a ZeRO shard, a tensor-parallel slice); only the orthogonalisation needs the whole matrix:
the `orthogonalise` callable given to `MuonAdamW` (parallel/muon_exchange.py) gathers each matrix
on one rank, runs `newton_schulz` there and hands every rank its piece back. Stacked expert weights
[E, out, in] are E matrices, each orthogonalised on its own.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ultrascale.params import NS_STEPS

# The quintic's coefficients (Keller Jordan): they push every singular value of the normalised
# matrix into roughly [0.7, 1.2] in five steps, which works as well as exactly 1 for training.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Moonlight's RMS match: an orthogonal A x B update has RMS 1/sqrt(max(A, B)); AdamW's is ~0.2.
RMS_MATCH = 0.2
MOMENTUM = 0.95

# 2-D weights of these modules are not hidden matrices: an MoE's router (`mlp.gate`, models/moe.py)
# maps to expert scores and a shared-expert gate to one scalar per token; AdamW steps them.
_NOT_MATRICES = ("gate", "router", "shared_expert_gate")


def is_matrix(name: str, ndim: int) -> bool:
    """Whether Muon steps this parameter: a 2-D (or stacked expert) weight inside a transformer
    block (MLA's projections included) or a multi-token prediction module, not a router. The
    embedding, the head and every 1-D tensor go to AdamW."""
    parts = name.split(".")
    return ndim >= 2 and parts[0] in ("layers", "mtp") and \
        not any(p in _NOT_MATRICES for p in parts)


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The orthogonalised matrix of `g` (its last two dims; leading dims are a batch of matrices,
    each normalised and orthogonalised on its own), in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.float32)
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:  # iterate on the smaller Gram matrix
        x = x.transpose(-2, -1)
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x if wide else x.transpose(-2, -1)


def update_scale(shape) -> float:
    """Moonlight's 0.2 x sqrt(max(A, B)) for an A x B matrix (or a stack of them)."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def orthogonalised_update(full: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The scaled Muon direction of a whole matrix's Nesterov momentum."""
    return newton_schulz(full, steps).mul_(update_scale(full.shape))


class MuonAdamW:
    """Muon over the matrices' pieces this rank holds, AdamW (`adam`) over every other value.

    Shaped like a torch optimizer where the owners use one (`param_groups` to set the learning
    rate, `step`, `zero_grad`, and `state`, one dict keyed by value: Adam's moments, or Muon's
    `momentum_buffer`, which checkpoints save like any optimizer state).

    `pieces`: one entry per matrix in the same order on every rank of its groups, None where this
    rank holds no piece of it. `orthogonalise(updates)` takes this rank's Nesterov updates (the
    same positions; an empty tensor for None) and returns each piece of the scaled orthogonalised
    update (collective over the matrices' groups).

    `grad_scale` (a device tensor or None), as torch's fused optimizers take it: every gradient
    is divided by it before use (the clip and fp16's unscaling, parallel/flat.py); AdamW gets it
    for its kernel."""

    def __init__(self, pieces: list[torch.Tensor | None], adam: torch.optim.AdamW, *, lr: float,
                 weight_decay: float, momentum: float,
                 orthogonalise: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                 device: torch.device | str = "cpu"):
        self.pieces = pieces
        self.device = device  # of the empty updates of matrices this rank holds no piece of
        self.adam = adam
        self.state = adam.state  # one dict: a value is stepped by Muon or by Adam, never both
        self.muon_group = {"params": [p for p in pieces if p is not None], "lr": lr,
                           "weight_decay": weight_decay, "momentum": momentum}
        self.param_groups = adam.param_groups + [self.muon_group]
        self.orthogonalise = orthogonalise
        self.grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self) -> None:
        self.adam.grad_scale = self.grad_scale
        self.adam.step()
        group = self.muon_group
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        updates = []
        for value in self.pieces:
            if value is None or value.grad is None:
                updates.append(torch.zeros(0 if value is None else value.numel(),
                                           dtype=torch.float32,
                                           device=self.device if value is None else value.device))
                continue
            g = value.grad if self.grad_scale is None else value.grad / self.grad_scale
            state = self.state[value]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(value)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            updates.append(g.add(buf, alpha=mu).reshape(-1))
        for value, update in zip(self.pieces, self.orthogonalise(updates)):
            if value is None:
                continue
            value.mul_(1.0 - lr * wd)
            value.add_(update.view_as(value), alpha=-lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adam.zero_grad(set_to_none=set_to_none)
        for value in self.muon_group["params"]:
            if value.grad is None:
                continue
            if set_to_none:
                value.grad = None
            else:
                value.grad.zero_()
