"""What the trainer drives each step: a model made parallel.

The trainer only ever talks to a `Runtime`:

    loss_sum = rt.forward_backward(micro_batches, loss_scale)   # this rank's share of the batch
    rt.finish_gradients()                                      # data-parallel reduction
    grad_norm = rt.clip_grad_norm(max_norm)                    # global norm, every rank agrees
    rt.optimizer_step(lr)
    full = rt.full_state_dict()                                # gathered weights, by name

Each parallel strategy changes one of these pieces: tensor parallel swaps modules and the loss
function before the runtime is built; pipeline parallel replaces `forward_backward`; ZeRO replaces
the gradient reduction, the optimizer and the norm. This base class is plain data parallel: full
replicas, gradients all-reduced once after the last micro-batch.

Loss scaling: the loss of each micro-batch is the *sum* of its token losses times `loss_scale` =
1 / (tokens in the global batch), so summing gradients over data-parallel ranks gives exactly the
gradient of the token-weighted mean loss of the global batch, whatever the layout.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs [b, s], targets [b, s])

# Mesh dims over which a parameter is split (e.g. ("tp",) for a column-parallel weight). A parameter
# not split over a dim is a replica there, and the global gradient norm must count it only once.
SHARDED_DIMS_ATTR = "_ultrascale_sharded_dims"


def sharded_dims(p: torch.Tensor) -> tuple[str, ...]:
    return getattr(p, SHARDED_DIMS_ATTR, ())


def mark_sharded(p: torch.Tensor, *dims: str) -> None:
    setattr(p, SHARDED_DIMS_ATTR, tuple(dict.fromkeys(sharded_dims(p) + dims)))


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the tokens of a micro-batch, computed in fp32."""
    return nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                                       reduction="sum")


