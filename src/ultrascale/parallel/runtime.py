"""What the trainer drives each step: a model made parallel.

The trainer only ever talks to a `Runtime`:

    loss_sum = rt.forward_backward(micro_batches, loss_scale)   # this rank's share of the batch
    eval_sum = rt.evaluate(micro_batches)                      # forward only (validation)
    rt.finish_gradients()                                      # data-parallel reduction
    grad_norm = rt.clip_grad_norm(max_norm)                    # global norm, every rank agrees
    rt.optimizer_step(lr)                                      # False: skipped (fp16 overflow)
    full = rt.full_state_dict()                                # gathered weights, by name

The runtime is assembled by `parallelize` from three parts, each chosen once by the layout:
- `prepare(tokens, targets)`: a micro-batch as this rank sees it, positions included (context
  parallel keeps two chunks of the sequence here);
- `schedule`: how forwards and backwards run (`Sequential`, or the pipeline's schedule), which
  also adds what its stages exchange to the gradients and to the full state;
- `data_parallel`: the owner of gradients, optimizer and checkpoint state (`Replicated`, data
  parallel, ZeRO-1/2/3);
and, for a mixture of experts, `experts` (parallel/expert.py): the balancing losses' scale, the
measured expert load and the expert-bias update after each optimizer step, the experts gathered
over ep for the full state.

Loss scaling: the loss of each micro-batch is the *sum* of its token losses times `loss_scale` =
1 / (loss tokens in the global batch: the targets that count, which the data knows before the
step), so summing gradients over micro-batches and data-parallel ranks gives exactly the gradient
of the mean token loss of the global batch, whatever the layout and however unevenly its loss
tokens fall into micro-batches. Under fp16 the
runtime multiplies it by the dynamic loss scale too (parallel/precision.py), and `clip_grad_norm`
divides the gradients by it again; the norm's all-reduce over the world, which every step runs,
is where every rank learns of an overflow anywhere, and `optimizer_step` then skips the step.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.documents import Documents
from ultrascale.parallel.replicated import Held, Replicated


@dataclass
class MicroBatch:
    """What one forward consumes: token ids, their targets (IGNORE where a token is not trained
    on), their indices in the packed sequence and, with document masking, where each token's
    document begins (the whole sequences', models/documents.py)."""

    tokens: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s]
    positions: torch.Tensor  # [s]
    documents: Documents | None = None


def prepare(tokens: torch.Tensor, targets: torch.Tensor,
            documents: Documents | None = None) -> MicroBatch:
    """The whole sequence, positions 0..s-1 (the one-process view)."""
    return MicroBatch(tokens, targets, torch.arange(tokens.shape[1], device=tokens.device),
                      documents)


def autocast_on(device: torch.device, dtype: torch.dtype | None) -> Callable:
    """A factory of the forward's autocast context (a no-op without a compute dtype)."""
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class Sequential:
    """Forward then backward of each micro-batch in turn, on one whole model (no pipeline)."""

    def __init__(self, module: nn.Module, autocast: Callable):
        self.module, self.autocast = module, autocast

    def run(self, batches: list[MicroBatch], loss_scale: float,
            no_sync: Callable[[bool], object]) -> torch.Tensor:
        """Forward and backward every micro-batch; returns this rank's summed token loss."""
        total = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
        for i, mb in enumerate(batches):
            with no_sync(i == len(batches) - 1):
                with self.autocast():
                    loss = self.module(mb.tokens, mb.positions, mb.targets, mb.documents)
                (loss * loss_scale).backward()
            total += loss.detach().double()
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only (no gradient, no hook-driven reduction): the summed token loss."""
        total = torch.zeros((), dtype=torch.float64, device=batches[0].tokens.device)
        for mb in batches:
            with self.autocast():
                total += self.module(mb.tokens, mb.positions, mb.targets,
                                     mb.documents).detach().double()
        return total

    def before_reduce(self, accumulated_grad: Callable) -> None:
        """Nothing to exchange before the data-parallel reduction."""

    def gather_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def saves(self, name: str) -> bool:
        """One whole model: every parameter's only copy is here."""
        return True


