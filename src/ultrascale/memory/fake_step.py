"""The engine's own training step, run for one rank with no memory behind its tensors, counted.

`measure_rank(cfg, stage)` joins torch's fake process group as the first rank of pipeline stage
`stage` (coordinate 0 on every other dimension), and under `FakeTensorMode` runs what the trainer
runs: `build_model`, `parallelize`, `build_optimizer`, then two training steps (forward and
backward of every micro-batch through the layout's schedule, the gradients' reduction, clipping,
the optimizer step). The first step makes the optimizer state; the second is measured by
`memory/tracker.py`: every storage's life, the peak and its parts. Collectives move nothing (the
fake group); their buffers are allocated as in a real run.

What the data would decide is assumed (`memory/known_values.py`): each MoE router's choices are
balanced (token t's j-th choice is expert (t k + j) mod E, so every expert gets T k / E rows and
every ep rank the same), and every rank routes alike; numbers read back from tensors (the loss,
the gradient norm) are stand-ins that change no allocation.

The step runs on this machine's CPU code paths (fake CPU tensors: PyTorch builds without CUDA
cannot run autograd on fake CUDA ones); `memory/fake_device.py` says what differs on a GPU.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from ultrascale.config import Config
from ultrascale.models.llama import CausalAttention
from ultrascale.memory.known_values import HostCopies, KnownValues
from ultrascale.memory.step_meter import StepMeter
from ultrascale.memory.tracker import AllocationTracker, Peak, owned_parts, parameters_resized
from ultrascale.train.step import train_step

ASSUMPTIONS = ("balanced routing: every expert gets tokens x top_k / experts rows, on every rank",)


@dataclass
class StageMeasure:
    """One rank's measured step: the peak and its parts, where it came, what it held before."""

    stage: int
    rank: int
    peak: Peak
    steady: dict[str, int]  # parts held before the step (parameters, gradients, optimizer)
    seconds: float
    stand_ins: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"stage": self.stage, "rank": self.rank, **self.peak.as_dict(),
                "steady": dict(self.steady), "seconds": round(self.seconds, 2)}


@contextmanager
def fake_world(rank: int, world: int):
    """This process as `rank` of a `world` of ranks on torch's fake process group (collectives
    return at once and move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        if world > 1:
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _balanced_routing(known: KnownValues):
    """A forward hook for each router: its choices as `ASSUMPTIONS` says."""
    def hook(router, args, routing):
        tokens, k = routing.ids.shape
        experts = router.weight.shape[0]
        with _disable_current_modes():  # real values
            ids = (torch.arange(tokens * k) % experts).view(tokens, k)
        known.assume(routing.ids, ids)
    return hook


def micro_batches_run(cfg: Config) -> int:
    """Micro-batches the fake step runs: all of them through a pipeline (its schedule depends on
    their number); without one at most three, the first, one in the middle and the last: the
    middle ones repeat one another's allocations exactly (the first makes the gradients, the last
    reduces them), so the peak is the same."""
    m = cfg.training.grad_accum_steps
    return m if cfg.parallel.pp > 1 else min(m, 3)


def _micro_batches(cfg: Config) -> tuple[list[tuple], list[tuple]]:
    """Every micro-batch's tokens and targets (the trainer makes them all before the step), and
    those the step runs (`micro_batches_run`)."""
    t = cfg.training
    shape = (t.micro_batch_size, t.seq_len)
    every = [(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long))
             for _ in range(t.grad_accum_steps)]
    n = micro_batches_run(cfg)
    return every, every if n == len(every) else every[:n - 1] + every[-1:]


def use_gpu_kernels(module: nn.Module) -> None:
    """Every attention core makes a GPU's kernel choices (`CausalAttention.kernels`): the plain
    core and Ulysses' through `ops.attention`; ring and all-gather attention keep their CPU
    blocks (which keep the same output and log-sum-exp; a GPU's blocks hold their fp32 scores
    only while they run)."""
    for m in module.modules():
        if isinstance(m, CausalAttention):
            m.kernels = "cuda"


def _first_step(rt, cfg: Config) -> None:
    """An optimizer step on zero gradients, without forward or backward: it leaves what a
    first training step leaves (the optimizer state, the gradient buffers a data-parallel owner
    keeps), at a fraction of the cost."""
    owner = rt.data_parallel
    for name, p in owner.named:
        owner.accumulated_grad(name, p)
    rt.finish_gradients()
    rt.clip_grad_norm(cfg.training.grad_clip)
    rt.optimizer_step(cfg.training.lr)


def stage_rank(cfg: Config, stage: int) -> int:
    """The global rank at pipeline coordinate `stage` and 0 on every other dimension (pp is the
    mesh's outermost dimension)."""
    return stage * (cfg.parallel.world_size // cfg.parallel.pp)


def measure_rank(cfg: Config, stage: int = 0, kernels: str = "cpu") -> StageMeasure:
    """The measured second step of pipeline stage `stage`'s first rank (see the module).
    `kernels`: "cpu" runs this machine's code paths exactly; "cuda" makes the attention cores'
    choices a GPU makes (`use_gpu_kernels`)."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.models.moe import Router
    from ultrascale.parallel.apply import parallelize

    cfg = replace_device(cfg)
    t0 = time.perf_counter()
    if cfg.precision.dtype == "fp8" and not cfg.precision.fp8_emulate:
        # The device's FP8 probe computes on real tensors (cached per device): before the fake
        # mode, so that its answer is this CPU's.
        from ultrascale.parallel.precision import native_fp8_recipes
        native_fp8_recipes(torch.device("cpu"))
    rank = stage_rank(cfg, stage)
    fake = FakeTensorMode()
    known, tracker = KnownValues(fake), AllocationTracker()
    with fake_world(rank, cfg.parallel.world_size), HostCopies(known), fake, known, tracker:
        ctx = init_parallel(cfg)
        comm.set_context(ctx)
        torch.manual_seed(cfg.training.seed)
        rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)
        t = cfg.training
        rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay, t.optimizer,
                           momentum=t.muon_momentum, ns_steps=t.muon_ns_steps)
        if kernels == "cuda":
            use_gpu_kernels(rt.module)
        for m in rt.module.modules():
            if isinstance(m, Router):
                m.register_forward_hook(_balanced_routing(known))
        for flat in parameters_resized(rt.data_parallel):
            tracker.watch(flat)
        _first_step(rt, cfg)
        steady = _parts_alive(owned_parts(rt))
        meter = StepMeter(None, tracker)
        _, run = _micro_batches(cfg)
        outcome = train_step(rt, run, cfg.global_batch_size * t.seq_len,
                             t.grad_clip, t.lr, meter)
        rt.global_loss(outcome.loss_sum)
        meter.end()
        peak = meter.peak
    return StageMeasure(stage, rank, peak, steady, time.perf_counter() - t0,
                        dict(known.stand_ins))


def _parts_alive(owned: dict) -> dict[str, int]:
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for t, part in owned.values():
        out[part] += t.untyped_storage().nbytes()
    return out


def replace_device(cfg: Config) -> Config:
    """The config with its device the CPU (the fake tensors' device) and no compilation."""
    if cfg.device == "cpu" and not cfg.training.compile:
        return cfg
    data = cfg.model_dump(mode="json")
    data["device"] = "cpu"
    data["training"]["compile"] = False
    return Config.model_validate(data)
