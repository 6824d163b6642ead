"""Measured memory, to hold against the estimator.

- Parameters, gradients and optimizer state: bytes of the tensors each rank holds
  (`Runtime.memory_report`).
- Activations: bytes of the tensors autograd saves for backward, tracked with
  `torch.autograd.graph.saved_tensors_hooks`. Each saved storage is counted once while it is alive
  (a tensor saved by q, k and v projections is one allocation), parameters are not activations,
  and the peak over a whole forward/backward is kept.
- On CUDA, the allocator's `max_memory_allocated` gives the true peak as well; on a CPU,
  `LiveTensorMeter` counts every tensor created in a block while it lives (the chunked loss's
  peak against the plain head's, the GPU suite's memory check when it runs on a CPU).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SavedTensor:
    """What autograd stores in place of a saved tensor; its death means the tensor was released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


# Meters inside their `with` block, innermost last (see `track_held`).
_running: list["SavedActivationMeter"] = []


def track_held(*tensors: torch.Tensor) -> list:
    """Count tensors that are kept for a backward outside autograd's saved tensors (zero-bubble's
    deferred weight gradients keep each linear's input and output gradient from the I pass to the
    W pass) in the running meter, if any. Returns handles: the meter releases the tensors when the
    caller drops them."""
    if not _running:
        return []
    return [_running[-1].track(t) for t in tensors]


class SavedActivationMeter:
    """Context manager: `with SavedActivationMeter(model) as m: loss.backward()`; then m.peak_bytes."""

    def __init__(self, model: nn.Module | None = None):
        self._model = model
        self._live: dict[int, list[int]] = {}  # storage ptr -> [refcount, bytes]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = None

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current_bytes -= entry[1]
            del self._live[ptr]

    def _param_storages(self) -> set[int]:
        # Looked up at every save, not once: ZeRO-3 gathers weights into fresh buffers before each
        # block's forward, and those are parameters, not activations.
        if self._model is None:
            return set()
        return {p.untyped_storage().data_ptr() for p in self._model.parameters()}

    def track(self, t: torch.Tensor) -> SavedTensor:
        """Count `t` as held until the returned handle is dropped (what autograd does with the
        handle of a saved tensor)."""
        return self._pack(t)

    def _pack(self, t: torch.Tensor):
        saved = SavedTensor(t)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(t, nn.Parameter) or storage.nbytes() == 0 or ptr in self._param_storages():
            return saved
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        weakref.finalize(saved, self._release, ptr)
        return saved

    @staticmethod
    def _unpack(saved: SavedTensor) -> torch.Tensor:
        return saved.tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _running.append(self)
        return self

    def __exit__(self, *exc):
        _running.remove(self)
        self._hooks.__exit__(*exc)
        return False


class LiveTensorMeter(TorchDispatchMode):
    """Context manager: the peak bytes of tensor storage alive at once, counting every tensor an
    operator creates inside the block (forward and backward) until it is freed; tensors that
    existed before the block (weights, inputs) are not counted. The CPU counterpart of
    `torch.cuda.max_memory_allocated` over the block, minus allocator rounding and caching:

        with LiveTensorMeter() as m:
            loss = head(x); loss.backward()
        m.peak_bytes
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current_bytes = 0
        self.peak_bytes = 0

    def _free(self, ptr: int) -> None:
        self.current_bytes -= self._live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size and ptr not in self._live:
                    self._live[ptr] = size
                    self.current_bytes += size
                    self.peak_bytes = max(self.peak_bytes, self.current_bytes)
                    weakref.finalize(storage, self._free, ptr)
        return out