class Runtime:
    def __init__(self, module: nn.Module, ctx: ParallelContext,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
                 autocast_dtype: torch.dtype | None = None):
        self.module = module
        self.ctx = ctx
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes = 0  # gradient bytes held at the last optimizer step (they are freed after)
        # Data parallel / ZeRO component (parallel/data.py), driven by autograd hooks; None when
        # there is nothing to synchronise. Methods below delegate to it where it owns the work.
        self.grad_sync = None

    def _zero(self):
        """The ZeRO component when it owns optimizer, gradients and state, else None."""
        gs = self.grad_sync
        return gs if gs is not None and gs.owns_optimizer else None

    # -- parameters -------------------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float):
        """AdamW with decay on matrices only (norm weights are not decayed), as Llama does."""
        if self._zero():
            self.optimizer = self._zero().build_optimizer(lr, betas, weight_decay)
            return self.optimizer
        decay, no_decay = [], []
        for _, p in self.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)
        return self.optimizer

    # -- one training step ------------------------------------------------------------------------
    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=self.autocast_dtype)

    def no_sync(self, last: bool):
        """Context for one micro-batch's backward; data parallel with overlap defers its reduction
        to the last micro-batch. The base class reduces after backward, so nothing to do."""
        return self.grad_sync.no_sync(last) if self.grad_sync is not None else nullcontext()

    def forward_backward(self, micro_batches: list[MicroBatch], loss_scale: float) -> torch.Tensor:
        """Forward and backward every micro-batch; returns this rank's summed token loss."""
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.no_sync(last=i == len(micro_batches) - 1):
                with self.autocast():
                    loss = self.loss_fn(self.module(inputs), targets)
                (loss * loss_scale).backward()
            total += loss.detach().double()
        return total

    def finish_gradients(self) -> None:
        """Sum gradients over the data-parallel ranks (and context-parallel ones, which see other
        tokens of the same sequences)."""
        if self.grad_sync is not None:
            return self.grad_sync.finish()
        for dim in ("dp", "cp"):
            if self.ctx.size(dim) == 1:
                continue
            for _, p in self.named_parameters():
                if p.grad is not None:
                    comm.all_reduce(p.grad, dim, tag="grad")

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared gradients held here, each weighted by 1/(number of identical copies across
        the mesh), so that summing over all ranks gives the squared global norm exactly once."""
        if self._zero():
            return self._zero().local_grad_sq_sum()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for _, p in self.named_parameters():
            if p.grad is None:
                continue
            copies = 1
            for dim in ("dp", "cp", "tp"):
                if dim not in sharded_dims(p):
                    copies *= self.ctx.size(dim)
            copies *= getattr(p, "_ultrascale_pp_copies", 1)  # tied embeddings on two stages
            total += p.grad.detach().double().pow(2).sum() / copies
        return total

    def clip_grad_norm(self, max_norm: float | None) -> float:
        sq = self.local_grad_sq_sum()
        if self.ctx.world_size > 1:
            comm.all_reduce(sq, "world", tag="grad_norm")
        norm = math.sqrt(float(sq))
        if max_norm is not None:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0 and self._zero():
                self._zero().scale_grads(coef)
            elif coef < 1.0:
                for _, p in self.named_parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """The summed token loss of the whole global batch, known to every rank. Ranks that hold no
        loss (inner pipeline stages) contribute zero; tensor-parallel ranks hold the same value,
        so it is counted once per tp group."""
        total = loss_sum.detach().to(torch.float64).clone()
        if self.ctx.world_size > 1:
            comm.all_reduce(total, "world", tag="loss")
        return float(total) / self.ctx.size("tp")

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted, not
        estimated), plus the device allocator's peak where there is one."""
        if self._zero():
            report = self._zero().memory_report()
            if self.ctx.device.type == "cuda":
                report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
            return report
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        params = [p for _, p in self.module.named_parameters()]
        opt_state = [v for s in (self.optimizer.state.values() if self.optimizer else ())
                     for v in s.values() if torch.is_tensor(v)]
        report = {"params_bytes": nbytes(params),
                  "grads_bytes": self._grad_bytes,
                  "optimizer_bytes": nbytes(opt_state), "peak_allocated_bytes": None}
        if self.ctx.device.type == "cuda":
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return report

    def optimizer_step(self, lr: float) -> None:
        if self._zero():
            return self._zero().step(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._grad_bytes = sum(p.grad.numel() * p.grad.element_size()
                               for _, p in self.named_parameters() if p.grad is not None)
        self.optimizer.step()
        # Data parallel keeps .grad as views of its bucket buffers: zero them in place.
        self.optimizer.zero_grad(set_to_none=self.grad_sync is None)

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the whole model by its plain-model name, full size, on every rank."""
        if self._zero():
            return self._zero().full_state_dict()
        return {n: p.detach().clone() for n, p in self.module.state_dict().items()}

    def checkpoint_source_rank(self) -> int:
        """The rank whose checkpoint file holds this rank's model and optimizer state. Replicas
        (plain data parallel) all read the file of dp rank 0 so that it is written only once."""
        if self._zero():
            return self._zero().checkpoint_source_rank()
        if self.ctx.mesh is None:
            return 0
        coord = {d: self.ctx.coord(d) for d in ("pp", "dp", "cp", "tp")}
        coord["dp"] = 0
        return int(self.ctx.mesh.mesh[coord["pp"], coord["dp"], coord["cp"], coord["tp"]])

    def local_state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors this rank writes to its checkpoint file (empty for replicas
        whose source rank is another)."""
        if self._zero():
            return self._zero().local_state()
        if self.checkpoint_source_rank() != self.ctx.rank:
            return {}
        state = {f"model/{n}": t.detach().clone().contiguous()
                 for n, t in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.named_parameters()}
        for p, s in self.optimizer.state.items():
            for key, value in s.items():
                state[f"optim/{names[id(p)]}/{key}"] = value.detach().clone().contiguous()
        return state

    def load_local_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._zero():
            return self._zero().load_local_state(tensors)
        model_state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        missing, unexpected = self.module.load_state_dict(model_state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        for name, p in self.named_parameters():
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                t = tensors.get(f"optim/{name}/{key}")
                if t is not None:
                    state[key] = t.to(p.device) if key != "step" else t
            if state:
                self.optimizer.state[p] = state
