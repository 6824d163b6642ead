"""What a fake step needs of the data: the values of the small tensors that decide shapes.

Under `FakeTensorMode` no tensor has values, yet a few steps of training read some: an MoE turns
its router's choices into rows per expert (the split sizes of its all-to-all, the groups of its
grouped GEMM), a loss and a gradient norm become Python floats. `KnownValues`, a dispatch mode
entered above the fake mode, keeps real values beside fake tensors where they can be known:

- a tensor made by a factory with known contents (zeros, ones, full, arange, ...) and every output
  of an operator whose inputs are all known is known, if it is small (`LIMIT` elements): the
  operator runs a second time on the real values (also the operators whose output shape depends
  on the values, which the fake mode refuses: bincount, repeat_interleave, nonzero);
- `assume(tensor, values)` declares a fake tensor's values (the fake step's balanced routing);
- an all-to-all of a known tensor receives from every rank what this rank sends to itself (ranks
  alike: the balanced routing is the same on every rank);
- a collective's handle reports it landed once a later one is launched (`_LandedWork`);
- an operator that writes into a known tensor from unknown ones makes it unknown.

A Python number read from an unknown tensor (`.item()`, `float()`, `.tolist()`) is a stand-in:
1.0 for a float (a loss, a gradient norm: no clipping decision changes what is allocated), True
for a bool, 0 for an integer; each kind of stand-in is listed in `stand_ins`.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensor, FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ultrascale.memory.tracker import storage_key

aten = torch.ops.aten
LIMIT = 1 << 20  # elements: bigger tensors (long sequences' masks) are never run for real

_FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default,
              aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default,
              aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
              aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
              aten.lift_fresh.default, aten.lift_fresh_copy.default}
_VALUE_FREE_INPUTS = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                      aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
_METADATA = {torch.ops.prim.device.default, torch.ops.prim.layout.default}  # no tensor made
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


class HostCopies(TorchFunctionMode):
    """`.numpy()` and `.tolist()` of a fake tensor with known values give those values (host
    code reads positions so: context parallel's block plans)."""

    def __init__(self, known: "KnownValues"):
        super().__init__()
        self.known = known

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.numpy, torch.Tensor.tolist) and isinstance(args[0], FakeTensor):
            real = self.known.value(args[0])
            if real is None:
                raise UnknownData(f"{func.__name__}() of a tensor whose values the fake step "
                                  "does not know")
            with _disable_current_modes():
                return func(real.clone(), *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class UnknownData(RuntimeError):
    """An operator needs the values of a tensor that the fake step cannot know."""


class KnownValues(TorchDispatchMode):
    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self._values: dict[int, torch.Tensor] = {}  # storage key -> real flat tensor over it
        self.stand_ins: dict[str, int] = {}
        self._launched = [0]  # collectives launched so far
        self._works: list = []

    # -- the registry ---------------------------------------------------------------------------
    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real values of fake `t` (a real tensor's own), or None."""
        if not isinstance(t, FakeTensor):
            return t
        base = self._values.get(storage_key(t))
        if base is None or base.dtype != t.dtype:
            return None
        with _disable_current_modes():
            return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def assume(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """Declare fake `t`'s values (a real tensor of its shape)."""
        storage = t.untyped_storage()
        with _disable_current_modes():
            base = torch.zeros(storage.nbytes() // t.element_size(), dtype=t.dtype)
            base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(values)
        key = storage._cdata
        if key not in self._values:
            weakref.finalize(storage, self._values.pop, key, None)
        self._values[key] = base

    def _forget(self, t: torch.Tensor) -> None:
        self._values.pop(storage_key(t), None)

    # -- the operators --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return func(*args, **(kwargs or {}))
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            # Under a mode above it, the fake mode's converter keeps a weak reference to each
            # output it wraps, and `Module.to` cannot swap a weakly referenced fake parameter;
            # the memo serves conversions of real tensors, which the fake step does not repeat.
            self.fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()

    def _dispatch(self, func, args, kwargs):
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
            return self._scalar(args[0])
        if func is aten.equal.default:
            a, b = (self.value(t) for t in args[:2])
            if a is None or b is None:
                return self._stand_in("bool")
            with _disable_current_modes():
                return bool(torch.equal(a, b))
        flat, spec = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs, tensors)
        if func is aten._grouped_mm.default and args[0].dtype == torch.float32:
            # The CPU kernel takes fp32, its shape function only bf16 (CUDA's rule): ask it in
            # bf16 for an output of the same shape.
            half = [a.to(torch.bfloat16) for a in args[:2]]
            return func(*half, *args[2:], **kwargs).to(torch.float32)
        reals = [None if func in _VALUE_FREE_INPUTS else self.value(t) for t in tensors]
        runnable = (tensors or func in _FACTORIES) and not _is_random(func) and \
            (func in _VALUE_FREE_INPUTS or all(r is not None for r in reals)) and \
            sum(t.numel() for t in tensors) <= LIMIT
        if not runnable:
            return self._fake_only(func, args, kwargs, tensors)
        try:
            out = func(*args, **kwargs)
        except _DATA_DEPENDENT:
            out = None
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if out is not None and any(o.numel() > LIMIT for o in outs):
            return out  # (no in-place write into a known tensor is this big)
        real_out = self._run_real(func, flat, spec, tensors, reals)
        if out is None:  # the fake mode could not say the shape: the real run did
            out = tree_map(lambda r: self.fake_mode.from_tensor(r)
                           if isinstance(r, torch.Tensor) else r, real_out)
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real_out)[0]):
            if isinstance(o, torch.Tensor) and storage_key(o) not in self._values:
                self.assume(o, r)
        return out

    def _run_real(self, func, flat, spec, tensors, reals):
        it = iter(reals)
        with _disable_current_modes():
            # A factory's template tensor (zeros_like) gives only its shape and dtype.
            swapped = [next(it) if isinstance(a, torch.Tensor) else a
                       for a in flat]
            swapped = [torch.zeros(a.shape, dtype=a.dtype) if r is None and
                       isinstance(a, torch.Tensor) else r for a, r in zip(flat, swapped)]
            rargs, rkwargs = tree_unflatten(swapped, spec)
            return func(*rargs, **rkwargs)

    def _fake_only(self, func, args, kwargs, tensors):
        try:
            out = func(*args, **kwargs)
        except _DATA_DEPENDENT as exc:
            raise UnknownData(
                f"{func} needs the values of a tensor the fake step does not know ({exc}); "
                "memory/known_values.py lists what it knows") from None
        if func._schema.is_mutable:
            for t in _written(func, args, kwargs):
                self._forget(t)
        return out

    def _timed(self, out):
        """The collective's handle replaced by a `_LandedWork` (kept alive here: the caller gets
        the Python object back only while it lives)."""
        if not isinstance(out, tuple):
            return out
        self._launched[0] += 1
        swapped = []
        for o in out:
            if isinstance(o, torch.ScriptObject):
                work = _LandedWork(self._launched)
                self._works.append(work)
                o = work.boxed()
            swapped.append(o)
        return tuple(swapped)

    def _scalar(self, t: torch.Tensor):
        real = self.value(t)
        if real is not None:
            with _disable_current_modes():
                return real.item()
        return self._stand_in("bool" if t.dtype == torch.bool else
                              "float" if t.dtype.is_floating_point else "int")

    def _stand_in(self, kind: str):
        self.stand_ins[kind] = self.stand_ins.get(kind, 0) + 1
        return {"bool": True, "float": 1.0, "int": 0}[kind]

    def _collective(self, func, args, kwargs, tensors):
        out = self._timed(func(*args, **kwargs))
        if func is torch.ops.c10d.alltoall_base_.default:
            output, source, group = args[0], args[1], args[2]
            real = self.value(source)
            if real is not None and output.numel() == source.numel():
                group = torch.distributed.ProcessGroup.unbox(group)
                n, me = group.size(), group.rank()
                with _disable_current_modes():
                    received = real.reshape(n, -1)[me].repeat(n).reshape(output.shape)
                self.assume(output, received)
                return out
        for t in _written(func, args, kwargs):
            self._forget(t)
        return out


class _LandedWork(torch.distributed.Work):
    """A fake collective's handle that has landed once a later collective is launched: on a
    device, a bucket's reduction finishes while the next bucket's gradients are computed, and
    ZeRO frees a full gradient buffer when its reduce-scatter has landed (the fake group's own
    handles never land)."""

    def __init__(self, launched: list[int]):
        super().__init__()
        self._launched, self._seq = launched, launched[0]

    def is_completed(self) -> bool:
        return self._launched[0] > self._seq

    def wait(self, timeout=None) -> bool:
        return True


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operator writes into, by its schema."""
    out = []
    schema = func._schema
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    for arg, value in zip(schema.arguments, values):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out
