"""The training loop of one rank. The same function runs under torchrun, srun, the local launcher
and the multi-process tests; everything layout-specific hides behind the `Runtime`.

A step queues its work and moves on: the loss and the gradient norm stay on the device, and the
host reads them (one transfer for every step since the last read) only on steps it logs,
evaluates or checkpoints, and at the end. A logged record's `step_time_s` is the wall time since
the previous read divided by the steps in between; the next step's batch is copied while a step
runs, and the ranks agree to stop after a signal without waiting for the device
(train/feed.py)."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ultrascale import run_folder
from ultrascale.checkpoint.index import CheckpointError
from ultrascale.checkpoint.agree import agreed_plan
from ultrascale.checkpoint.resume import model_shapes
from ultrascale.checkpoint.state import restore_state, state_to_save
from ultrascale.checkpoint.store import CheckpointMeta, CheckpointReader, CheckpointWriter
from ultrascale.config import Config, ConfigError
from ultrascale.data.dataset import TokenDataset, load_splits
from ultrascale.data.sampler import GlobalBatchSampler
from ultrascale.data.windows import micro_batch
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext, init_parallel
from ultrascale.elastic import FaultDrill
from ultrascale.memory.step_meter import StepMeter, step_tracker
from ultrascale.models.documents import Documents
from ultrascale.models.llama import Llama, build_model
from ultrascale.parallel.apply import parallelize
from ultrascale.parallel.runtime import Runtime
from ultrascale.train.feed import AgreedStop, BatchFeed, Readings
from ultrascale.train.generate import generate
from ultrascale.train.interrupt import StopRequest
from ultrascale.train.metrics import MetricsWriter, WandbRun, peak_flops
from ultrascale.train.oom import OutOfMemoryWatch
from ultrascale.train.progress import Progress, peak_rss_bytes
from ultrascale.train.save_timer import SaveTimer
from ultrascale.train.schedule import LRSchedule
from ultrascale.train.step import train_step


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)  # multi-token prediction's, per step
    loss_scales: list[float] = field(default_factory=list)  # fp16: the scale each step used
    skipped_steps: list[int] = field(default_factory=list)  # fp16: steps skipped for an overflow
    final_state: dict[str, torch.Tensor] | None = None
    checkpoint: Path | None = None
    sample: str | None = None
    metrics_file: Path | None = None
    resumed_from: Path | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    interrupted: int | None = None  # the signal that stopped the run at a step boundary


class ResumeError(RuntimeError):
    pass


def _layout_of(cfg: Config) -> dict:
    return cfg.layout().as_dict()


def _micro_batch(dataset, indices, device: torch.device) -> tuple:
    """(inputs, targets, documents or None) of these samples on the device: targets IGNORE where
    they do not count, documents where a sample packs several (data/dataset.py)."""
    inputs, targets, starts = micro_batch([dataset.window(i) for i in indices])
    documents = None if starts is None else Documents.of(starts, device)
    return torch.from_numpy(inputs).to(device), torch.from_numpy(targets).to(device), documents


def _batch_maker(dataset, sampler, cfg: Config, ctx: ParallelContext):
    """consumed -> this rank's micro-batches of the step that starts after `consumed` sequences,
    each (inputs, targets, document starts or None) as host arrays."""
    t = cfg.training

    def make(consumed: int) -> list[tuple]:
        groups = sampler.rank_micro_batches(consumed, cfg.global_batch_size, cfg.parallel.dp,
                                            ctx.coord("dp"), t.micro_batch_size)
        return [micro_batch([dataset.window(i) for i in idx]) for idx in groups]
    return make


def _loss_tokens(dataset, indices: list[int]) -> int:
    """The targets that count in these samples (the data knows them: every rank agrees without
    communicating); the loss is their mean."""
    count = dataset.loss_tokens(indices)
    if count < 1:
        raise ValueError("no target of a global batch counts (all of them prompt or padding); "
                         "check the data and data.loss_on.")
    return count


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
        micro = [_micro_batch(val, range(lo, lo + mbs), ctx.device)
                 for lo in range(first, first + per_rank, mbs)]
        loss = rt.evaluate(micro)
        total = loss if total is None else total + loss
    return rt.global_loss(total) / _loss_tokens(val, list(range(sequences)))


def _watch_faults(cfg: Config, ctx: ParallelContext,
                  oom_watch: OutOfMemoryWatch | None) -> FaultDrill | None:
    """Keep this rank's last collectives (to explain a hang) and its allocations (to explain
    running out of GPU memory); the fault drill asked for, if any (elastic.py)."""
    if cfg.logging.run_dir and ctx.world_size > 1:
        comm.record_collectives(Path(cfg.logging.run_dir) / "rank_logs", ctx.rank)
    if oom_watch is not None:
        oom_watch.start(ctx.device)
    return FaultDrill.from_env()


def train(cfg: Config, *, return_state: bool = False, generate_sample: bool = True,
          oom_watch: OutOfMemoryWatch | None = None, on_step=None) -> TrainResult:
    """Run `cfg.training.steps` optimizer steps (resuming if asked). Collective: every rank calls it.

    `cfg` must be fully resolved (checkpoint.dir and metrics_file set by the launcher when wanted).
    `oom_watch`: told the device and the runtime, to explain running out of GPU memory (oom.py).
    `on_step(step)`, if given, is called after each step's work is queued (a profiler's schedule,
    a sync check). With `logging.measure_memory` on a CPU, every storage's life is tracked from
    before the model is built (memory/step_meter.py), for each step's peak and its parts.
    """
    with step_tracker(cfg) as tracker:
        return _train(cfg, return_state, generate_sample, oom_watch, on_step, tracker)


def _train(cfg: Config, return_state: bool, generate_sample: bool,
           oom_watch: OutOfMemoryWatch | None, on_step, tracker) -> TrainResult:
    t = cfg.training
    ctx = init_parallel(cfg, timeout_s=cfg.launch.collective_timeout_s or 600.0)
    comm.set_context(ctx)
    drill = _watch_faults(cfg, ctx, oom_watch)
    torch.manual_seed(t.seed)
    dataset, val, tokenizer = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    plan = _resume_plan(cfg, ctx)
    if plan is not None:  # the drill strikes a fresh run only: torchrun's agent re-forms the
        drill = None      # world for a joining node without counting a restart, and that resumes
    # A run resumed from a checkpoint takes its weights from there, not from model.from_hf.
    pretrained = cfg.model.from_hf if plan is None else None
    rt: Runtime = parallelize(build_model(cfg.model, t.seed), ctx, cfg, pretrained=pretrained)
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay, t.optimizer,
                       momentum=t.muon_momentum, ns_steps=t.muon_ns_steps)
    if oom_watch is not None:
        oom_watch.runtime = rt
    run = _Run(cfg, ctx, rt, dataset, val, plan, drill, tracker)
    with run.progress, run.stop:  # Ctrl-C, SIGTERM: interrupt.py
        for step in range(run.start_step + 1, t.steps + 1):
            run.step(step)
            if on_step is not None:
                on_step(step)
            if run.result.interrupted:  # every rank ends here, after the same step
                break
    result = run.close()
    comm.stop_recording()
    sampling = generate_sample and not result.interrupted  # (a run stopped early: no sample)
    _final_state_and_sample(rt, cfg, ctx, tokenizer, result, return_state, sampling)
    return result


class _Run:
    """One rank's training run, step by step: what a step queues, and what a read logs."""

    def __init__(self, cfg: Config, ctx: ParallelContext, rt: Runtime, dataset, val, plan,
                 drill: FaultDrill | None = None, tracker=None):
        t = cfg.training
        self.cfg, self.ctx, self.rt, self.dataset, self.val = cfg, ctx, rt, dataset, val
        self.result = TrainResult()
        self.start_step, self.consumed = 0, 0
        self.shapes = model_shapes(cfg.model)
        self.schedule = plan.schedule if plan is not None else LRSchedule.of(t)
        if plan is not None:
            _restore(rt, plan, self.shapes, cfg, ctx)
            self.start_step, self.consumed = plan.step, plan.consumed_samples
            self.result.resumed_from = plan.path
        self.saver = CheckpointWriter(Path(cfg.checkpoint.dir), cfg.checkpoint.keep, ctx.rank,
                                      ctx.world_size, cfg.checkpoint.async_save) \
            if cfg.checkpoint.dir else None
        self.writer = MetricsWriter(cfg.logging.metrics_file if ctx.is_main else None,
                                    Path(cfg.logging.run_dir) / "tensorboard"
                                    if ctx.is_main and cfg.logging.tensorboard else None,
                                    WandbRun(Path(cfg.logging.run_dir), cfg.logging.wandb_project,
                                             cfg.model_dump(mode="json"))
                                    if ctx.is_main and cfg.logging.wandb else None)
        self.result.metrics_file = self.writer.path
        self.eval_sequences = _eval_sequences(cfg, val)
        self.peak = peak_flops(ctx.device, rt.precision.dtype)
        self.flops_per_token = cfg.model.flops_per_token(t.seq_len)
        self.tokens_per_step = cfg.global_batch_size * t.seq_len
        self.sampler = GlobalBatchSampler(len(dataset), t.seed)
        self.feed = BatchFeed(_batch_maker(dataset, self.sampler, cfg, ctx), ctx.device)
        self.readings = Readings()
        self.stop = StopRequest(cfg.checkpoint.save_on_signal_s)
        self.drill = drill
        self.tracker = tracker  # memory/tracker.py's, with logging.measure_memory on a CPU
        # checkpoint.every_minutes: a broadcast and a host wait a step (only when asked for)
        self.timer = SaveTimer(cfg.checkpoint.every_minutes if self.saver is not None else None,
                               ctx)
        self.agreed = AgreedStop(ctx.world_size, ctx.device)
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
        t, rt, g = self.cfg.training, self.rt, self.cfg.global_batch_size
        started = time.perf_counter()
        self.stop.step(started=started)
        if self.drill is not None:
            self.drill.strike(step, self.ctx.rank)
        comm_before = comm.stats.snapshot()
        micro = self.feed.get(self.consumed)
        loss_tokens = _loss_tokens(self.dataset, self.sampler.indices(self.consumed, g))
        meter = StepMeter(rt.module, self.tracker) if self.cfg.logging.measure_memory else None
        lr = self.schedule.at(step)
        # the next step's batch is copied while this one's gradients are reduced
        prefetch = (lambda: self.feed.prefetch(self.consumed + g)) if step < t.steps else None
        outcome = train_step(rt, micro, loss_tokens, t.grad_clip, lr, meter, prefetch)
        grad_norm = outcome.grad_norm
        if not outcome.stepped:
            self.result.skipped_steps.append(step)
        loss_total, flags = rt.global_loss_and_flag(outcome.loss_sum, self.stop.requested)
        if meter is not None:  # the loss's reduction is in the step
            meter.end()
        stopping = self.agreed.agreed(flags, self.stop.requested)
        self.readings.add(step, loss_total / loss_tokens, grad_norm)
        self.consumed += g
        parts = rt.metrics()  # host figures of the runtime's parts (fp16's scale, experts)
        if "loss_scale" in parts:
            self.result.loss_scales.append(parts["loss_scale"])
        if "mtp_loss" in parts:  # multi-token prediction's, apart from `loss`
            self.result.mtp_losses.append(parts["mtp_loss"])
        self.stop.step(took=time.perf_counter() - started)
        self.progress.update(step)
        evaluating = self.val is not None and (step == t.steps or (
            t.eval_every and step % t.eval_every == 0))
        every, timed = self.cfg.checkpoint.every, self.timer.due()  # collective: every step
        saving = self.saver is not None and (
            (every and step % every == 0) or step == t.steps or timed or stopping)
        logged = step % self.cfg.logging.every == 0 or step in (self.start_step + 1, t.steps)
        if logged or evaluating or saving or stopping:
            self._read(step, lr, loss_tokens, parts, comm_before, meter, evaluating)
        self._save(step, saving)
        if logged or evaluating or saving or stopping:
            self.window_start = self._now()  # evaluation and saving are no step's time
        if stopping:
            self.result.interrupted = self.stop.signum or signal.SIGTERM

    def _save(self, step: int, saving: bool) -> None:
        if self.saver is not None:  # a save written in the background: commit it once every
            self.saver.poll()       # rank is done (a step after it began, at the earliest)
        if saving:
            self.timer.saved()
            meta = CheckpointMeta(step, self.consumed, self.ctx.world_size, _layout_of(self.cfg),
                                  self.cfg.model_dump(mode="json"), self.schedule.as_dict(),
                                  self.shapes, self.rt.checkpoint_state().get("loss_scaler"))
            self.saver.save(meta, state_to_save(self.rt, self.shapes))

    def _read(self, step: int, lr: float, loss_tokens: int, parts: dict, comm_before, meter,
              evaluating: bool) -> None:
        """Read every step's loss and norm since the last read (the host waits here), check
        them, and log this step."""
        rows = self.readings.read()
        step_time = (time.perf_counter() - self.window_start) / len(rows)
        for s, (loss, norm) in rows:
            if not math.isfinite(loss):
                raise FloatingPointError(_non_finite(loss, s, self.cfg, self.result.resumed_from,
                                                     s == self.start_step + 1))
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
            "tokens": self.consumed * self.cfg.training.seq_len, "loss_tokens": loss_tokens,
            "step_time_s": step_time, "tokens_per_s": tokens_per_s,
            "mfu": (tokens_per_s * self.flops_per_token / (peak * self.ctx.world_size))
            if peak else None,
            "memory": {**self.rt.memory_report(), "activations_peak_bytes": None,
                       **(meter.report() if meter is not None else {}),
                       "rss_peak_bytes": peak_rss_bytes()},
            "comm": _comm_delta(comm_before),
        }
        record.update(parts)  # fp16: loss_scale, skipped_steps; an MoE: moe; MTP: mtp_loss
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


