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
from ultrascale.memory.known_values import HostCopies, KnownValues
from ultrascale.memory.measure import SavedActivationMeter, _Saved
from ultrascale.memory.tracker import AllocationTracker, Peak, owned_parts, parameters_resized

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


class _SavedMarker(SavedActivationMeter):
    """Marks what autograd saves (and zero bubble keeps for its W passes) as activations."""

    def __init__(self, tracker: AllocationTracker):
        super().__init__(None)
        self._tracker = tracker

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, nn.Parameter) and t.untyped_storage().nbytes():
            self._tracker.mark(t, "activations")
        return _Saved(t)


def _balanced_routing(known: KnownValues):
    """A forward hook for each router: its choices as `ASSUMPTIONS` says."""
    def hook(router, args, routing):
        tokens, k = routing.ids.shape
        experts = router.weight.shape[0]
        with _disable_current_modes():  # real values
            ids = (torch.arange(tokens * k) % experts).view(tokens, k)
        known.assume(routing.ids, ids)
    return hook


def _micro_batches(cfg: Config) -> list[tuple]:
    t = cfg.training
    shape = (t.micro_batch_size, t.seq_len)
    return [(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long))
            for _ in range(t.grad_accum_steps)]


def _step(rt, cfg: Config, tracker: AllocationTracker, lr: float) -> None:
    """What the trainer's loop runs for one step (train/trainer.py), phase by phase."""
    t = cfg.training
    micro = _micro_batches(cfg)
    tokens = cfg.global_batch_size * t.seq_len
    tracker.phase = "forward/backward"
    with _SavedMarker(tracker):
        loss_sum = rt.forward_backward(micro, 1.0 / tokens)
    tracker.phase = "gradients"
    rt.finish_gradients()
    rt.clip_grad_norm(t.grad_clip)
    tracker.mark_owned(owned_parts(rt))
    tracker.phase = "optimizer step"
    rt.optimizer_step(lr)
    rt.global_loss(loss_sum)


def stage_rank(cfg: Config, stage: int) -> int:
    """The global rank at pipeline coordinate `stage` and 0 on every other dimension (pp is the
    mesh's outermost dimension)."""
    return stage * (cfg.parallel.world_size // cfg.parallel.pp)


def measure_rank(cfg: Config, stage: int = 0) -> StageMeasure:
    """The measured second step of pipeline stage `stage`'s first rank (see the module)."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.models.moe import Router
    from ultrascale.parallel.apply import parallelize

    cfg = replace_device(cfg)
    t0 = time.perf_counter()
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
        for m in rt.module.modules():
            if isinstance(m, Router):
                m.register_forward_hook(_balanced_routing(known))
        for flat in parameters_resized(rt.module, rt.data_parallel):
            tracker.watch(flat)
        _step(rt, cfg, tracker, t.lr)  # makes the optimizer state
        tracker.phase = "forward/backward"
        tracker.mark_owned(owned_parts(rt))
        steady = _parts_alive(tracker, owned_parts(rt))
        tracker.begin()
        _step(rt, cfg, tracker, t.lr)
        peak = tracker.end()
    return StageMeasure(stage, rank, peak, steady, time.perf_counter() - t0,
                        dict(known.stand_ins))


def _parts_alive(tracker: AllocationTracker, owned: dict) -> dict[str, int]:
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
