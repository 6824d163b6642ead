"""Parameters held whole on this rank: the optimizer, the gradient norm, checkpoint state and the
memory report of a layout without data-parallel communication.

This is the base of the data-parallel family (`data.DataParallel` adds bucketed gradient
reduction, `zero.ShardedDataParallel` shards optimizer state and gradients, `zero3` the parameters
too); the runtime talks to whichever one `parallelize` chose, through the same methods:

    no_sync(last)          context for one micro-batch's backward
    accumulated_grad(n, p) the tensor holding a parameter's gradient so far (a pipeline stage adds
                           its tied-embedding peer's share into it before the reduction)
    finish()               gradients summed over their data-parallel view
    local_grad_sq_sum()    this rank's share of the squared global gradient norm
    scale_grads(coef)      clipping (and fp16's unscaling)
    step(lr), skip_step()  the optimizer step, or none (fp16 overflow: gradients dropped)
    master_weights()       the parameters at the optimizer's precision (fp32 masters)
    full_local_state()     this rank's module tensors, full size on the data-parallel dims
    held()                 what its optimizer steps, piece by piece (checkpoints save and restore
                           these and their optimizer state: checkpoint/state.py)
    optimizer_state(value), set_optimizer_state(value, state), values_loaded()
    memory_report()

Low-precision parameters (bf16, fp16: parallel/precision.py) get fp32 master weights: the
optimizer updates the masters with the fp32 sum of the gradients, and the module's copies are
refreshed from them after each step. Here and in data parallel they are whole copies
(`masters`, views of one flat fp32 buffer); ZeRO keeps them as shards (zero.py).

The gradients, the norm, the clip, the update and the refresh follow `flat.py`: every gradient in
its slice of one flat buffer in the accumulation dtype (here one buffer for the whole module; data
parallel's buckets are slices of one), the clip coefficient a device tensor, a fused AdamW
(`training.optimizer_impl`).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.distributed.mesh import ParallelContext
from ultrascale.optim.muon import MOMENTUM, NS_STEPS, MuonAdamW, is_matrix
from ultrascale.parallel.flat import (GradSqSum, adamw, apply_coefficient, flat_copy, flat_views,
                                      refresh, same_memory, take_grad)
from ultrascale.parallel.muon_exchange import MatrixExchange, MatrixSlot


@dataclass
class Held:
    """A piece of one parameter that this rank's optimizer steps: the whole local parameter (as
    tensor or expert parallel left it), or under ZeRO a flat range of it."""

    name: str  # plain-model name
    param: torch.Tensor  # the local parameter: its shape places the piece in the full tensor
    start: int  # flat offset of the piece's first element inside the local parameter
    value: torch.Tensor  # what the optimizer updates (and a checkpoint saves): the parameter, its
    # fp32 master, or a view of a master shard; the key of its optimizer state
    distinct_over: tuple[str, ...] = ()  # atomic mesh dims whose ranks hold other pieces (ZeRO's
    # shard view); along the others every rank holds the same piece


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that belong in its state (an MoE's expert bias), by name."""
    params = {n for n, _ in module.named_parameters()}
    in_state = set(module.state_dict(keep_vars=True)) - params
    return {n: b for n, b in module.named_buffers() if n in in_state}


def buffers_held(module: nn.Module) -> list[Held]:
    """The persistent buffers (an MoE's expert bias) as held values without optimizer state, so
    that checkpoints save and restore them with the parameters."""
    return [Held(name, b, 0, b) for name, b in persistent_buffers(module).items()]


def weak_hook(method, *args):
    """A gradient hook that calls the bound `method` (with `args` first) while its owner lives.
    A parameter's gradient hooks are held from C++, where the garbage collector cannot see: a
    hook holding its owner strongly would keep the owner, its master weights and its optimizer
    state alive after training ends (a second `train()` in one process then runs out of GPU
    memory)."""
    ref = weakref.WeakMethod(method)

    def hook(*hook_args):
        bound = ref()
        if bound is not None:
            bound(*args, *hook_args)
    return hook


