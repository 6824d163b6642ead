"""Which samples make global step k: decided by the seed alone, never by the layout.

The sample stream is the concatenation of epochs, each a seeded permutation of the dataset. Global
step k takes stream positions [k*G, (k+1)*G) for a global batch of G sequences. A data-parallel rank
takes its contiguous slice of those G, then splits it into micro-batches. Resuming only needs the
number of samples consumed so far, which also survives a change of layout.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class GlobalBatchSampler:
    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed

    @lru_cache(maxsize=4)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions [start, start+count)."""
        out = []
        for pos in range(start, start + count):
            epoch, within = divmod(pos, self.num_samples)
            out.append(int(self._epoch_order(epoch)[within]))
        return out

    def rank_micro_batches(self, consumed: int, global_batch: int, dp: int, dp_rank: int,
                           micro_batch_size: int) -> list[list[int]]:
        """Dataset indices of this dp rank's micro-batches for the step that starts at `consumed`."""
        per_rank = global_batch // dp
        mine = self.indices(consumed + dp_rank * per_rank, per_rank)
        return [mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
