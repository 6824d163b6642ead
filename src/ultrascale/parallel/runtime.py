"""What the trainer drives each step: a model made parallel.

The trainer only ever talks to a `Runtime`:

    loss_sum = rt.forward_backward(micro_batches, loss_scale)   # this rank's share of the batch
    eval_sum = rt.evaluate(micro_batches)                      # forward only (validation)
    rt.finish_gradients()                                      # data-parallel reduction
    grad_norm = rt.clip_grad_norm(max_norm)                    # global norm (a device tensor)
    rt.optimizer_step(lr)                                      # False: skipped (fp16 overflow)
    total = rt.global_loss_sum(loss_sum)                       # the global batch's, on the device
    full = rt.full_state_dict()                                # gathered weights, by name

Nothing of a step waits for the device: the norm, the clip coefficient and the losses stay device
tensors, which the trainer reads on the steps it logs (fp16 alone reads the norm every step, to
skip an overflowed update).

The runtime is assembled by `parallelize` from three parts every layout has, each chosen once:
- `prepare(tokens, targets)`: a micro-batch as one process sees it, positions included;
- `schedule`: how forwards and backwards run (`Sequential`, or the pipeline's schedule), which
  also adds what its stages exchange to the gradients and to the full state;
- `data_parallel`: the owner of gradients, optimizer and checkpoint state (`Replicated`, data
  parallel, ZeRO-1/2/3);
and the optional `parts` of the layout (`RuntimePart`): tensor parallel's plan (its splits
gathered back), context parallel's split of each micro-batch, fp16's loss scaler, a mixture of
experts' bookkeeping (the balancing losses' scale, the measured load and the expert-bias update
after each step, the experts gathered over ep). The runtime calls every part at the same points of
a step and never asks which parts a layout has.

Loss scaling: the loss of each micro-batch is the *sum* of its token losses times `loss_scale` =
1 / (loss tokens in the global batch: the targets that count, which the data knows before the
step), so summing gradients over micro-batches and data-parallel ranks gives exactly the gradient
of the mean token loss of the global batch, whatever the layout and however unevenly its loss
tokens fall into micro-batches. Under fp16 the scaler part multiplies it by the dynamic loss scale
too (parallel/precision.py), and `clip_grad_norm` divides the gradients by it again; the norm's
all-reduce over the world, which every step runs, is where every rank learns of an overflow
anywhere, and `optimizer_step` then skips the step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.documents import Documents
from ultrascale.models.mtp import future_targets
from ultrascale.parallel.flat import clip_coefficient
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
    future: torch.Tensor | None = None  # [2D, b, s]: multi-token prediction's targets and
    # input tokens (mtp.py)


def prepare(tokens: torch.Tensor, targets: torch.Tensor,
            documents: Documents | None = None, *, mtp_depth: int = 0) -> MicroBatch:
    """The whole sequence, positions 0..s-1 (the one-process view); with multi-token
    prediction's `mtp_depth`, the targets of every depth, made from the whole sequence before any
    part splits it (context parallel splits them as the targets)."""
    future = future_targets(tokens, targets, mtp_depth,
                            documents.starts if documents is not None else None) \
        if mtp_depth else None
    return MicroBatch(tokens, targets, torch.arange(tokens.shape[1], device=tokens.device),
                      documents, future)


class RuntimePart:
    """An optional part of the runtime, chosen by one strategy of `parallelize`. The runtime calls
    every part at the same points of a step, in the order `parallelize` gave them; each default
    does nothing."""

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """What this rank sees of a micro-batch (context parallel keeps its chunks)."""
        return batch

    def scale_loss(self, loss_scale: float) -> float:
        """Before a step's forwards: the factor every micro-batch's summed loss is multiplied by
        (fp16 multiplies it; the experts' balancing losses take it)."""
        return loss_scale

    def grad_factor(self) -> float:
        """The factor this part leaves in the gradients (fp16's loss scale): the clip divides the
        norm and the gradients by it."""
        return 1.0

    def skip_update(self, norm: torch.Tensor) -> bool:
        """Whether the step's update must be skipped, given the global gradient norm."""
        return False

    def after_step(self, skipped: bool) -> None:
        """After the optimizer step, or its skip."""

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain-model tensors from what this part split (collective over its dim)."""
        return tensors

    def split_dims(self, name: str) -> dict[str, int]:
        """Mesh dim -> the dim of `name` this part splits."""
        return {}

    def metrics(self) -> dict:
        """What the step's metrics record gets from this part."""
        return {}

    def checkpoint_state(self) -> dict:
        """What a checkpoint's meta.json keeps of this part (the same on every rank)."""
        return {}

    def load_checkpoint_state(self, meta: dict) -> None:
        """Take back what `checkpoint_state` saved (from a checkpoint's meta.json)."""


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
                    loss = self.module(mb.tokens, mb.positions, mb.targets, mb.documents,
                                       future=mb.future)
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
                 parts: list[RuntimePart] = (), precision=None,
                 autocast_dtype: torch.dtype | None = None, header: dict | None = None):
        self.module = module
        self.ctx = ctx
        self.autocast_dtype = autocast_dtype
        self.data_parallel = data_parallel or Replicated(module, ctx)
        self.schedule = schedule or Sequential(module, autocast_on(ctx.device, autocast_dtype))
        self.prepare = prepare
        self.parts = list(parts)
        self.precision = precision  # parallel/precision.py `Precision`: the run's dtypes
        self._skip = False  # this step's update is skipped (fp16 overflow)
        # What parallelize chose on this device that the launcher's header could not know (the
        # attention kernel the probe measured fastest): logged once by the trainer.
        self.header = dict(header or {})

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
    def _micro_batch(self, *micro_batch) -> MicroBatch:
        batch = self.prepare(*micro_batch)
        for part in self.parts:
            batch = part.prepare(batch)
        return batch

    def forward_backward(self, micro_batches: list[tuple], loss_scale: float) -> torch.Tensor:
        """Forward and backward every (inputs, targets) or (inputs, targets, documents)
        micro-batch; returns this rank's summed token loss. `loss_scale`: 1 / the loss tokens of
        the global batch, so that the gradients summed over ranks and micro-batches are those of
        its mean token loss."""
        batches = [self._micro_batch(*mb) for mb in micro_batches]
        for part in self.parts:
            loss_scale = part.scale_loss(loss_scale)
        return self.schedule.run(batches, loss_scale, self.data_parallel.no_sync)

    def evaluate(self, micro_batches: list[tuple]) -> torch.Tensor:
        """This rank's summed token loss of these micro-batches (as `forward_backward` takes
        them), forward only (the validation loss); `global_loss` sums it over the ranks as it
        does a step's."""
        return self.schedule.evaluate([self._micro_batch(*mb) for mb in micro_batches])

    def finish_gradients(self) -> None:
        """What the stages exchange, then the sum over each gradient's data-parallel view."""
        self.schedule.before_reduce(self.data_parallel.accumulated_grad)
        self.data_parallel.finish()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (of the unscaled gradients) as an fp64 device tensor; the
        gradients are clipped to `max_norm` on the device, nothing waits for it. Under fp16 a norm
        that is not finite means some rank's gradients overflowed: every rank sees it in the same
        all-reduced sum (and reads it: the scale is decided on the host), and the step is
        skipped."""
        sq = self.data_parallel.local_grad_sq_sum()
        if self.ctx.world_size > 1:
            comm.all_reduce(sq, "world", tag="grad_norm")
        norm, coef = clip_coefficient(sq, max_norm, self.loss_scale)
        self._skip = any(part.skip_update(norm) for part in self.parts)
        if not self._skip:
            self.data_parallel.scale_grads(coef)
        return norm

    def optimizer_step(self, lr: float) -> bool:
        """The optimizer step; False when it was skipped for an fp16 overflow (the scale is then
        halved; after enough clean steps it doubles)."""
        if self._skip:
            self.data_parallel.skip_step()
        else:
            self.data_parallel.step(lr)
        for part in self.parts:
            part.after_step(self._skip)
        return not self._skip

    @property
    def loss_scale(self) -> float:
        """The factor the gradients carry before the clip divides it out (fp16's scale, else 1)."""
        factor = 1.0
        for part in self.parts:
            factor *= part.grad_factor()
        return factor

    def metrics(self) -> dict:
        """The parts' figures of the last step (fp16's loss scale and skipped steps, an MoE's
        load under "moe")."""
        out = {}
        for part in self.parts:
            out.update(part.metrics())
        return out

    @property
    def skipped_steps(self) -> int:
        return self.metrics().get("skipped_steps", 0)

    def moe_metrics(self) -> dict | None:
        """The last step's expert load, balancing losses and dropped tokens (None: dense)."""
        return self.metrics().get("moe")

    def global_loss_sum(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The summed token loss of the whole global batch, known to every rank, as an fp64
        device tensor. Ranks that hold no loss (inner pipeline stages) contribute zero;
        tensor-parallel ranks hold the same value, so it is counted once per tp group."""
        total = loss_sum.detach().to(torch.float64).clone()
        if self.ctx.world_size > 1:
            comm.all_reduce(total, "world", tag="loss")
        return total / self.ctx.size("tp")

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """`global_loss_sum`, read on the host."""
        return float(self.global_loss_sum(loss_sum))

    def global_loss_and_flag(self, loss_sum: torch.Tensor, flag: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`global_loss_sum`, and how many ranks raised `flag` (a stop signal), in the same
        all-reduce (no extra collective), both fp64 device tensors: nothing waits for them."""
        mine = torch.zeros(2, dtype=torch.float64, device=loss_sum.device)
        mine[0] = loss_sum.detach().to(torch.float64).reshape(())
        if flag:
            mine[1] = 1.0
        if self.ctx.world_size > 1:
            comm.all_reduce(mine, "world", tag="loss")
        return mine[0] / self.ctx.size("tp"), mine[1]

    def memory_report(self) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer state (counted, not
        estimated), plus the device allocator's peak where there is one."""
        report = {**self.data_parallel.memory_report(), "peak_allocated_bytes": None}
        if self.ctx.device.type == "cuda":
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return report

    def checkpoint_state(self) -> dict:
        """What a checkpoint's meta.json keeps of the runtime's parts (fp16's loss scaler)."""
        out = {}
        for part in self.parts:
            out.update(part.checkpoint_state())
        return out

    def load_checkpoint_state(self, meta: dict) -> None:
        for part in self.parts:
            part.load_checkpoint_state(meta)

    # -- state ------------------------------------------------------------------------------------
    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain-model shapes from what the parts split (tensor parallel's shards, then expert
        parallel's experts): weights or gradients. Collective over those dims."""
        for part in self.parts:
            tensors = part.gather_full(tensors)
        return tensors

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the whole model by its plain-model name, full size, on every rank:
        gathered over data parallel (ZeRO-3), then tensor parallel, expert parallel, then the
        pipeline stages."""
        return self.schedule.gather_stages(self.gather_full(self.data_parallel.full_local_state()))

    # -- what a checkpoint saves (checkpoint/state.py: layout-free, piece by piece) -------------
    def held(self) -> list[Held]:
        """What this rank's optimizer steps, piece by piece (the data-parallel owner's)."""
        return self.data_parallel.held()

    def split_dims(self, name: str) -> dict[str, int]:
        """Mesh dim -> the dim of `name` it splits, where a strategy recorded it (tensor
        parallel); checkpoints infer the others (an expert slice) from the shapes."""
        out = {}
        for part in self.parts:
            out.update(part.split_dims(name))
        return out

    def saves(self, name: str) -> bool:
        """Whether this rank's copy of `name` is the one checkpoints save (of a tied embedding
        held by two pipeline stages, the first stage's)."""
        return self.schedule.saves(name)
