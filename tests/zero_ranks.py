"""Rank functions shared by the data-parallel / ZeRO tests: build a runtime from the tiny config
and drive training steps by hand (what the trainer does), so tests can look inside one step."""

from __future__ import annotations

import time

import torch

from parity import make_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import init_parallel
from ultrascale.models.llama import build_model
from ultrascale.parallel.apply import parallelize


def build(overrides: list[str]):
    cfg = make_config(overrides)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)
    t = cfg.training
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay)
    return cfg, ctx, rt


def micro_batches(cfg, ctx, step: int):
    """Random tokens, different on every dp rank and step."""
    t, v = cfg.training, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(1000 * step + ctx.coord("dp"))
    out = []
    for _ in range(t.grad_accum_steps):
        seq = torch.randint(0, v, (t.micro_batch_size, t.seq_len + 1), generator=gen)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def train_step(cfg, ctx, rt, step: int) -> None:
    t = cfg.training
    micro = micro_batches(cfg, ctx, step)
    rt.forward_backward(micro, 1.0 / (cfg.global_batch_size * t.seq_len))
    rt.finish_gradients()
    rt.clip_grad_norm(t.grad_clip)
    rt.optimizer_step(t.lr)


def measure_step(overrides: list[str]) -> dict:
    """One warm-up step, then the traffic and the memory of the next step."""
    cfg, ctx, rt = build(overrides)
    train_step(cfg, ctx, rt, 0)
    with comm.counting() as c:
        train_step(cfg, ctx, rt, 1)
    gs = rt.data_parallel
    traffic = {f"{k}/{d}": (v.calls, v.bytes, v.wire_bytes) for (k, d), v in c.counters.items()}
    return {"traffic": traffic, "memory": rt.memory_report(),
            "psi": sum(p.numel() for p in rt.module.parameters()),
            "padded": [b.padded for b in gs.buckets], "n_params": len(list(rt.module.parameters())),
            "expert_padded": [b.padded for b in gs.buckets
                              if hasattr(gs, "bucket_is_expert") and gs.bucket_is_expert(b)],
            "segments": len(getattr(gs, "segments", ())), "world": ctx.world_size}


def backward_timeline(overrides: list[str]) -> dict:
    """Launch times of the bucket reductions of one step, and when the backward reached its last
    piece (the embedding)."""
    cfg, ctx, rt = build(overrides)
    train_step(cfg, ctx, rt, 0)
    rt.data_parallel.launch_log.clear()
    marks = {}

    def mark_embedding_backward(module, args, out):  # the last piece of the backward
        out.register_hook(lambda grad: marks.setdefault("embed_backward", time.perf_counter())
                          and None)

    rt.module.embed.register_forward_hook(mark_embedding_backward)
    comm.stats.record_events = True
    micro = micro_batches(cfg, ctx, 1)
    with comm.counting() as c:
        rt.forward_backward(micro, 1e-3)
        marks["backward_end"] = time.perf_counter()
        rt.finish_gradients()
    bucket_of_embed = next(b.index for b in rt.data_parallel.buckets
                           if any(p is rt.module.embed.weight for p in b.params))
    return {"events": [(e.t, e.kind, e.tag) for e in c.events], "marks": marks,
            "launch_log": list(rt.data_parallel.launch_log), "n_buckets": len(rt.data_parallel.buckets),
            "embed_bucket": bucket_of_embed}


def zero3_forward_timeline(overrides: list[str]) -> dict:
    """Launch times of the parameter gathers of one ZeRO-3 forward, and when each layer's
    forward started and ended."""
    cfg, ctx, rt = build(overrides)
    train_step(cfg, ctx, rt, 0)
    spans = {}
    for name, layer in rt.module.layers.items():
        # Registered after the component's hooks: the start mark follows the layer's own gather.
        layer.register_forward_pre_hook(
            lambda m, a, n=name: spans.setdefault(n, [time.perf_counter()]) and None)
        layer.register_forward_hook(
            lambda m, a, o, n=name: spans[n].append(time.perf_counter()) and None)
    comm.stats.record_events = True
    x, _ = micro_batches(cfg, ctx, 1)[0]
    with comm.counting() as c:
        rt.module(x)
    return {"gathers": [e.t for e in c.events if e.tag == "param_gather"], "spans": spans}
