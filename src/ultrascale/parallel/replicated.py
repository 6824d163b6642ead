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
    checkpoint_source_rank(), local_state(), load_local_state(tensors)
    memory_report()
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ultrascale.distributed.mesh import ParallelContext

OPTIMIZER_KEYS = ("step", "exp_avg", "exp_avg_sq")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that belong in its state (an MoE's expert bias), by name."""
    params = {n for n, _ in module.named_parameters()}
    in_state = set(module.state_dict(keep_vars=True)) - params
    return {n: b for n, b in module.named_buffers() if n in in_state}


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

    def _replica_view(self) -> str:
        """The view along which every tensor of this rank has identical copies."""
        experts = any(self.ctx.placement(n).expert for n, _ in self.named)
        return "edp_cp" if experts else "dp_cp"

    def checkpoint_source_rank(self) -> int:
        """The rank whose checkpoint file holds this rank's state: replicas all read the first
        one's, so that it is written only once."""
        return self.ctx.peers(self._replica_view())[0]

    def local_state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors this rank writes (none for a replica of another rank)."""
        if self.checkpoint_source_rank() != self.ctx.rank:
            return {}
        state = {f"model/{n}": t.detach().clone().contiguous()
                 for n, t in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.named}
        for p, s in self.optimizer.state.items():
            for key, value in s.items():
                state[f"optim/{names[id(p)]}/{key}"] = value.detach().clone().contiguous()
        return state

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        model_state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        missing, unexpected = self.module.load_state_dict(model_state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        for name, p in self.named:
            state = {}
            for key in OPTIMIZER_KEYS:
                t = tensors.get(f"optim/{name}/{key}")
                if t is not None:
                    state[key] = t.to(p.device) if key != "step" else t
            if state:
                self.optimizer.state[p] = state

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