def _resume_plan(cfg: Config, ctx: ParallelContext):
    """The resume plan (meta.json only: the launcher made the same plan and printed its line),
    the run folder checked (run_folder.py), and on rank 0 the metric lines of the steps trained
    again dropped."""
    try:
        plan = agreed_plan(cfg, ctx.rank, ctx.world_size)
        run_folder.check(cfg, plan.path if plan else None, plan.step if plan else 0)
    except ConfigError as exc:
        raise ResumeError(str(exc)) from None
    if ctx.is_main:
        run_folder.trim_metrics(cfg, plan.step if plan else 0)
    return plan


def _restore(rt: Runtime, plan, shapes: dict, cfg: Config, ctx: ParallelContext) -> None:
    """This rank's state from the checkpoint; each file it opens is checked against its SHA-256
    first (index.py), and what cannot be read is a ResumeError naming it."""
    try:
        with CheckpointReader(plan.path, plan.meta, verified=plan.verified) as reader:
            restore_state(rt, reader, shapes)
            reader.restore_rng(ctx.rank)
    except CheckpointError as exc:
        raise ResumeError(f"checkpoint.resume={cfg.checkpoint.resume}: {exc}") from None
    rt.load_checkpoint_state(plan.meta)  # fp16's loss scaler (else a fresh scale)


