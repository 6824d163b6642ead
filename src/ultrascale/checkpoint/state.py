"""What a rank saves of the model's state and what it reads back, whatever the layout.

The data-parallel owner says what its optimizer steps (`Runtime.held()`): whole parameters, or
under ZeRO a flat range of one (a segment of a master shard). Each such piece is placed in the
full plain-model tensor in two steps:

1. the local parameter is a box of the full tensor. Each mesh dim it is split over
   (`ctx.placement(name).sharded`) cuts one of its dims: tensor parallel records which
   (`Runtime.split_dims`); for any other (an expert slice over ep) it is the one dim where the
   local and the full shapes differ. The offset along it is the rank's coordinate times the local
   length. Rows past the full size are vocabulary padding: never saved, left as they are on load.
2. a flat range of the local parameter is cut into a few boxes (at most 2 x ndim - 1), each a
   contiguous run of the flat range, so a box's data is a plain view of the held tensor.

The value and every optimizer-state tensor of the same numel share these boxes; scalar states
(Adam's step) are one piece, written by the rank holding the tensor's first element. Of identical
copies (data-parallel replicas, tp ranks of an unsplit weight, a tied embedding on two pipeline
stages) only one rank writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ultrascale.checkpoint.index import VALUE, piece_key
from ultrascale.parallel.replicated import Held


@dataclass
class Box:
    """Part of a held piece: `shape` elements from `flat_start` of the held value, which are the
    box at `offset` of the full tensor, cut to `inside` where it runs into padding."""

    offset: tuple[int, ...]
    flat_start: int
    shape: tuple[int, ...]
    inside: tuple[int, ...]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This box of `t`, a tensor laid out as the held value (the value, an Adam moment)."""
        v = t.reshape(-1)[self.flat_start:self.flat_start + math.prod(self.shape)].view(self.shape)
        for d, (n, keep) in enumerate(zip(self.shape, self.inside)):
            if keep != n:
                v = v.narrow(d, 0, keep)
        return v


@dataclass
class Slot:
    held: Held
    boxes: list[Box] = field(default_factory=list)
    writes: bool = True  # this rank's copy is the one saved

    @property
    def holds_origin(self) -> bool:
        return any(not any(b.offset) for b in self.boxes)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int
               ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offset, shape) of boxes that tile the flat range [start, stop) of a row-major tensor of
    `shape`, in flat order; each box is contiguous in that order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, a = divmod(start, inner)
    r1, b = divmod(stop, inner)

    def within(row: int, lo: int, hi: int):
        return [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return within(r0, a, b)
    out = []
    if a:
        out += within(r0, a, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if b:
        out += within(r1, 0, b)
    return out


def _ravel(offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for o, n in zip(offset, shape):
        index = index * n + o
    return index


def local_offset(name: str, local: tuple[int, ...], full: tuple[int, ...], sharded, ctx,
                 known: dict[str, int]) -> tuple[int, ...]:
    """Where the local parameter `name` starts in the full tensor (see the module's docstring)."""
    dims = {m: known[m] for m in sharded if ctx.size(m) > 1 and m in known}
    unknown = [m for m in sharded if ctx.size(m) > 1 and m not in known]
    differ = [d for d in range(len(full)) if local[d] != full[d] and d not in dims.values()]
    if len(unknown) != len(differ) or len(unknown) > 1:
        raise ValueError(f"cannot tell which dims of {name} (local {list(local)}, full "
                         f"{list(full)}) are split over {unknown}: record it in Runtime.split_dims")
    dims.update(zip(unknown, differ))
    if len(set(dims.values())) != len(dims):
        raise ValueError(f"{name}: two mesh dims split the same dim ({dims})")
    offset = [0] * len(full)
    for m, d in dims.items():
        offset[d] = ctx.coord(m) * local[d]
    return tuple(offset)


def slots(rt, full_shapes: dict[str, list[int]]) -> list[Slot]:
    """Every piece this rank's optimizer steps, placed in the full tensors."""
    ctx = rt.ctx
    out = []
    for h in rt.held():
        if h.name not in full_shapes:
            raise ValueError(f"{h.name} is not a parameter of the plain model")
        full = tuple(full_shapes[h.name])
        local = tuple(h.param.shape)
        placement = ctx.placement(h.name)
        base = local_offset(h.name, local, full, placement.sharded, ctx, rt.split_dims(h.name))
        slot = Slot(h)
        for off, shape in flat_boxes(local, h.start, h.start + h.value.numel()):
            at = tuple(b + o for b, o in zip(base, off))
            inside = tuple(max(0, min(n, f - a)) for n, f, a in zip(shape, full, at))
            if all(inside):
                slot.boxes.append(Box(at, _ravel(off, local) - h.start, shape, inside))
        same = [d for d in ctx.views["dp_cp"] + ("tp",)
                if d not in placement.sharded and d not in h.distinct_over]
        slot.writes = rt.saves(h.name) and all(ctx.coord(d) == 0 for d in same)
        out.append(slot)
    return out


def state_to_save(rt, full_shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The pieces this rank writes, by key (views into the live tensors: copy before training
    goes on)."""
    out = {}
    owner = rt.data_parallel
    for slot in slots(rt, full_shapes):
        if not slot.writes:
            continue
        h = slot.held
        for state, t in {VALUE: h.value, **owner.optimizer_state(h.value)}.items():
            if t.dim() == 0:
                if slot.holds_origin:
                    out[piece_key(state, h.name, ())] = t.detach()
                continue
            if t.numel() != h.value.numel():
                raise ValueError(f"optimizer state {state!r} of {h.name} has {t.numel()} elements, "
                                 f"its value {h.value.numel()}: checkpoints save states shaped as "
                                 "the value, or scalars")
            for box in slot.boxes:
                out[piece_key(state, h.name, box.offset)] = box.view(t.detach())
    return out


def restore_state(rt, reader, full_shapes: dict[str, list[int]]) -> None:
    """Read into every held value and its optimizer state exactly the pieces it covers."""
    owner = rt.data_parallel
    with torch.no_grad():
        for slot in slots(rt, full_shapes):
            h = slot.held
            reader.check_shape(h.name, full_shapes[h.name])
            for box in slot.boxes:
                reader.read_into(h.name, VALUE, box.offset, box.view(h.value))
            state = {}
            for name in reader.states(h.name):
                if name == VALUE:
                    continue
                if reader.is_scalar(h.name, name):
                    state[name] = reader.scalar(h.name, name)
                    continue
                t = torch.zeros_like(h.value)
                for box in slot.boxes:
                    reader.read_into(h.name, name, box.offset, box.view(t))
                state[name] = t
            if state:
                owner.set_optimizer_state(h.value, state)
    owner.values_loaded()
