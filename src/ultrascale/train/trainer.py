"""The training loop of one rank. The same function runs under torchrun, srun, the local launcher
and the multi-process tests; everything layout-specific hides behind the `Runtime`.

A step queues its work and moves on: the loss and the gradient norm stay on the device, and the
host reads them (one transfer for every step since the last read) only on steps it logs,
evaluates or checkpoints, and at the end. A logged record's `step_time_s` is the wall time since
the previous read divided by the steps in between; the next step's batch is copied while a step
runs (train/feed.py)."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ultrascale.checkpoint.resume import model_shapes, plan_resume
from ultrascale.checkpoint.state import restore_state, state_to_save
from ultrascale.checkpoint.store import CheckpointMeta, CheckpointReader, CheckpointWriter
from ultrascale.config import Config, ConfigError
from ultrascale.data.dataset import TokenDataset, load_splits
from ultrascale.data.sampler import GlobalBatchSampler
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext, init_parallel
from ultrascale.memory.measure import SavedActivationMeter
from ultrascale.models.llama import Llama, build_model
from ultrascale.parallel.apply import parallelize
from ultrascale.parallel.runtime import Runtime
from ultrascale.train.feed import BatchFeed, Readings, stack_samples
from ultrascale.train.generate import generate
from ultrascale.train.metrics import MetricsWriter, peak_flops
from ultrascale.train.progress import Progress, peak_rss_bytes
from ultrascale.train.schedule import LRSchedule


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)  # fp16: the scale each step used
    skipped_steps: list[int] = field(default_factory=list)  # fp16: steps skipped for an overflow
    final_state: dict[str, torch.Tensor] | None = None
    checkpoint: Path | None = None
    sample: str | None = None
    metrics_file: Path | None = None
    resumed_from: Path | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)


class ResumeError(RuntimeError):
    pass


def _layout_of(cfg: Config) -> dict:
    return cfg.layout().as_dict()


def _batch_maker(dataset, sampler, cfg: Config, ctx: ParallelContext):
    """consumed -> this rank's token ids of the step that starts after `consumed` sequences."""
    t = cfg.training

    def make(consumed: int):
        groups = sampler.rank_micro_batches(consumed, cfg.global_batch_size, cfg.parallel.dp,
                                            ctx.coord("dp"), t.micro_batch_size)
        return stack_samples(dataset, groups)
    return make


def _eval_sequences(cfg: Config, val: TokenDataset | None) -> int:
    """Validation sequences per evaluation: training.eval_batches global batches, as many whole
    ones as the split holds."""
    if val is None:
        return 0
    g = cfg.global_batch_size
    if len(val) < g:
        raise ValueError(f"the validation split holds {len(val)} sequences of training.seq_len="
                         f"{cfg.training.seq_len}, fewer than one global batch ({g}); give more "
                         "validation data (data.val_source, a larger data.val_fraction) or a "
                         "smaller batch.")
    return min(cfg.training.eval_batches, len(val) // g) * g


def _evaluate(rt: Runtime, val: TokenDataset, sequences: int, cfg: Config,
              ctx: ParallelContext) -> float:
    """The token-weighted mean loss on the first `sequences` validation sequences, the same ones
    at every evaluation, each global batch split over the dp ranks as a training batch is."""
    g, dp, mbs = cfg.global_batch_size, cfg.parallel.dp, cfg.training.micro_batch_size
    per_rank, mine = g // dp, ctx.coord("dp")
    total = None
    for start in range(0, sequences, g):
        first = start + mine * per_rank
        micro = []
        for lo in range(first, first + per_rank, mbs):
            batch = torch.from_numpy(np.stack([val.sample(i) for i in range(lo, lo + mbs)]))
            batch = batch.to(ctx.device)
            micro.append((batch[:, :-1], batch[:, 1:]))
        loss = rt.evaluate(micro)
        total = loss if total is None else total + loss
    return rt.global_loss(total) / (sequences * cfg.training.seq_len)


def train(cfg: Config, *, return_state: bool = False, generate_sample: bool = True,
          on_step=None) -> TrainResult:
    """Run `cfg.training.steps` optimizer steps (resuming if asked). Collective: every rank calls it.

    `cfg` must be fully resolved (checkpoint.dir and metrics_file set by the launcher when wanted).
    `on_step(step)`, if given, is called after each step's work is queued (a profiler's schedule,
    a sync check).
    """
    t = cfg.training
    ctx = init_parallel(cfg, timeout_s=cfg.launch.collective_timeout_s or 600.0)
    comm.set_context(ctx)
    torch.manual_seed(t.seed)
    dataset, val, tokenizer = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    try:  # meta.json only: the launcher made the same plan and printed its line
        plan = plan_resume(cfg)
    except ConfigError as exc:
        raise ResumeError(str(exc)) from None
    # A run resumed from a checkpoint takes its weights from there, not from model.from_hf.
    pretrained = cfg.model.from_hf if plan is None else None
    rt: Runtime = parallelize(build_model(cfg.model, t.seed), ctx, cfg, pretrained=pretrained)
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay, t.optimizer,
                       momentum=t.muon_momentum, ns_steps=t.muon_ns_steps)
    run = _Run(cfg, ctx, rt, dataset, val, plan)
    with run.progress:
        for step in range(run.start_step + 1, t.steps + 1):
            run.step(step)
            if on_step is not None:
                on_step(step)
    result = run.close()

    need_full = return_state or (generate_sample and cfg.logging.sample_tokens > 0)
    full = rt.full_state_dict() if need_full else None
    if return_state:
        result.final_state = full
    if generate_sample and cfg.logging.sample_tokens > 0 and ctx.is_main:
        model = Llama(cfg.model)
        model.load_state_dict(full)
        result.sample = generate(model.to(ctx.device), tokenizer, prompt="The ",
                                 max_new_tokens=cfg.logging.sample_tokens,
                                 context=t.seq_len, seed=t.seed)
    return result