class Runtime:
    def __init__(self, module: nn.Module, ctx: ParallelContext, *,
                 data_parallel: Replicated | None = None, schedule=None,
                 prepare: Callable[..., MicroBatch] = prepare,
                 tp_plan=None, autocast_dtype: torch.dtype | None = None, precision=None,
                 experts=None):
        self.module = module
        self.ctx = ctx
        self.autocast_dtype = autocast_dtype
        self.data_parallel = data_parallel or Replicated(module, ctx)
        self.schedule = schedule or Sequential(module, autocast_on(ctx.device, autocast_dtype))
        self.prepare = prepare
        self.tp_plan = tp_plan  # tensor parallel's split of each weight, to gather it back
        self.precision = precision  # parallel/precision.py `Precision` (None: fp32, no scaler)
        self.scaler = precision.scaler if precision is not None else None
        self._overflow = False  # this step's gradients overflowed (fp16): skip the update
        self.experts = experts  # parallel/expert.py's Experts, for a mixture of experts

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.data_parallel.optimizer

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def build_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float,
                        optimizer: str = "adamw", **muon):
        """`optimizer`: adamw, or muon (`muon`: momentum, ns_steps); Muon gathers each matrix
        whole, over ZeRO's shards and tensor parallel's split."""
        return self.data_parallel.build_optimizer(
            lr, betas, weight_decay, optimizer,
            split_dim=lambda name: self.split_dims(name).get("tp"), **muon)

    # -- one training step ------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[tuple], loss_scale: float) -> torch.Tensor:
        """Forward and backward every (inputs, targets) or (inputs, targets, documents)
        micro-batch; returns this rank's summed token loss. `loss_scale`: 1 / the loss tokens of
        the global batch, so that the gradients summed over ranks and micro-batches are those of
        its mean token loss."""
        batches = [self.prepare(*mb) for mb in micro_batches]
        if self.scaler is not None:
            loss_scale = loss_scale * self.scaler.scale
        if self.experts is not None:
            self.experts.begin_step(loss_scale)
        return self.schedule.run(batches, loss_scale, self.data_parallel.no_sync)

    def evaluate(self, micro_batches: list[tuple]) -> torch.Tensor:
        """This rank's summed token loss of these micro-batches (as `forward_backward` takes
        them), forward only (the validation loss); `global_loss` sums it over the ranks as it
        does a step's."""
        return self.schedule.evaluate([self.prepare(*mb) for mb in micro_batches])

    def finish_gradients(self) -> None:
        """What the stages exchange, then the sum over each gradient's data-parallel view."""
        self.schedule.before_reduce(self.data_parallel.accumulated_grad)
        self.data_parallel.finish()

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """The global gradient norm (of the unscaled gradients), clipped to `max_norm`. Under fp16
        a norm that is not finite means some rank's gradients overflowed: every rank sees it in
        the same all-reduced sum, and the step is skipped."""
        sq = self.data_parallel.local_grad_sq_sum()
        if self.ctx.world_size > 1:
            comm.all_reduce(sq, "world", tag="grad_norm")
        scale = self.scaler.scale if self.scaler is not None else 1.0
        norm = math.sqrt(float(sq)) / scale
        self._overflow = self.scaler is not None and not math.isfinite(norm)
        if self._overflow:
            return norm
        coef = 1.0 / scale  # exact for a power of two (the default scales are)
        if max_norm is not None and max_norm / (norm + 1e-6) < 1.0:
            coef *= max_norm / (norm + 1e-6)
        if coef != 1.0:
            self.data_parallel.scale_grads(coef)
        return norm

    def optimizer_step(self, lr: float) -> bool:
        """The optimizer step; False when it was skipped for an fp16 overflow (the scale is then
        halved; after enough clean steps it doubles)."""
        if self._overflow:
            self.data_parallel.skip_step()
        else:
            self.data_parallel.step(lr)
        if self.scaler is not None:
            self.scaler.update(self._overflow)
        if self.experts is not None:  # the step's expert load, and the bias it moves
            self.experts.after_step(skipped=self._overflow)
        return not self._overflow

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler is not None else 0

    def moe_metrics(self) -> dict | None:
        """The last step's expert load, balancing losses and dropped tokens (None: dense)."""
        return None if self.experts is None else self.experts.metrics()

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """The summed token loss of the whole global batch, known to every rank. Ranks that hold no
        loss (inner pipeline stages) contribute zero; tensor-parallel ranks hold the same value,
        so it is counted once per tp group."""
        total = loss_sum.detach().to(torch.float64).clone()
        if self.ctx.world_size > 1:
            comm.all_reduce(total, "world", tag="loss")
        return float(total) / self.ctx.size("tp")

    def global_loss_and_flag(self, loss_sum: torch.Tensor, flag: bool) -> tuple[float, bool]:
        """`global_loss`, and whether any rank raised `flag` (a stop signal), in the same
        all-reduce: the ranks agree on it at no extra collective."""
        total = torch.stack([loss_sum.detach().to(torch.float64).reshape(()),
                             torch.tensor(float(flag), dtype=torch.float64,
                                          device=loss_sum.device)])
        if self.ctx.world_size > 1:
            comm.all_reduce(total, "world", tag="loss")
        return float(total[0]) / self.ctx.size("tp"), bool(total[1] > 0)

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted, not
        estimated), plus the device allocator's peak where there is one."""
        report = {**self.data_parallel.memory_report(), "peak_allocated_bytes": None}
        if self.ctx.device.type == "cuda":
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return report

    # -- state ------------------------------------------------------------------------------------
    def gather_tensor_parallel(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain-model shapes from tensor-parallel shards (weights or gradients). Collective over
        tp."""
        return tensors if self.tp_plan is None else self.tp_plan.gather_full(tensors)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the whole model by its plain-model name, full size, on every rank:
        gathered over data parallel (ZeRO-3), then tensor parallel, expert parallel, then the
        pipeline stages."""
        state = self.gather_tensor_parallel(self.data_parallel.full_local_state())
        if self.experts is not None:
            state = self.experts.gather_full(state)
        return self.schedule.gather_stages(state)

    # -- what a checkpoint saves (checkpoint/state.py: layout-free, piece by piece) -------------
    def held(self) -> list[Held]:
        """What this rank's optimizer steps, piece by piece (the data-parallel owner's)."""
        return self.data_parallel.held()

    def split_dims(self, name: str) -> dict[str, int]:
        """Mesh dim -> the dim of `name` it splits, where a strategy recorded it (tensor
        parallel); checkpoints infer the others (an expert slice) from the shapes."""
        if self.tp_plan is not None and name in self.tp_plan.split:
            return {"tp": self.tp_plan.split[name][0]}
        return {}

    def saves(self, name: str) -> bool:
        """Whether this rank's copy of `name` is the one checkpoints save (of a tied embedding
        held by two pipeline stages, the first stage's)."""
        return self.schedule.saves(name)
