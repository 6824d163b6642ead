"""The training loop of one rank. The same function runs under torchrun, srun, the local launcher
and the multi-process tests; everything layout-specific hides behind the `Runtime`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ultrascale.checkpoint.resume import model_shapes, plan_resume
from ultrascale.checkpoint.state import restore_state, state_to_save
from ultrascale.checkpoint.store import CheckpointMeta, CheckpointReader, CheckpointWriter
from ultrascale.config import Config, ConfigError
from ultrascale.data.dataset import TokenDataset, load_splits
from ultrascale.data.windows import micro_batch
from ultrascale.data.sampler import GlobalBatchSampler
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext, init_parallel
from ultrascale.memory.step_meter import StepMeter, step_tracker
from ultrascale.models.documents import Documents
from ultrascale.models.llama import Llama, build_model
from ultrascale.parallel.apply import parallelize
from ultrascale.parallel.runtime import Runtime
from ultrascale.train.generate import generate
from ultrascale.train.metrics import MetricsWriter, peak_flops
from ultrascale.train.progress import Progress, peak_rss_bytes
from ultrascale.train.schedule import LRSchedule
from ultrascale.train.step import train_step


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


def _micro_batch(dataset, indices, device: torch.device) -> tuple:
    """(inputs, targets, documents or None) of these samples on the device: targets IGNORE where
    they do not count, documents where a sample packs several (data/dataset.py)."""
    inputs, targets, starts = micro_batch([dataset.window(i) for i in indices])
    documents = None if starts is None else Documents.of(starts, device)
    return torch.from_numpy(inputs).to(device), torch.from_numpy(targets).to(device), documents


def _micro_batches(dataset, sampler, cfg: Config, ctx: ParallelContext, consumed: int):
    t = cfg.training
    groups = sampler.rank_micro_batches(consumed, cfg.global_batch_size, cfg.parallel.dp,
                                        ctx.coord("dp"), t.micro_batch_size)
    return [_micro_batch(dataset, idx, ctx.device) for idx in groups]


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


def train(cfg: Config, *, return_state: bool = False, generate_sample: bool = True) -> TrainResult:
    """Run `cfg.training.steps` optimizer steps (resuming if asked). Collective: every rank calls it.

    `cfg` must be fully resolved (checkpoint.dir and metrics_file set by the launcher when wanted).
    With `logging.measure_memory` on a CPU, every storage's life is tracked from before the model
    is built (memory/step_meter.py), for each step's peak and its parts.
    """
    with step_tracker(cfg) as tracker:
        return _train(cfg, tracker, return_state, generate_sample)


def _train(cfg: Config, tracker, return_state: bool, generate_sample: bool) -> TrainResult:
    t = cfg.training
    ctx = init_parallel(cfg, timeout_s=cfg.launch.collective_timeout_s or 600.0)
    comm.set_context(ctx)
    torch.manual_seed(t.seed)
    dataset, val, tokenizer = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    eval_sequences = _eval_sequences(cfg, val)
    sampler = GlobalBatchSampler(len(dataset), t.seed)
    try:  # meta.json only: the launcher made the same plan and printed its line
        plan = plan_resume(cfg)
    except ConfigError as exc:
        raise ResumeError(str(exc)) from None
    # A run resumed from a checkpoint takes its weights from there, not from model.from_hf.
    pretrained = cfg.model.from_hf if plan is None else None
    rt: Runtime = parallelize(build_model(cfg.model, t.seed), ctx, cfg, pretrained=pretrained)
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay, t.optimizer,
                       momentum=t.muon_momentum, ns_steps=t.muon_ns_steps)

    result = TrainResult()
    start_step, consumed = 0, 0
    shapes = model_shapes(cfg.model)
    schedule = plan.schedule if plan is not None else LRSchedule.of(t)
    if plan is not None:
        with CheckpointReader(plan.path, plan.meta) as reader:
            restore_state(rt, reader, shapes)
            reader.restore_rng(ctx.rank)
        if rt.scaler is not None and plan.meta.get("loss_scaler"):  # else a fresh scale (fp16
            rt.scaler.load_state(plan.meta["loss_scaler"])          # from a bf16/fp32 run)
        start_step, consumed = plan.step, plan.consumed_samples
        result.resumed_from = plan.path
    saver = CheckpointWriter(Path(cfg.checkpoint.dir), cfg.checkpoint.keep, ctx.rank,
                             ctx.world_size, cfg.checkpoint.async_save) \
        if cfg.checkpoint.dir else None

    writer = MetricsWriter(cfg.logging.metrics_file if ctx.is_main else None,
                           Path(cfg.logging.run_dir) / "tensorboard"
                           if ctx.is_main and cfg.logging.tensorboard else None)
    result.metrics_file = writer.path
    peak = peak_flops(ctx.device, rt.precision.dtype)
    flops_per_token = cfg.model.flops_per_token(t.seq_len)
    tokens_per_step = cfg.global_batch_size * t.seq_len

    progress = Progress(t.steps, start_step, enabled=ctx.is_main and cfg.logging.progress)
    with progress:
        for step in range(start_step + 1, t.steps + 1):
            comm_before = comm.stats.snapshot()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            micro = _micro_batches(dataset, sampler, cfg, ctx, consumed)
            loss_tokens = _loss_tokens(dataset, sampler.indices(consumed, cfg.global_batch_size))
            meter = StepMeter(rt.module, tracker) if cfg.logging.measure_memory else None
            lr = schedule.at(step)
            outcome = train_step(rt, micro, loss_tokens, t.grad_clip, lr, meter)
            grad_norm, used_scale = outcome.grad_norm, outcome.used_scale
            if not outcome.stepped:
                result.skipped_steps.append(step)
            loss = rt.global_loss(outcome.loss_sum) / loss_tokens
            if meter is not None:
                meter.end()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            consumed += cfg.global_batch_size
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}; lower training.lr "
                                         "or enable training.grad_clip.")
            result.steps.append(step)
            result.losses.append(loss)
            result.grad_norms.append(grad_norm)
            if used_scale is not None:
                result.loss_scales.append(used_scale)
            tokens_per_s = tokens_per_step / step_time
            progress.update(step, loss, tokens_per_s)
            evaluating = val is not None and (step == t.steps or (t.eval_every and
                                                                  step % t.eval_every == 0))
            eval_loss = _evaluate(rt, val, eval_sequences, cfg, ctx) if evaluating else None
            if step % cfg.logging.every == 0 or step in (start_step + 1, t.steps) or evaluating:
                mfu = (tokens_per_s * flops_per_token / (peak * ctx.world_size)) if peak else None
                record = {
                    "step": step, "loss": loss,
                    "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "lr": lr,
                    "tokens": consumed * t.seq_len, "loss_tokens": loss_tokens,
                    "step_time_s": step_time,
                    "tokens_per_s": tokens_per_s, "mfu": mfu,
                    "memory": {**rt.memory_report(), "activations_peak_bytes": None,
                               **(meter.report() if meter is not None else {}),
                               "rss_peak_bytes": peak_rss_bytes()},
                    "comm": _comm_delta(comm_before),
                }
                if used_scale is not None:  # fp16: the scale this step used, steps skipped so far
                    record.update(loss_scale=used_scale, skipped_steps=rt.skipped_steps)
                moe = rt.moe_metrics()
                if moe is not None:
                    record["moe"] = moe
                if evaluating:
                    record["eval_loss"] = eval_loss
                    record["eval_tokens"] = eval_sequences * t.seq_len
                    result.eval_losses.append((step, eval_loss))
                writer.write(record)
                progress.log_step(record)
            if saver is not None:  # a save written in the background: commit it once every
                saver.poll()       # rank is done (a step after it began, at the earliest)
            every = cfg.checkpoint.every
            if saver is not None and ((every and step % every == 0) or step == t.steps):
                meta = CheckpointMeta(step, consumed, ctx.world_size, _layout_of(cfg),
                                      cfg.model_dump(mode="json"), schedule.as_dict(), shapes,
                                      rt.scaler.state() if rt.scaler is not None else None)
                saver.save(meta, state_to_save(rt, shapes))
    if saver is not None:
        result.checkpoint = saver.close()
    writer.close()

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
