"""Each step's micro-batches on the device, and the device figures read back on logged steps only.

`BatchFeed`: on CUDA the tokens and targets of step k+1 are sampled into pinned host memory and
copied with `non_blocking=True` on a side stream while step k runs (the trainer asks for them
once step k's forwards and backwards are queued); step k+1's work waits for the copy on the
device, never the host. A pageable copy would make the host wait for every kernel queued before
it. Document boundaries (packed documents under `data.document_mask`) are made into `Documents`
when the step starts. On a CPU a batch is made when asked.

`Readings`: the steps' losses and gradient norms stay device tensors until a logged step reads
them all in one transfer, so that steps in between never wait for the device.

`AgreedStop`: whether the ranks end after this step (a rank was signalled: train/interrupt.py),
from the flag the loss's all-reduce carries (`Runtime.global_loss_and_flag`).
"""

from __future__ import annotations

import numpy as np
import torch

from ultrascale.models.documents import Documents


class BatchFeed:
    def __init__(self, make_batch, device: torch.device):
        """`make_batch(consumed)`: this rank's micro-batches of the step that starts after
        `consumed` sequences, each (inputs, targets, document starts or None) as host arrays."""
        self.make_batch, self.device = make_batch, device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._next: tuple | None = None

    def prefetch(self, consumed: int) -> None:
        """Start the copy of the step that starts after `consumed` sequences (CUDA only)."""
        if not self.cuda:
            return
        micro = self.make_batch(consumed)
        host = torch.from_numpy(np.stack([np.stack(mb[:2]) for mb in micro])).pin_memory()
        with torch.cuda.stream(self._stream):
            dev = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        # the pinned source lives until the copy is used
        self._next = (consumed, dev, done, host, [mb[2] for mb in micro])

    def get(self, consumed: int) -> list[tuple]:
        """The (inputs, targets, documents) micro-batches of the step that starts after
        `consumed` sequences: the prefetched copy if it is that step's, else made now."""
        if self._next is not None and self._next[0] == consumed:
            _, batch, done, _, starts = self._next
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            batch.record_stream(stream)  # made on the side stream, used on this one
        else:
            micro = self.make_batch(consumed)
            batch = torch.from_numpy(np.stack([np.stack(mb[:2]) for mb in micro])
                                     ).to(self.device)
            starts = [mb[2] for mb in micro]
        self._next = None
        return [(pair[0], pair[1], None if s is None else Documents.of(s, self.device))
                for pair, s in zip(batch.unbind(0), starts)]


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


class AgreedStop:
    """`agreed(flags, requested)`: whether every rank ends after this step. One rank decides alone,
    at once; several agree on the all-reduced flag. On CUDA they read the flag of the step
    before, from pinned memory once its copy has landed, so that the host never waits for the
    step in flight: the ranks stop one step after the signal, all after the same step. On a CPU
    (everything synchronous) they read this step's."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.cuda = world, device.type == "cuda"
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def agreed(self, flags: torch.Tensor, requested: bool) -> bool:
        if self.world == 1:
            return requested
        if not self.cuda:
            return bool(flags > 0)
        previous = self._pending
        host = torch.empty((), dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (host, done)
        if previous is None:
            return False
        previous[1].synchronize()  # the step before's flag: long landed
        return bool(previous[0] > 0)
