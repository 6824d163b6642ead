"""Parameters held whole on this rank: the optimizer, the gradient norm, checkpoint state and the
memory report of a layout without data-parallel communication.

This is the base of the data-parallel family (`data.DataParallel` adds bucketed gradient
reduction, `zero.ShardedDataParallel` shards optimizer state and gradients, `zero3` the parameters
too); the runtime talks to whichever one `parallelize` chose, through the same methods:

    no_sync(last)          context for one micro-batch's backward
    finish()               gradients summed over their data-parallel view
    local_grad_sq_sum()    this rank's share of the squared global gradient norm
    scale_grads(coef)      clipping
    step(lr)               the optimizer step
    full_local_state()     this rank's module tensors, full size on the data-parallel dims
    held()                 what its optimizer steps, piece by piece (checkpoints save and restore
                           these and their optimizer state: checkpoint/state.py)
    optimizer_state(value), set_optimizer_state(value, state), values_loaded()
    memory_report()
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ultrascale.distributed.mesh import ParallelContext


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


class Replicated:
    """One copy of every parameter here; gradients need no data-parallel reduction."""

    zero = 0
    # Gradients live in buckets (data parallel): zero them in place after the step, not to None.
    grads_in_buckets = False

    def __init__(self, module: nn.Module, ctx: ParallelContext):
        self.module, self.ctx = module, ctx
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes = 0  # gradient bytes held at the last optimizer step (freed after)
        self._expert_grad_bytes = 0  # of which the experts' (expert parallel's own)

    # -- backward -----------------------------------------------------------------------------
    def no_sync(self, last: bool):
        return nullcontext()

    def finish(self) -> None:
        """Nothing to reduce."""

    # -- norm and step ------------------------------------------------------------------------
    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared gradients held here, each weighted by 1/(identical copies across the
        mesh), so that summing over all ranks gives the squared global norm exactly once."""
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for name, p in self.named:
            if p.grad is not None:
                total += p.grad.detach().double().pow(2).sum() / self.ctx.replicas(name)
        return total

    def scale_grads(self, coef: float) -> None:
        for _, p in self.named:
            if p.grad is not None:
                p.grad.mul_(coef)

    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float):
        params = [p for _, p in self.named]
        self.optimizer = adamw([p for p in params if p.dim() >= 2],
                               [p for p in params if p.dim() < 2], lr, betas, weight_decay)
        return self.optimizer

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._grad_bytes = nbytes(p.grad for _, p in self.named if p.grad is not None)
        self._expert_grad_bytes = nbytes(p.grad for n, p in self.named
                                         if p.grad is not None and self.is_expert(n))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.grads_in_buckets)

    def is_expert(self, name: str) -> bool:
        return self.ctx.placement(name).expert

    # -- state --------------------------------------------------------------------------------
    def full_local_state(self) -> dict[str, torch.Tensor]:
        """The module's tensors by plain-model name (full on the data-parallel dims)."""
        return {n: t.detach().clone() for n, t in self.module.state_dict().items()}

    def held(self) -> list[Held]:
        """Each parameter whole: the optimizer steps the parameters themselves (and the state's
        buffers, which no optimizer steps)."""
        return [Held(name, p, 0, p) for name, p in self.named] + buffers_held(self.module)

    def optimizer_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer's state of one held value (any keys: Adam's moments and step, ...)."""
        return self.optimizer.state.get(value, {})

    def set_optimizer_state(self, value: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.optimizer.state[value] = state

    def values_loaded(self) -> None:
        """A checkpoint has written into the held values: nothing else holds a copy here."""

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted); under
        "experts", the part of each that is expert weights (placed `expert=True`)."""
        state = self.optimizer.state if self.optimizer else {}
        experts = {id(p) for n, p in self.named if self.is_expert(n)}
        opt_state = [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
        expert_opt = [v for p, s in state.items() if id(p) in experts
                      for v in s.values() if torch.is_tensor(v)]
        return {"params_bytes": nbytes(p for _, p in self.module.named_parameters()),
                "grads_bytes": self._grad_bytes, "optimizer_bytes": nbytes(opt_state),
                "experts": {"params_bytes": nbytes(p for n, p in self.named if self.is_expert(n)),
                            "grads_bytes": self._expert_grad_bytes,
                            "optimizer_bytes": nbytes(expert_opt)}}
