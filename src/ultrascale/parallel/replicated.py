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
    master_weights()       the parameters at the optimizer's precision (what checkpoints hold)
    full_local_state()     this rank's module tensors, full size on the data-parallel dims
    checkpoint_source_rank(), local_state(), load_local_state(tensors)
    memory_report()

Low-precision parameters (bf16, fp16: parallel/precision.py) get fp32 master weights: the
optimizer updates the masters with the fp32 sum of the gradients, and the module's copies are
refreshed from them after each step. Here and in data parallel they are whole copies
(`masters`); ZeRO keeps them as shards (zero.py `_master`).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from ultrascale.distributed.mesh import ParallelContext

OPTIMIZER_KEYS = ("step", "exp_avg", "exp_avg_sq")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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

    def __init__(self, module: nn.Module, ctx: ParallelContext,
                 accum_dtype: torch.dtype = torch.float32):
        self.module, self.ctx = module, ctx
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.accum_dtype = accum_dtype
        self.low_precision = any(p.dtype != torch.float32 for _, p in self.named)
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes = 0  # gradient bytes held at the last optimizer step (freed after)
        # fp32 master weights of low-precision parameters, by name (ZeRO shards them instead).
        self.masters: dict[str, torch.Tensor] = {} if self.zero else {
            n: p.detach().float() for n, p in self.named if p.dtype != torch.float32}
        # Their gradients accumulated over the micro-batches (without buckets: data parallel
        # accumulates in its buckets).
        self._accum: dict[str, torch.Tensor] = {}
        if self.masters and not self.grads_in_buckets:
            for n, p in self.named:
                if n in self.masters:
                    p.register_post_accumulate_grad_hook(partial(self._accumulate, n))

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

    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float):
        params = [(p, self.masters.get(n, p)) for n, p in self.named]
        self.optimizer = adamw([t for p, t in params if p.dim() >= 2],
                               [t for p, t in params if p.dim() < 2], lr, betas, weight_decay)
        return self.optimizer

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._grad_bytes = nbytes(g for _, g in self._grads())
        self.optimizer.step()
        self._drop_grads()
        with torch.no_grad():  # the module's low-precision copies of the updated masters
            for n, p in self.named:
                if n in self.masters:
                    p.copy_(self.masters[n])

    def skip_step(self) -> None:
        """No update this step (fp16 overflow): the gradients are dropped, nothing changes."""
        self._grad_bytes = nbytes(g for _, g in self._grads())
        self._drop_grads()

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=not self.grads_in_buckets)
        self._accum.clear()

    # -- state --------------------------------------------------------------------------------
    def master_weights(self) -> dict[str, torch.Tensor]:
        """The module's tensors by plain-model name at the precision the optimizer keeps them:
        the fp32 master of a low-precision parameter, the module's own tensor otherwise. What a
        checkpoint holds as each parameter's value."""
        return {n: self.masters.get(n, t) for n, t in self.module.state_dict().items()}

    def full_local_state(self) -> dict[str, torch.Tensor]:
        """The module's tensors by plain-model name (full on the data-parallel dims), fp32 masters
        for low-precision parameters."""
        return {n: t.detach().clone() for n, t in self.master_weights().items()}

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
                 for n, t in self.master_weights().items()}
        names = {id(self.masters.get(n, p)): n for n, p in self.named}
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
        with torch.no_grad():  # the masters hold the checkpoint's fp32 values exactly
            for name, master in self.masters.items():
                master.copy_(model_state[name])
        for name, p in self.named:
            state = {}
            for key in OPTIMIZER_KEYS:
                t = tensors.get(f"optim/{name}/{key}")
                if t is not None:
                    state[key] = t.to(p.device) if key != "step" else t
            if state:
                self.optimizer.state[self.masters.get(name, p)] = state

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted)."""
        opt_state = [v for s in (self.optimizer.state.values() if self.optimizer else ())
                     for v in s.values() if torch.is_tensor(v)]
        opt_state += list(self.masters.values())  # the master copy is optimizer state too
        return {"params_bytes": nbytes(p for _, p in self.module.named_parameters()),
                "grads_bytes": self._grad_bytes, "optimizer_bytes": nbytes(opt_state)}