class Replicated:
    """One copy of every parameter here; gradients need no data-parallel reduction."""

    zero = 0

    def __init__(self, module: nn.Module, ctx: ParallelContext,
                 accum_dtype: torch.dtype = torch.float32, impl: str = "fused"):
        self.module, self.ctx = module, ctx
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.accum_dtype, self.impl = accum_dtype, impl
        self.low_precision = any(p.dtype != torch.float32 for _, p in self.named)
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes = 0  # gradient bytes held at the last optimizer step
        self._expert_grad_bytes = 0  # of which the experts' (expert parallel's own)
        self._coef: torch.Tensor | None = None  # this step's gradient multiplier (clip, unscale)
        self._norm: GradSqSum | None = None
        # fp32 master weights of low-precision parameters, by name: views of one flat fp32
        # buffer (ZeRO shards them instead).
        self.masters: dict[str, torch.Tensor] = {}
        low = [(n, p) for n, p in self.named if p.dtype != torch.float32] if not self.zero else []
        if low:
            _, views = flat_copy([p for _, p in low], torch.float32)
            self.masters = {n: v for (n, _), v in zip(low, views)}
        self._low = [(p, self.masters[n]) for n, p in low]  # (parameter, master) to refresh
        self._fresh: set[str] = set()  # names whose gradient came in this step
        self._init_grads()

    def _init_grads(self) -> None:
        """One flat buffer in the accumulation dtype holding every gradient (zeros: a parameter
        no backward reaches has a zero gradient), and a hook per parameter putting its fresh
        gradient there."""
        device = self.named[0][1].device if self.named else self.ctx.device
        flat = torch.zeros(sum(p.numel() for _, p in self.named), dtype=self.accum_dtype,
                           device=device)
        views = flat_views(flat, [p.shape for _, p in self.named])
        self._views = {n: v for (n, _), v in zip(self.named, views)}
        for n, p in self.named:
            p.register_post_accumulate_grad_hook(weak_hook(self._accumulate, n))

    # -- backward -----------------------------------------------------------------------------
    def no_sync(self, last: bool):
        return nullcontext()

    def _accumulate(self, name: str, p: torch.Tensor) -> None:
        """Take a parameter's fresh gradient into its slice of the flat buffer. A gradient in the
        buffer's dtype then stays there as `.grad` (later micro-batches accumulate in place); a
        low-precision one is dropped."""
        view = self._views[name]
        if not same_memory(p.grad, view):
            take_grad(view, p.grad, first=name not in self._fresh)
            p.grad = view if view.dtype == p.dtype else None
        self._fresh.add(name)

    def accumulated_grad(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """The tensor that holds `name`'s gradient accumulated so far this step (zeros if none
        came), in the accumulation dtype: what the reduction and the optimizer will read."""
        if p.grad is not None:
            self._accumulate(name, p)
        view = self._views[name]
        if name not in self._fresh:
            view.zero_()
            self._fresh.add(name)
        return view

    def finish(self) -> None:
        """Nothing to reduce: each value the optimizer steps reads its gradient's slice (a
        gradient set by hand, not through autograd's hooks, is taken in too)."""
        for n, p in self.named:
            self._link(n, p, self.accumulated_grad(n, p))

    def _link(self, name: str, p: nn.Parameter, view: torch.Tensor) -> None:
        """The optimizer reads the summed gradient where it steps: the fp32 master of a
        low-precision parameter, else the parameter (a cast copy where the accumulation dtype
        differs from theirs)."""
        holder = self.masters.get(name, p)
        if holder.grad is not None and same_memory(holder.grad, view):
            return
        holder.grad = view if view.dtype == holder.dtype else view.to(holder.dtype)

    # -- norm and step ------------------------------------------------------------------------
    def _grads(self):
        """(name, gradient) of every parameter that has one, where the optimizer reads it: the
        master's for a low-precision parameter."""
        for n, p in self.named:
            g = self.masters[n].grad if n in self.masters else p.grad
            if g is not None:
                yield n, g

    def _norm_terms(self) -> list[tuple[torch.Tensor, int]]:
        """(gradient, identical copies of it across the mesh) of what the norm sums."""
        return [(g, self.ctx.replicas(n)) for n, g in self._grads()]

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared gradients held here, each weighted by 1/(identical copies across the
        mesh), so that summing over all ranks gives the squared global norm exactly once (an
        fp64 device tensor: nothing waits for it)."""
        terms = self._norm_terms()
        if self._norm is None or len(self._norm.copies) != len(terms):
            self._norm = GradSqSum([c for _, c in terms], self.impl, self.ctx.device)
        return self._norm([g for g, _ in terms])

    def scale_grads(self, coef: torch.Tensor | None) -> None:
        """The gradients times `coef` (a device tensor: clipping and fp16's unscaling) for the
        coming step: the fused AdamW applies it inside its kernel, per_tensor multiplies now."""
        self._coef = coef
    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float,
                        optimizer: str = "adamw", momentum: float = MOMENTUM,
                        ns_steps: int = NS_STEPS, split_dim=lambda name: None):
        """AdamW over every value this rank steps; or (optimizer="muon") Muon over the blocks'
        matrices and AdamW over the rest. `split_dim(name)`: the dim tensor parallel splits
        (Muon gathers the whole matrix), None where it is whole."""
        stepped = self._stepped()
        slots = self._matrix_slots(stepped, split_dim) if optimizer == "muon" else []
        in_muon = {id(s.value) for s in slots if s.value is not None}
        rest = [(p, v) for _, p, v in stepped if id(v) not in in_muon]
        adam = adamw([v for p, v in rest if p.dim() >= 2], [v for p, v in rest if p.dim() < 2],
                     lr, betas, weight_decay, self.impl)
        self.optimizer = adam
        if optimizer == "muon":
            self.optimizer = MuonAdamW([s.value for s in slots], adam, lr=lr,
                                       weight_decay=weight_decay, momentum=momentum,
                                       orthogonalise=MatrixExchange(self.ctx, slots, ns_steps),
                                       device=self.ctx.device)
        return self.optimizer

    def _stepped(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, value the optimizer steps) of every piece held here."""
        return [(n, p, self.masters.get(n, p)) for n, p in self.named]

    def _matrix_slots(self, stepped, split_dim) -> list[MatrixSlot]:
        """Muon's matrices, whole on this rank (but for tensor parallel's split) and on every rank
        of their gradient's data-parallel view, over which they are dealt."""
        slots = []
        for n, p, v in stepped:
            if is_matrix(n, p.dim()):
                view = self.ctx.grad_dim(n)
                slots.append(MatrixSlot(n, p.shape, v, split_dim=split_dim(n),
                                        replicated_over=view if self.ctx.size(view) > 1
                                        else None))
        return slots

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._count_grads()
        apply_coefficient(self.optimizer, [g for _, g in self._grads()], self._coef, self.impl)
        self.optimizer.step()
        self._drop_grads()
        self._after_update()

    def skip_step(self) -> None:
        """No update this step (fp16 overflow): the gradients are dropped, nothing changes."""
        self._count_grads()
        self._drop_grads()

    def _count_grads(self) -> None:
        """The gradient bytes held at their peak (before a step drops them), for memory_report."""
        self._grad_bytes = nbytes(g for _, g in self._grads())
        self._expert_grad_bytes = nbytes(g for n, g in self._grads() if self.is_expert(n))

    def _drop_grads(self) -> None:
        """The step's gradients are spent: the next step's first micro-batch overwrites each slice
        (an fp32 parameter's `.grad` is let go, so that autograd hands its first gradient over
        without a copy before the hook moves it in)."""
        self._coef = None
        self.optimizer.grad_scale = None
        self._fresh.clear()
        for _, p in self.named:
            p.grad = None

    def _after_update(self) -> None:
        """The module's low-precision copies follow the masters."""
        self._refresh_params()

    def is_expert(self, name: str) -> bool:
        return self.ctx.placement(name).expert

    # -- state --------------------------------------------------------------------------------
    def master_weights(self) -> dict[str, torch.Tensor]:
        """The module's tensors by plain-model name at the precision the optimizer keeps them:
        the fp32 master of a low-precision parameter, the module's own tensor otherwise (as
        `held` gives checkpoints their values)."""
        return {n: self.masters.get(n, t) for n, t in self.module.state_dict().items()}

    def full_local_state(self) -> dict[str, torch.Tensor]:
        """The module's tensors by plain-model name (full on the data-parallel dims), fp32 masters
        for low-precision parameters."""
        return {n: t.detach().clone() for n, t in self.master_weights().items()}

    def held(self) -> list[Held]:
        """Each parameter whole: what the optimizer steps is the parameter itself, or its fp32
        master for a low-precision one (and the state's buffers, which no optimizer steps)."""
        return [Held(name, p, 0, self.masters.get(name, p)) for name, p in self.named] \
            + buffers_held(self.module)

    def optimizer_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer's state of one held value (any keys: Adam's moments and step, ...)."""
        return self.optimizer.state.get(value, {})

    def set_optimizer_state(self, value: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Restored state lives on the value's device (a fused AdamW keeps its step counts
        there)."""
        self.optimizer.state[value] = {k: v.to(value.device) if torch.is_tensor(v) else v
                                       for k, v in state.items()}

    def values_loaded(self) -> None:
        """A checkpoint (or a Hugging Face import) has written into the held values: the
        low-precision parameters take their masters' new values."""
        self._refresh_params()

    def _refresh_params(self) -> None:
        """The module's low-precision copies of the masters, in one multi-tensor copy."""
        refresh([p for p, _ in self._low], [m for _, m in self._low])

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted; a master
        copy is optimizer state too); under "experts", the part of each that is expert weights
        (placed `expert=True`)."""
        state = self.optimizer.state if self.optimizer else {}
        experts = {id(self.masters.get(n, p)) for n, p in self.named if self.is_expert(n)}
        opt_state = [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
        opt_state += list(self.masters.values())
        expert_opt = [v for p, s in state.items() if id(p) in experts
                      for v in s.values() if torch.is_tensor(v)]
        expert_opt += [m for n, m in self.masters.items() if self.is_expert(n)]
        return {"params_bytes": nbytes(p for _, p in self.module.named_parameters()),
                "grads_bytes": self._grad_bytes, "optimizer_bytes": nbytes(opt_state),
                "experts": {"params_bytes": nbytes(p for n, p in self.named if self.is_expert(n)),
                            "grads_bytes": self._expert_grad_bytes,
                            "optimizer_bytes": nbytes(expert_opt)}}
