"""The training loop of one rank. The same function runs under torchrun, srun, the local launcher
and the multi-process tests; everything layout-specific hides behind the `Runtime`."""

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
from ultrascale.layout import Layout
from ultrascale.memory.measure import SavedActivationMeter
from ultrascale.models.llama import Llama, build_model
from ultrascale.parallel import parallelize
from ultrascale.parallel.precision import resolve_config
from ultrascale.parallel.runtime import Runtime
from ultrascale.train.generate import generate
from ultrascale.train.metrics import MetricsWriter, peak_flops
from ultrascale.train.progress import Progress, peak_rss_bytes
from ultrascale.train.schedule import LRSchedule


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


class ResumeError(RuntimeError):
    pass


def _layout_of(cfg: Config) -> dict:
    return Layout.from_config(cfg).as_dict()


def _micro_batches(dataset, sampler, cfg: Config, ctx: ParallelContext, consumed: int):
    t = cfg.training
    groups = sampler.rank_micro_batches(consumed, cfg.global_batch_size, cfg.parallel.dp,
                                        ctx.coord("dp"), t.micro_batch_size)
    out = []
    for idx in groups:
        batch = torch.from_numpy(np.stack([dataset.sample(i) for i in idx])).to(ctx.device)
        out.append((batch[:, :-1], batch[:, 1:]))
    return out


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


def train(cfg: Config, *, return_state: bool = False, generate_sample: bool = True) -> TrainResult:
    """Run `cfg.training.steps` optimizer steps (resuming if asked). Collective: every rank calls it.

    `cfg` must be fully resolved (checkpoint.dir and metrics_file set by the launcher when wanted).
    """
    t = cfg.training
    ctx = init_parallel(cfg, timeout_s=cfg.launch.collective_timeout_s or 600.0)
    comm.set_context(ctx)
    cfg = resolve_config(cfg, ctx.device)  # precision.dtype=auto: what it means on this device
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
    loss_scale = 1.0 / tokens_per_step  # every target is a real token (packed samples)

    progress = Progress(t.steps, start_step, enabled=ctx.is_main and cfg.logging.progress)
    with progress:
        for step in range(start_step + 1, t.steps + 1):
            comm_before = comm.stats.snapshot()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            micro = _micro_batches(dataset, sampler, cfg, ctx, consumed)
            meter = SavedActivationMeter(rt.module) if cfg.logging.measure_memory else nullcontext()
            used_scale = rt.loss_scale  # fp16: the scale this step's loss is multiplied by
            with meter:
                loss_sum = rt.forward_backward(micro, loss_scale)
            rt.finish_gradients()
            grad_norm = rt.clip_grad_norm(t.grad_clip)
            lr = schedule.at(step)
            if not rt.optimizer_step(lr):
                result.skipped_steps.append(step)
            loss = rt.global_loss(loss_sum) / tokens_per_step
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
            mtp = rt.mtp_metrics(tokens_per_step)
            if mtp is not None:
                result.mtp_losses.append(mtp["mtp_loss"])
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
                    "tokens": consumed * t.seq_len, "step_time_s": step_time,
                    "tokens_per_s": tokens_per_s, "mfu": mfu,
                    "memory": {**rt.memory_report(),
                               "activations_peak_bytes": getattr(meter, "peak_bytes", None),
                               "rss_peak_bytes": peak_rss_bytes()},
                    "comm": _comm_delta(comm_before),
                }
                if used_scale is not None:  # fp16: the scale this step used, steps skipped so far
                    record.update(loss_scale=used_scale, skipped_steps=rt.skipped_steps)
                moe = rt.moe_metrics()
                if moe is not None:
                    record["moe"] = moe
                if mtp is not None:  # multi-token prediction's losses, apart from `loss`
                    record.update(mtp)
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
