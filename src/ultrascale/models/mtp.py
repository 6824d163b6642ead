"""Multi-token prediction (DeepSeek-V3) in plain PyTorch: no parallel code lives here.

Depth k = 1..D predicts, at each position i, the token k + 1 places ahead, sequentially: with h^0
the main model's last hidden state (before its final norm) and Emb, Head the main model's own
embedding and output head (shared, not copied),

    h^k_i    = block_k( eh_proj [ enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i) ] )
    loss_k   = sum_i CE( Head(norm_k(h^k_i)), t_{i+k+1} )

Each depth is an `MTPLayer` (its two norms, the projection of the two, one transformer block of the
model's kind, its final norm). The positions near the end of a sequence, whose token k + 1 ahead
lies beyond it, have no target (`ops.IGNORE`: no loss, no gradient), nor those whose main target
k places ahead counts nothing (chat data's loss mask) or whose token k + 1 ahead is another
document's (packed documents: the block's attention keeps to each, as the main blocks' does).
The batch brings the targets and the input tokens of every depth (`future_targets`, made from the
whole sequence before a context-parallel split, as the tokens are).

The total the model trains on is the main loss + mtp_loss_weight / D x sum_k loss_k, in the units
of the summed token loss (each loss_k then averages over the sequence's length, as DeepSeek-V3's
L_MTP does): the runtime sets `loss_scale` each step to its loss scale x mtp_loss_weight / D.
The MTP losses reach their gradient through `attach_loss`, so a forward returns the main loss
alone: the trainer's `loss` stays comparable with a model without MTP, and the MTP
losses are recorded per depth (`loss_sums`, reset by the runtime each step) for the metrics. A
forward without gradient (validation, generation) skips the MTP modules.
"""

from __future__ import annotations

import torch
from torch import nn

from ultrascale.models import ops
from ultrascale.models.moe import attach_loss
from ultrascale.models.ops import Rope


def future_targets(tokens: torch.Tensor, targets: torch.Tensor, depth: int,
                   starts: torch.Tensor | None = None) -> torch.Tensor:
    """tokens, targets [b, s] -> [2 x depth, b, s]. Row k - 1 (k = 1..depth): depth k's targets,
    the token k + 1 ahead of each position, IGNORE where it lies beyond the sequence, where the
    main target k places ahead counts nothing (a loss mask, a document's last token) or, given
    `starts` (each token's document's first position), where another document begins on the way.
    Row depth + k - 1: depth k's input tokens, the token k ahead (from `tokens`, so a loss mask
    hides none of them; 0 beyond the sequence, where no target is left)."""
    rows, inputs = [], []
    for k in range(1, depth + 1):
        row = _ahead(targets, k, ops.IGNORE)
        if starts is not None:
            row = row.masked_fill(_ahead(starts, k, -1) != starts, ops.IGNORE)
        rows.append(row)
        inputs.append(_ahead(tokens, k, 0))
    return torch.stack(rows + inputs)


def _ahead(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x [b, s] shifted k positions to the left, `fill` where it runs past the end."""
    k = min(k, x.shape[1])
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], 1)


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a transformer block, its final norm (DeepSeek's
    shared_head.norm). `linear` and `norm` are the model's layer classes."""

    def __init__(self, hidden: int, eps: float, linear: type, norm: type, block: nn.Module):
        super().__init__()
        self.enorm = norm(hidden, eps)
        self.hnorm = norm(hidden, eps)
        self.eh_proj = linear(2 * hidden, hidden)
        self.block = block
        self.norm = norm(hidden, eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope: Rope) -> torch.Tensor:
        """The previous depth's hidden state and the embedded tokens k ahead -> this depth's."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x, rope)


class MultiTokenPrediction(nn.ModuleDict):
    """The MTP layers, keyed "0".."D-1" (parameter names mtp.<k>.*), and their losses."""

    def __init__(self, layers: list[MTPLayer]):
        super().__init__({str(k): layer for k, layer in enumerate(layers)})
        # The gradient of the summed MTP losses: the runtime's loss scale x weight / D, per step.
        self.loss_scale = 1.0
        self.reset()

    def reset(self) -> None:
        """The step's per-depth summed losses, detached, from zero."""
        self.loss_sums: list[torch.Tensor | float] = [0.0] * len(self)

    def forward(self, main_loss: torch.Tensor, h: torch.Tensor, rope: Rope,
                future: torch.Tensor, embed, loss) -> torch.Tensor:
        """`main_loss` with the MTP losses attached (see the module docstring). h: the main
        model's last hidden state; future [2D, b, s] (`future_targets`: each depth's targets,
        then its input tokens); embed(tokens) and loss(hidden, targets): the model's embedding
        and its head's summed loss."""
        total = None
        for k, layer in enumerate(self.values()):
            h = layer(h, embed(future[len(self) + k]), rope)
            term = loss(layer.norm(h), future[k])
            self.loss_sums[k] = self.loss_sums[k] + term.detach().double()
            total = term if total is None else total + term
        return attach_loss(main_loss, total, self.loss_scale)
