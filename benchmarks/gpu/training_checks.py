"""Our training step measured by `ultrascale.train.trainer.train` itself, one run per process
(run.py starts each as a subprocess, so no run inherits another's memory):

    python benchmarks/gpu/training_checks.py speed --variant ours --json OUT [--smoke]
    python benchmarks/gpu/training_checks.py speed --variant ours --sync-check --json OUT
    python benchmarks/gpu/training_checks.py memory --json OUT [--smoke]

Speed: tokens/s of whole windows of steps. The trainer reads the device only on logged steps, so
`logging.every = W` makes each logged record the mean of W steps with no host sync inside; the
first record (step 1: compilation) and the first window (autotuning, warm-up) are dropped and the
median of the rest is reported. MFU by the trainer's formula (6N + 12 L h s per token) against the
device's bf16 peak, also for FP8 runs (docs/precision.md: an FP8 run's own record uses the FP8
peak). Variants: `ours` (compiled blocks and loss, the fused optimizer path: the headline), its
`baseline` (the same with `training.optimizer_impl=per_tensor`), `eager_triton` (no compile,
Triton kernels), and the FP8 shape check: two Llama 3 70B layers (hidden 8192, ffn 28672, 64
heads, 8 kv heads, vocabulary 32768, 8192 tokens, micro-batch 1, compiled) in `fp8_bf16`,
`fp8_rowwise` and `fp8_tensorwise` (`precision.fp8_filter=auto`: the kv projections, N = 1024,
stay bf16 row-wise). `--smoke`: tiny sizes on the CPU, eager.

`--sync-check` (CUDA): `torch.cuda.set_sync_debug_mode("warn")` over every step between the first
and the last (the only ones logged, with logging.every=1000); each synchronising call is counted
against the step it happened in, with where it came from.

Memory: the estimator (`memory.estimator.estimate`, the most loaded rank) against
`torch.cuda.max_memory_allocated` of six one-GPU layouts of the 1B model, 3 steps each, eager.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ultrascale.config import ConfigError, build_config
from ultrascale.devices import device_peak_flops
from ultrascale.memory.estimator import estimate
from ultrascale.memory.measure import LiveTensorMeter
from ultrascale.parallel.support import check_supported

# Llama 3.2 1B's shape on one GPU: 4 sequences of 2048 tokens a step.
ONE_B = {"model": {"preset": "llama3-1b"},
         "training": {"seq_len": 2048, "micro_batch_size": 4, "warmup_steps": 2, "lr": 3e-4},
         "precision": {"dtype": "bf16"}}
# Two layers of Llama 3 70B at 8192 tokens: the shape where FP8 pays (benchmarks/README.md).
SEVENTY_B_LAYERS = {"model": {"preset": "llama3-70b", "num_layers": 2, "vocab_size": 32768,
                              "tie_embeddings": True},
                    "training": {"seq_len": 8192, "micro_batch_size": 1, "warmup_steps": 2,
                                 "lr": 3e-4},
                    "precision": {"dtype": "bf16"}}
TINY = {"model": {"preset": None, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "num_kv_heads": 1, "ffn_hidden_size": 48, "vocab_size": 300},
        "training": {"seq_len": 16, "micro_batch_size": 2, "warmup_steps": 1},
        "precision": {"dtype": "fp32"}}
COMMON = {"parallel": {"dp": 1}, "logging": {"progress": False, "sample_tokens": 0}}

COMPILED = ["training.compile=true", "training.kernels=torch"]
VARIANTS = {  # name -> (base, overrides, steps per window)
    "ours": (ONE_B, COMPILED, 5),
    "baseline": (ONE_B, COMPILED + ["training.optimizer_impl=per_tensor"], 5),
    "eager_triton": (ONE_B, ["training.kernels=triton"], 5),
    "fp8_bf16": (SEVENTY_B_LAYERS, COMPILED, 3),
    "fp8_rowwise": (SEVENTY_B_LAYERS, COMPILED + [
        "precision.dtype=fp8", "precision.fp8_recipe=rowwise", "precision.fp8_filter=auto"], 3),
    "fp8_tensorwise": (SEVENTY_B_LAYERS, COMPILED + [
        "precision.dtype=fp8", "precision.fp8_recipe=tensorwise", "precision.fp8_filter=auto"], 3),
}
MEMORY_LAYOUTS = {
    "mbs1": ["training.micro_batch_size=1"],
    "mbs2": ["training.micro_batch_size=2"],
    "mbs2-selective": ["training.micro_batch_size=2", "training.recompute=selective"],
    "mbs4-full": ["training.micro_batch_size=4", "training.recompute=full"],
    "seq2x-selective": ["training.micro_batch_size=1", "training.seq_len=2x",
                        "training.recompute=selective"],
    "mbs2-acc2": ["training.micro_batch_size=2", "training.grad_accum_steps=2"],
}


def config(base: dict, overrides: list[str], smoke: bool, steps: int, every: int):
    """The run's config: `base` (TINY in fp32 on the CPU under --smoke, without compile or
    Triton) with `overrides`, `steps` steps logged every `every`."""
    tree = json.loads(json.dumps(TINY if smoke else base))
    tree.update({k: {**tree.get(k, {}), **v} for k, v in COMMON.items()})
    tree["device"] = "cpu" if smoke else "cuda"
    if smoke:  # eager fp32 on the CPU (FP8 emulated): the harness, not the speed
        overrides = [o for o in overrides if not o.startswith(("training.compile",
                                                               "training.kernels"))]
        overrides += ["precision.fp8_emulate=true"] if "precision.dtype=fp8" in overrides else []
    seq = tree["training"]["seq_len"]
    overrides = [o.replace("seq_len=2x", f"seq_len={2 * seq}") for o in overrides]
    return build_config(tree, overrides + [f"training.steps={steps}",
                                           f"logging.every={every}"])


def train_and_read(cfg, on_step=None) -> list[dict]:
    """Train `cfg` here; its metrics records."""
    from ultrascale.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(
            update={"metrics_file": str(metrics), "run_dir": tmp})})
        train(cfg, generate_sample=False, on_step=on_step)
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def refused(cfg) -> str | None:
    """Why the launcher would refuse `cfg` here (an FP8 recipe this device lacks, ...)."""
    from ultrascale.preflight import check_precision

    try:
        check_supported(cfg)
        check_precision(cfg, cuda=cfg.device == "cuda")
    except ConfigError as exc:
        return str(exc)
    return None


def bf16_peak() -> float | None:
    return device_peak_flops(torch.cuda.get_device_name(), "bf16") \
        if torch.cuda.is_available() else None


def speed(variant: str, smoke: bool, sync_check: bool = False) -> dict:
    base, overrides, window = VARIANTS[variant]
    steps, every = (8, 1000) if sync_check else (3 * window, window)
    if smoke:
        steps, every = (6, 1000) if sync_check else (6, 2)
    cfg = config(base, overrides, smoke, steps, every)
    why = refused(cfg)
    if why:
        return {"available": False, "reason": why}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    syncs = SyncCounter(steps) if sync_check and not smoke else None
    with (syncs or _nothing()):
        records = train_and_read(cfg, on_step=syncs.on_step if syncs else None)
    steady = records[2:] or records[-1:]  # past step 1 and the first window
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    peak = bf16_peak()
    fpt = cfg.model.flops_per_token(cfg.training.seq_len)
    out = {"available": True, "variant": variant, "config": overrides,
           "tokens_per_s": tps, "step_time_s": statistics.median(r["step_time_s"] for r in steady),
           "mfu": tps * fpt / peak if peak else None, "flops_per_token": fpt,
           "windows": [(r["step"], r["tokens_per_s"]) for r in records],
           "final_loss": records[-1]["loss"], "attention": records[0].get("attention"),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated()
           if torch.cuda.is_available() else None}
    if syncs is not None:
        out["syncs"] = syncs.report()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# What "warn" mode says at a synchronising call (c10/cuda/CUDAFunctions.cpp). Its switch's own
# notice ("Synchronization debug mode is a prototype feature ...") is no sync: counted as one, it
# read as a sync in step 2 on the 2026-11-29 H200 lease.
SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncCounter:
    """Counts CUDA synchronising calls per step while the steps between the first and the last
    run (the trainer logs only those two with logging.every=1000)."""

    def __init__(self, steps: int):
        self.steps, self.step = steps, 1
        self.per_step: dict[int, list[str]] = {}

    def __enter__(self):
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def on_step(self, step: int) -> None:
        """Called after step `step` is queued: the calls since the last one were its."""
        if 1 < step < self.steps:
            self.per_step[step] = [f"{w.filename}:{w.lineno}: {str(w.message)[:160]}"
                                   for w in self.caught if SYNC_WARNING in str(w.message)]
        self.caught.clear()
        checking = step + 1 < self.steps  # the next step is neither the first nor the last
        torch.cuda.set_sync_debug_mode("warn" if checking else "default")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return self._catch.__exit__(*exc)

    def report(self) -> dict:
        counts = {s: len(v) for s, v in self.per_step.items()}
        where = sorted({line for v in self.per_step.values() for line in v})
        return {"per_unlogged_step": counts, "max": max(counts.values(), default=0),
                "sources": where[:20]}


def memory(smoke: bool) -> list[dict]:
    """Estimator against the measured peak of each one-GPU layout (3 steps, eager)."""
    rows = []
    for name, overrides in MEMORY_LAYOUTS.items():
        cfg = config(ONE_B, overrides + ["training.kernels=torch"], smoke, 3, 1)
        est = estimate(cfg.model, cfg.layout())
        row = {"layout": name, "label": f"{cfg.layout().short()}-seq{cfg.training.seq_len}",
               "estimated_bytes": est.total}
        try:
            measured, before = _measured_peak(cfg)
        except Exception as exc:  # one failed run must not hide the others' figures
            rows.append({**row, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            continue
        rows.append({**row, "measured_bytes": measured, "allocated_before_bytes": before,
                     "ratio_measured_to_estimated": measured / est.total})
    return rows


def _measured_peak(cfg) -> tuple[int, int]:
    """(the run's own peak bytes, bytes still allocated before it)."""
    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_and_read(cfg)
        return torch.cuda.max_memory_allocated() - before, before
    with LiveTensorMeter() as meter:
        train_and_read(cfg)
    return meter.peak_bytes, 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("speed", "memory"))
    ap.add_argument("--variant", choices=list(VARIANTS), default="ours")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sync-check", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    result = speed(args.variant, args.smoke, args.sync_check) if args.what == "speed" \
        else memory(args.smoke)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
