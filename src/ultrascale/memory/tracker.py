"""Every tensor storage's life through a training step: the peak of the bytes alive at once, and
what they were at that moment.

`AllocationTracker` is a dispatch mode: each storage an operator creates is counted from the
operator's return until the storage dies (a weak reference's callback), once however many views
share it. It runs on real CPU tensors (`logging.measure_memory`: the CPU counterpart of
`torch.cuda.max_memory_allocated`, without the allocator's rounding and caching) and on fake ones
(`memory/fake_step.py`: the same step with no memory behind the tensors).

The peak's parts:

- `params`, `grads`, `optimizer`: what the runtime holds, by ownership (`owned_parts`), decided at
  the checkpoints of the step where the runtime holds them (before it and before the optimizer
  step);
- `activations`: storages autograd saved for backward (and what zero bubble keeps for its W
  passes, `measure.track_held`), while they were held;
- `comm_buffers`: storages a collective or a point-to-point transfer wrote or read (gathered
  weights, received activations, all-to-all rows, reduction buckets);
- `temporaries`: everything else (an operator's output used once, a loss's logits, a recomputed
  layer before autograd saves it).

A storage takes the first of these that applies, in that order. Each one is logged with the
moment it was made and freed, so the parts are those of the storages alive at the peak, with
what was learnt of them later (a buffer found to be a gradient at the checkpoint).

ZeRO-3 resizes its flat parameters' storage in place, which no operator sees: `watch(tensor)`
makes the tracker re-read such a storage's size at every operator.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PARTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")
_METADATA = {torch.ops.prim.device.default, torch.ops.prim.layout.default}  # no tensor made
_RANK = {part: i for i, part in enumerate(PARTS)}  # a lower rank wins


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage while it lives (real or fake: fake storages have no
    data pointer)."""
    return t.untyped_storage()._cdata


@dataclass
class _Life:
    nbytes: int
    part: str
    born: int  # event counter when it was made (or found alive)
    died: float = math.inf


@dataclass
class Peak:
    """The most bytes alive at once, and their parts."""

    total: int = 0
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    phase: str = ""
    op: str = ""  # the operator whose output made the peak

    def as_dict(self) -> dict:
        return {"total": self.total, **self.parts, "phase": self.phase, "op": self.op}


