"""Vocabulary-parallel embedding and cross-entropy: each tp rank holds a contiguous slice of the
vocabulary (rows of the embedding and of the output head) and the full logits are never gathered.

The vocabulary is padded with zero rows up to a multiple of tp. Padded rows are never looked up
(tokens are below the true vocabulary size) and their logits are left out of the softmax, so the
loss and every gradient are those of the unpadded model; the padded rows stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.distributed import comm
from ultrascale.models import ops
from ultrascale.models.llama import LanguageModelLoss
from ultrascale.parallel.tensor_layers import TP, enter_tp, reduce_from_tp, reduce_scatter_seq


@dataclass(frozen=True)
class VocabShard:
    vocab_size: int  # the true vocabulary
    padded: int      # a multiple of tp
    start: int       # first row held here
    rows: int        # rows held here (padded / tp)

    @classmethod
    def of(cls, vocab_size: int, tp: int, rank: int) -> "VocabShard":
        padded = -(-vocab_size // tp) * tp
        rows = padded // tp
        return cls(vocab_size, padded, rank * rows, rows)

    @property
    def valid(self) -> int:
        """Rows of this shard that are real tokens (the rest is padding)."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    def slice_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [vocab, ...] tensor, padded with zeros."""
        pad = self.padded - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros((pad,) + tuple(full.shape[1:]))])
        return full[self.start:self.start + self.rows].clone()


class VocabParallelEmbedding(nn.Embedding):
    """Looks up the tokens of its own vocabulary slice; the partial embeddings are summed over tp
    (all-reduce), or summed and split along the sequence under sequence parallel (reduce-scatter).
    Rebased from the plain embedding (`parallel.seams.rebase`): `weight` holds this rank's rows."""

    shard: VocabShard
    sequence_parallel: bool

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = self.shard
        outside = (tokens < s.start) | (tokens >= s.start + s.rows)
        local = (tokens - s.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out) if self.sequence_parallel else reduce_from_tp(out)


class VocabParallelLoss(LanguageModelLoss):
    """The summed token loss of a head split over the vocabulary: the head's input enters the
    tensor-parallel region (gathered along the sequence under sequence parallel), each rank
    computes the logits of its vocabulary slice, and the cross-entropy is reduced over tp."""

    def __init__(self, shard: VocabShard, sequence_parallel: bool):
        super().__init__()
        self.shard, self.sequence_parallel = shard, sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(enter_tp(hidden, self.sequence_parallel), weight)
        return vocab_parallel_cross_entropy(logits, targets, self.shard)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of logits split over the vocabulary: two small all-reduces over
    tp (the max, then the sum of exponentials with the target logit), each of [tokens] floats."""

    @staticmethod
    def forward(ctx, logits, targets, shard: VocabShard):
        lf = logits.float().flatten(0, -2)[:, :shard.valid]
        t = targets.flatten()
        n = lf.shape[0]
        if shard.valid:
            local_max = lf.max(dim=-1).values
        else:
            local_max = lf.new_full((n,), float("-inf"))
        comm.all_reduce(local_max, TP, op=torch.distributed.ReduceOp.MAX, tag="tp_loss")
        exp = (lf - local_max.unsqueeze(-1)).exp_()
        mine = (t >= shard.start) & (t < shard.start + shard.valid)
        idx = (t - shard.start).masked_fill(~mine, 0)
        sums = torch.stack([exp.sum(-1),
                            lf.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)])
        comm.all_reduce(sums, TP, tag="tp_loss")
        sum_exp, target_logit = sums[0], sums[1]
        counted = t >= 0  # IGNORE targets (ops.IGNORE): no loss, no gradient
        loss = (sum_exp.log() + local_max - target_logit).masked_fill(~counted, 0.0).sum()
        # Keep the local softmax for backward (it is the size of the local logits).
        softmax = exp.div_(sum_exp.unsqueeze(-1)).masked_fill_(~counted.unsqueeze(1), 0.0)
        ctx.save_for_backward(softmax, idx, mine)
        ctx.shape, ctx.dtype, ctx.rows = logits.shape, logits.dtype, shard.rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)[mine]
        grad[rows, idx[mine]] -= 1.0
        grad.mul_(grad_loss)
        if grad.shape[1] < ctx.rows:  # padded rows get no gradient
            grad = F.pad(grad, (0, ctx.rows - grad.shape[1]))
        return grad.to(ctx.dtype).view(ctx.shape), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 shard: VocabShard) -> torch.Tensor:
    """Summed cross-entropy; every tp rank returns the same full value."""
    return _VocabParallelCrossEntropy.apply(logits, targets, shard)