def _final_state_and_sample(rt: Runtime, cfg: Config, ctx: ParallelContext, tokenizer,
                            result: TrainResult, return_state: bool, sampling: bool) -> None:
    """The whole model's weights (collective) when asked for or to sample, and rank 0's text."""
    sampling = sampling and cfg.logging.sample_tokens > 0
    full = rt.full_state_dict() if return_state or sampling else None
    if return_state:
        result.final_state = full
    if sampling and ctx.is_main:
        model = Llama(cfg.model)
        model.load_state_dict(full)
        result.sample = generate(model.to(ctx.device), tokenizer, prompt="The ",
                                 max_new_tokens=cfg.logging.sample_tokens,
                                 context=cfg.training.seq_len, seed=cfg.training.seed)


def _non_finite(loss: float, step: int, cfg: Config, resumed_from: Path | None,
                first: bool) -> str:
    """What a non-finite loss says: the checkpoint when it comes on the first step after a resume
    (its values, not the learning rate, are then the likely cause), else the fixes that are not
    already in place."""
    where = f"loss became {loss} at step {step}"
    if resumed_from is not None and first:
        return (f"{where}, the first step after resuming {resumed_from}: the checkpoint's weights "
                "or optimizer state are the likely cause (it passed its SHA-256 and finiteness "
                "checks, so it was saved so or by another version). Resume an earlier checkpoint.")
    clip = cfg.training.grad_clip
    fixes = ["lower training.lr"] + (["enable training.grad_clip"] if clip is None else []) + (
        ["use precision.dtype=bf16 (fp16's range is narrow)"] if cfg.precision.dtype == "fp16"
        else [])
    return (f"{where} (training.lr={cfg.training.lr:g}, grad_clip="
            f"{'off' if clip is None else f'{clip:g}'}): " + ", or ".join(fixes) + ".")


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
