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
(`masters`); ZeRO keeps them as shards (zero.py `_master`).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.distributed.mesh import ParallelContext
from ultrascale.optim.muon import MOMENTUM, NS_STEPS, MuonAdamW, is_matrix
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


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], lr: float,
          betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm weights are not decayed), as Llama does."""
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]] or [{"params": [torch.zeros(0)]}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)


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
    # Gradients live in buckets (data parallel): zero them in place after the step, not to None.
    grads_in_buckets = False

    def __init__(self, module: nn.Module, ctx: ParallelContext,
                 accum_dtype: torch.dtype = torch.float32):
        self.module, self.ctx = module, ctx
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.accum_dtype = accum_dtype
        self.low_precision = any(p.dtype != torch.float32 for _, p in self.named)
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes = 0  # gradient bytes held at the last optimizer step (freed after)
        self._expert_grad_bytes = 0  # of which the experts' (expert parallel's own)
        # fp32 master weights of low-precision parameters, by name (ZeRO shards them instead).
        self.masters: dict[str, torch.Tensor] = {} if self.zero else {
            n: p.detach().float() for n, p in self.named if p.dtype != torch.float32}
        # Their gradients accumulated over the micro-batches (without buckets: data parallel
        # accumulates in its buckets).
        self._accum: dict[str, torch.Tensor] = {}
        if self.masters and not self.grads_in_buckets:
            for n, p in self.named:
                if n in self.masters:
                    p.register_post_accumulate_grad_hook(weak_hook(self._accumulate, n))

    # -- backward -----------------------------------------------------------------------------
    def no_sync(self, last: bool):
        return nullcontext()

    def _accumulate(self, name: str, p: torch.Tensor) -> None:
        """Add a low-precision parameter's fresh gradient into its accumulation buffer, and drop
        it."""
        held = self._accum.get(name)
        if held is None:
            self._accum[name] = p.grad.detach().to(self.accum_dtype, copy=True)
        else:
            held.add_(p.grad.detach())
        p.grad = None

    def accumulated_grad(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """The tensor that holds `name`'s gradient accumulated so far this step (zeros if none
        came), in the accumulation dtype: what the reduction and the optimizer will read."""
        if name in self.masters:
            if p.grad is not None:
                self._accumulate(name, p)
            if name not in self._accum:
                self._accum[name] = torch.zeros(p.shape, dtype=self.accum_dtype, device=p.device)
            return self._accum[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def finish(self) -> None:
        """Nothing to reduce: the masters take their accumulated gradients (a gradient set by
        hand, not through autograd's hooks, is taken in too)."""
        for n, p in self.named:
            if n in self.masters:
                if p.grad is not None:
                    self._accumulate(n, p)
                held = self._accum.get(n)
                self.masters[n].grad = None if held is None else held.to(torch.float32)

    # -- norm and step ------------------------------------------------------------------------
    def _grads(self):
        """(name, gradient) of every parameter that has one, where the optimizer reads it: the
        master's for a low-precision parameter."""
        for n, p in self.named:
            g = self.masters[n].grad if n in self.masters else p.grad
            if g is not None:
                yield n, g

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared gradients held here, each weighted by 1/(identical copies across the
        mesh), so that summing over all ranks gives the squared global norm exactly once."""
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for name, g in self._grads():
            total += g.detach().double().pow(2).sum() / self.ctx.replicas(name)
        return total

    def scale_grads(self, coef: float) -> None:
        for _, g in self._grads():
            g.mul_(coef)

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
                     lr, betas, weight_decay)
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
        self.optimizer.step()
        self._drop_grads()
        self._refresh_params()

    def skip_step(self) -> None:
        """No update this step (fp16 overflow): the gradients are dropped, nothing changes."""
        self._count_grads()
        self._drop_grads()

    def _count_grads(self) -> None:
        """The gradient bytes held at their peak (before a step drops them), for memory_report."""
        self._grad_bytes = nbytes(g for _, g in self._grads())
        self._expert_grad_bytes = nbytes(g for n, g in self._grads() if self.is_expert(n))

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=not self.grads_in_buckets)
        self._accum.clear()

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
        self.optimizer.state[value] = state

    def values_loaded(self) -> None:
        """A checkpoint (or a Hugging Face import) has written into the held values: the
        low-precision parameters take their masters' new values."""
        self._refresh_params()

    def _refresh_params(self) -> None:
        """The module's low-precision copies of the masters."""
        with torch.no_grad():
            for n, p in self.named:
                if n in self.masters:
                    p.copy_(self.masters[n])

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