class AllocationTracker(TorchDispatchMode):
    """`with tracker:` counts storages; `tracker.begin()` starts a measured span (logging what is
    alive), `tracker.phase = "..."` names what runs, `tracker.end()` returns its `Peak`."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, _Life] = {}
        self._log: list[_Life] = []
        self._watched: dict[int, weakref.ref] = {}
        self._events = 0
        self._current = 0
        self._peak = 0
        self._peak_at = 0
        self._peak_phase = ""
        self.phase = ""
        self.logging = False
        self._op = None  # the operator running now
        self._peak_op = None

    # -- what the operators make ----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _METADATA:
            return out
        self._op = func
        if self._watched:
            self._reread_watched()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.see(t)
        if func.namespace == "c10d":
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, "comm_buffers")
        return out

    def see(self, t: torch.Tensor, part: str = "temporaries") -> None:
        """Count `t`'s storage from now on, if it is not counted yet."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        size = storage.nbytes()
        life = _Life(size, part, self._tick())
        self._live[key] = life
        if self.logging:
            self._log.append(life)
        weakref.finalize(storage, self._free, key)
        self._grow(size)

    def _free(self, key: int) -> None:
        life = self._live.pop(key, None)
        self._watched.pop(key, None)
        if life is not None:
            life.died = self._tick()
            self._current -= life.nbytes

    def _tick(self) -> int:
        self._events += 1
        return self._events

    def _grow(self, size: int) -> None:
        self._current += size
        if self._current > self._peak:
            self._peak, self._peak_at, self._peak_phase = self._current, self._events, self.phase
            self._peak_op = self._op

    def watch(self, t: torch.Tensor) -> None:
        """Re-read the size of `t`'s storage at every operator (it is resized in place)."""
        self.see(t, "params")
        storage = t.untyped_storage()
        self._watched[storage._cdata] = weakref.ref(storage)
        self._reread_watched()

    def _reread_watched(self) -> None:
        for key, ref in list(self._watched.items()):
            storage, life = ref(), self._live.get(key)
            if storage is None or life is None or storage.nbytes() == life.nbytes:
                continue
            # A resize: the old size dies and the new one is born, under the same part.
            life.died = self._tick()
            self._current -= life.nbytes
            new = _Life(storage.nbytes(), life.part, self._tick())
            self._live[key] = new
            if self.logging:
                self._log.append(new)
            self._grow(new.nbytes)

    # -- what a storage is ----------------------------------------------------------------------
    def mark(self, t: torch.Tensor, part: str) -> None:
        """`t`'s storage is (also) of `part`; the part that ranks first is kept."""
        key = storage_key(t)
        life = self._live.get(key)
        if life is None:
            self.see(t, part)
        elif _RANK[part] < _RANK[life.part]:
            life.part = part

    def mark_owned(self, parts: dict[int, tuple[torch.Tensor, str]]) -> None:
        """Storages the runtime holds (`owned_parts`), by key."""
        for t, part in parts.values():
            self.mark(t, part)

    # -- the measured span ----------------------------------------------------------------------
    def begin(self) -> None:
        """From now on, the peak and its parts; what is alive now is counted as made now."""
        self._log = []
        self.logging = True
        now = self._tick()
        for life in self._live.values():
            life.born = now
            self._log.append(life)
        self._peak, self._peak_at, self._peak_phase = self._current, now, self.phase
        self._peak_op = None

    def end(self) -> Peak:
        """The span's peak; its parts are those of the storages alive at its moment."""
        parts = dict.fromkeys(PARTS, 0)
        for life in self._log:
            if life.born <= self._peak_at < life.died:
                parts[life.part] += life.nbytes
        self.logging = False
        self._log = []
        return Peak(self._peak, parts, self._peak_phase,
                    "" if self._peak_op is None else str(self._peak_op))

    @property
    def current_bytes(self) -> int:
        return self._current


def owned_parts(rt) -> dict[int, tuple[torch.Tensor, str]]:
    """Storage key -> (a tensor of it, part) for what a `Runtime` holds: its module's parameters
    and buffers, their gradients wherever the data-parallel owner keeps them (`p.grad`, the
    buckets, the masters' gradients, the fp32 accumulation buffers), the optimizer's state and
    the fp32 master weights. Gradients and optimizer state are looked for first: a master is a
    parameter's copy, not the parameter."""
    owner, found = rt.data_parallel, {}

    def add(t, part: str) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            found.setdefault(storage_key(t), (t, part))

    params = list(rt.module.parameters())
    for p in params:
        add(p.grad, "grads")
    for b in getattr(owner, "buckets", ()):
        add(b.grad, "grads")
        add(b.grad_shard, "grads")
    for t in getattr(owner, "_accum", {}).values():
        add(t, "grads")
    for held in owner.held():
        add(held.value.grad, "grads")
    optimizer = owner.optimizer
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for t in state.values():
            add(t, "optimizer")
    for t in getattr(owner, "masters", {}).values():
        add(t, "optimizer")
    for p in params:
        add(p, "params")
    for t in rt.module.buffers():
        add(t, "params")
    for held in owner.held():  # ZeRO's shards: masters under mixed precision, else the params
        add(held.value, "optimizer" if owner.low_precision else "params")
    return found


def parameters_resized(owner) -> list[torch.Tensor]:
    """The flat parameters ZeRO-3 resizes in place (`watch` them)."""
    return [b.flat_param for b in getattr(owner, "buckets", ())
            if b.flat_param is not None and owner.zero == 3]
