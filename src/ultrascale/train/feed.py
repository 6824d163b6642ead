"""Each step's micro-batches on the device, and the device figures read back on logged steps only.

`BatchFeed`: on CUDA the batch of step k+1 is sampled into pinned host memory and copied with
`non_blocking=True` on a side stream while step k runs (the trainer asks for it once step k's
forwards and backwards are queued); step k+1's work waits for the copy on the device, never the
host. A pageable copy would make the host wait for every kernel queued before it. On a CPU the
batch is made when asked.

`Readings`: the steps' losses and gradient norms stay device tensors until a logged step reads
them all in one transfer, so that steps in between never wait for the device.
"""

from __future__ import annotations

import numpy as np
import torch


class BatchFeed:
    def __init__(self, make_batch, device: torch.device):
        """`make_batch(consumed)`: the host tensor [micro-batches, mbs, seq + 1] of token ids of the
        step that starts after `consumed` sequences (this rank's share)."""
        self.make_batch, self.device = make_batch, device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._next: tuple[int, torch.Tensor, object, torch.Tensor] | None = None

    def prefetch(self, consumed: int) -> None:
        """Start the copy of the step that starts after `consumed` sequences (CUDA only)."""
        if not self.cuda:
            return
        host = torch.from_numpy(self.make_batch(consumed)).pin_memory()
        with torch.cuda.stream(self._stream):
            dev = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._next = (consumed, dev, done, host)  # the pinned source lives until the copy is used

    def get(self, consumed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (inputs, targets) micro-batches of the step that starts after `consumed` sequences:
        the prefetched copy if it is that step's, else made now."""
        if self._next is not None and self._next[0] == consumed:
            _, batch, done, _ = self._next
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            batch.record_stream(stream)  # made on the side stream, used on this one
        else:
            batch = torch.from_numpy(self.make_batch(consumed)).to(self.device)
        self._next = None
        return [(mb[:, :-1], mb[:, 1:]) for mb in batch.unbind(0)]


def stack_samples(dataset, groups) -> np.ndarray:
    """[micro-batches, mbs, seq + 1] token ids of the sample indices in `groups`."""
    return np.stack([np.stack([dataset.sample(i) for i in idx]) for idx in groups])


class Readings:
    """Device figures of the steps since the last read, read in one transfer."""

    def __init__(self):
        self.steps: list[int] = []
        self._values: list[torch.Tensor] = []

    def add(self, step: int, *values: torch.Tensor) -> None:
        self.steps.append(step)
        self._values.append(torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]))

    def read(self) -> list[tuple[int, list[float]]]:
        """(step, its values as floats) of every step added since the last read."""
        if not self.steps:
            return []
        rows = torch.stack(self._values).tolist()  # the one wait for the device
        out = list(zip(self.steps, rows))
        self.steps, self._values = [], []
        return out
