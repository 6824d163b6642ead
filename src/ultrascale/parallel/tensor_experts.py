"""Tensor parallel inside a mixture of experts: each expert split over tp as a dense MLP is.

Every tp rank routes the same tokens the same way (the router and its expert bias replicated),
dispatches them (locally, or over ep among the ranks of its own tp coordinate) and runs every
expert on its 1/tp of the expert's width: gate and up projections column-split, the down
projection row-split, so that each rank's output is a partial sum. The shared experts are split
the same way and their partial output joins the routed one; one all-reduce over tp (under
sequence parallel one reduce-scatter, the tokens gathered over tp on the way in) completes both.

Gradients: the experts' slices get their own; the routing weights multiply partial outputs, so
their gradient is summed over tp (`copy_to_tp`, [tokens, k] floats), after which the router's is
the same on every rank (as is the balancing losses' part, which every rank attaches alike). The
input reaches the experts through the tp entry (its gradient summed over tp) and the router
directly: the router's part of the input gradient, the same on every rank, enters the same sum
at 1/tp of its size (`_ScaleGrad`), so the total is each path's once. Under sequence parallel
the routing, the capacity and the balancing losses all see the whole sequences, as on one
process.
"""

from __future__ import annotations

import torch

from ultrascale.models.moe import MoE, Routing
from ultrascale.parallel.tensor_layers import copy_to_tp, enter_tp, exit_tp, tp_size


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TensorParallelMoE(MoE):
    """An MoE whose experts (routed and shared) hold this rank's 1/tp of their width; `sp` is set
    by `rebase`."""

    sp: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = enter_tp(x, self.sp)  # [b, s, h], the whole sequence under sequence parallel
        sequences, seq, h = full.shape
        flat = full.reshape(-1, h)
        own = _ScaleGrad.apply(flat, 1.0 / tp_size())  # the router's path (see the docstring)
        r = self.gate(own)
        routing = Routing(r.ids, copy_to_tp(r.weights, "tp_bwd"), r.probs, r.logits)
        y = self.routed(flat, routing, sequences)  # partial over tp
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)  # partial over tp
            if self.shared_expert_gate is not None:
                shared = copy_to_tp(self.shared_expert_gate(own), "tp_bwd") * shared
            y = y + shared
        elif not self.sp:
            # The routed output is `attach_loss`'s view, which the all-reduce may not overwrite
            # in place (a custom function's view): it reduces a copy.
            y = y.clone()
        return exit_tp(y.view(sequences, seq, h), self.sp)