class _Run:
    """One rank's training run, step by step: what a step queues, and what a read logs."""

    def __init__(self, cfg: Config, ctx: ParallelContext, rt: Runtime, dataset, val, plan):
        t = cfg.training
        self.cfg, self.ctx, self.rt, self.val = cfg, ctx, rt, val
        self.result = TrainResult()
        self.start_step, self.consumed = 0, 0
        self.shapes = model_shapes(cfg.model)
        self.schedule = plan.schedule if plan is not None else LRSchedule.of(t)
        if plan is not None:
            with CheckpointReader(plan.path, plan.meta) as reader:
                restore_state(rt, reader, self.shapes)
                reader.restore_rng(ctx.rank)
            rt.load_checkpoint_state(plan.meta)
            self.start_step, self.consumed = plan.step, plan.consumed_samples
            self.result.resumed_from = plan.path
        self.saver = CheckpointWriter(Path(cfg.checkpoint.dir), cfg.checkpoint.keep, ctx.rank,
                                      ctx.world_size, cfg.checkpoint.async_save) \
            if cfg.checkpoint.dir else None
        self.writer = MetricsWriter(cfg.logging.metrics_file if ctx.is_main else None,
                                    Path(cfg.logging.run_dir) / "tensorboard"
                                    if ctx.is_main and cfg.logging.tensorboard else None)
        self.result.metrics_file = self.writer.path
        self.eval_sequences = _eval_sequences(cfg, val)
        self.peak = peak_flops(ctx.device, rt.precision.dtype)
        self.flops_per_token = cfg.model.flops_per_token(t.seq_len)
        self.tokens_per_step = cfg.global_batch_size * t.seq_len
        self.loss_scale = 1.0 / self.tokens_per_step  # every target is a real token (packed)
        self.feed = BatchFeed(_batch_maker(dataset, GlobalBatchSampler(len(dataset), t.seed),
                                           cfg, ctx), ctx.device)
        self.readings = Readings()
        self.progress = Progress(t.steps, self.start_step,
                                 enabled=ctx.is_main and cfg.logging.progress)
        for key, value in rt.header.items():  # what parallelize chose on this device
            self.progress.note(f"{key}: {value}")
        self.window_start = self._now()  # wall time of the last read

    def _now(self) -> float:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return time.perf_counter()

    def step(self, step: int) -> None:
        """Queue one step; read, log, evaluate and checkpoint where this step asks for it."""
        t, rt = self.cfg.training, self.rt
        comm_before = comm.stats.snapshot()
        micro = self.feed.get(self.consumed)
        meter = SavedActivationMeter(rt.module) if self.cfg.logging.measure_memory \
            else nullcontext()
        with meter:
            loss_sum = rt.forward_backward(micro, self.loss_scale)
        if step < t.steps:  # the next step's batch, copied while this one runs
            self.feed.prefetch(self.consumed + self.cfg.global_batch_size)
        rt.finish_gradients()
        grad_norm = rt.clip_grad_norm(t.grad_clip)
        lr = self.schedule.at(step)
        if not rt.optimizer_step(lr):
            self.result.skipped_steps.append(step)
        self.readings.add(step, rt.global_loss_sum(loss_sum) / self.tokens_per_step, grad_norm)
        self.consumed += self.cfg.global_batch_size
        parts = rt.metrics()  # host figures of the runtime's parts (fp16's scale, experts)
        if "loss_scale" in parts:
            self.result.loss_scales.append(parts["loss_scale"])
        self.progress.update(step)
        evaluating = self.val is not None and (step == t.steps or (
            t.eval_every and step % t.eval_every == 0))
        every = self.cfg.checkpoint.every
        saving = self.saver is not None and ((every and step % every == 0) or step == t.steps)
        logged = step % self.cfg.logging.every == 0 or step in (self.start_step + 1, t.steps)
        if logged or evaluating or saving:
            self._read(step, lr, parts, comm_before, meter, evaluating)
        if self.saver is not None:  # a save written in the background: commit it once every
            self.saver.poll()       # rank is done (a step after it began, at the earliest)
        if saving:
            meta = CheckpointMeta(step, self.consumed, self.ctx.world_size, _layout_of(self.cfg),
                                  self.cfg.model_dump(mode="json"), self.schedule.as_dict(),
                                  self.shapes, rt.checkpoint_state().get("loss_scaler"))
            self.saver.save(meta, state_to_save(rt, self.shapes))
        if logged or evaluating or saving:
            self.window_start = self._now()  # evaluation and saving are no step's time

    def _read(self, step: int, lr: float, parts: dict, comm_before, meter,
              evaluating: bool) -> None:
        """Read every step's loss and norm since the last read (the host waits here), check
        them, and log this step."""
        rows = self.readings.read()
        step_time = (time.perf_counter() - self.window_start) / len(rows)
        for s, (loss, norm) in rows:
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {s}; lower training.lr or "
                                         "enable training.grad_clip.")
            self.result.steps.append(s)
            self.result.losses.append(loss)
            self.result.grad_norms.append(norm)
        loss, grad_norm = rows[-1][1]
        tokens_per_s = self.tokens_per_step / step_time
        self.progress.update(step, loss, tokens_per_s)
        eval_loss = _evaluate(self.rt, self.val, self.eval_sequences, self.cfg, self.ctx) \
            if evaluating else None
        peak = self.peak
        record = {
            "step": step, "loss": loss,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "lr": lr,
            "tokens": self.consumed * self.cfg.training.seq_len, "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "mfu": (tokens_per_s * self.flops_per_token / (peak * self.ctx.world_size))
            if peak else None,
            "memory": {**self.rt.memory_report(),
                       "activations_peak_bytes": getattr(meter, "peak_bytes", None),
                       "rss_peak_bytes": peak_rss_bytes()},
            "comm": _comm_delta(comm_before),
        }
        if "loss_scale" in parts:  # fp16: the scale this step used, steps skipped so far
            record.update(loss_scale=parts["loss_scale"], skipped_steps=parts["skipped_steps"])
        if "moe" in parts:
            record["moe"] = parts["moe"]
        if len(self.result.steps) == len(rows):  # the run's first record: what parallelize chose
            record.update(self.rt.header)
        if evaluating:
            record["eval_loss"] = eval_loss
            record["eval_tokens"] = self.eval_sequences * self.cfg.training.seq_len
            self.result.eval_losses.append((step, eval_loss))
        self.writer.write(record)
        self.progress.log_step(record)

    def close(self) -> TrainResult:
        if self.saver is not None:
            self.result.checkpoint = self.saver.close()
        self.writer.close()
        return self.result


def _comm_delta(before) -> dict:
    """Bytes and time of each kind of communication during one step."""
    out = {}
    for key, c in comm.stats.counters.items():
        b = before.get(key)
        calls = c.calls - (b.calls if b else 0)
        if calls:
            out[f"{key[0]}/{key[1]}"] = {"calls": calls,
                                         "bytes": c.bytes - (b.bytes if b else 0),
                                         "time_s": round(c.time_s - (b.time_s if b else 0), 6)}
    return out
