"""The checks that train: MFU of a 1B Llama in bf16 (eager, fused kernels, compiled), the FP8
speed-up (`precision.dtype=fp8`, the default tensor-wise recipe on the device's scaled matmul), compile against eager, and the memory estimator against the measured peak of six
one-GPU layouts. Each run is `ultrascale.train.trainer.train` in this process, reading the
metrics it writes (tokens/s and MFU per step; on CUDA the allocator's peak)."""

from __future__ import annotations

import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ultrascale.config import ConfigError, build_config
from ultrascale.memory.estimator import estimate
from ultrascale.memory.measure import LiveTensorMeter
from ultrascale.parallel.support import check_supported

GIB = 2 ** 30

# 1B Llama (Llama 3.2 1B's shape) on one GPU: 4 sequences of 2048 tokens a step.
FULL_BASE = {"model": {"preset": "llama3-1b"},
             "training": {"seq_len": 2048, "micro_batch_size": 4, "steps": 14,
                          "warmup_steps": 2, "lr": 3e-4},
             "precision": {"dtype": "bf16"}}
SMOKE_BASE = {"model": {"preset": None, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                        "num_kv_heads": 1, "ffn_hidden_size": 48, "vocab_size": 300},
              "training": {"seq_len": 16, "micro_batch_size": 1, "steps": 3, "warmup_steps": 1},
              "precision": {"dtype": "fp32"}}
COMMON = {"parallel": {"dp": 1}, "logging": {"progress": False, "sample_tokens": 0, "every": 1}}

# name -> overrides: eager and compiled with the plain head (compile against eager), fused
# kernels with the chunked loss, and both.
SPEED_VARIANTS = {
    "eager": ["training.kernels=torch"],
    "eager_fused": ["training.kernels=triton", "training.chunked_loss=true"],
    "compiled": ["training.compile=true", "training.kernels=torch"],
    "compiled_chunked": ["training.compile=true", "training.kernels=torch",
                         "training.chunked_loss=true"],
}

# Six layouts that fit one GPU (80 GB) for the memory check: micro-batch, recompute, sequence
# (2x: twice the base's, 4096 tokens on the GPU).
MEMORY_LAYOUTS = {
    "mbs1": ["training.micro_batch_size=1"],
    "mbs2": ["training.micro_batch_size=2"],
    "mbs2-selective": ["training.micro_batch_size=2", "training.recompute=selective"],
    "mbs4-full": ["training.micro_batch_size=4", "training.recompute=full"],
    "seq2x-selective": ["training.micro_batch_size=1", "training.seq_len=2x",
                        "training.recompute=selective"],
    "mbs2-acc2": ["training.micro_batch_size=2", "training.grad_accum_steps=2"],
}


def config(smoke: bool, overrides: list[str], cache: str, device: str):
    base = json.loads(json.dumps(SMOKE_BASE if smoke else FULL_BASE))
    seq = base["training"]["seq_len"]
    overrides = [o.replace("seq_len=2x", f"seq_len={2 * seq}") for o in overrides]
    base.update({k: {**base.get(k, {}), **v} for k, v in COMMON.items()})
    base["device"] = device
    return build_config(base, overrides + [f"training.compile_cache={cache}"])


def train_and_read(cfg) -> list[dict]:
    """Train `cfg` here; its per-step metrics records."""
    from ultrascale.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(
            update={"metrics_file": str(metrics), "run_dir": tmp})})
        train(cfg, generate_sample=False)
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def _refused(cfg) -> str | None:
    """Why the launcher would refuse `cfg` here (the engine's gaps; an FP8 recipe this device's
    scaled matmul lacks), or None."""
    from ultrascale.preflight import check_precision

    try:
        check_supported(cfg)
        check_precision(cfg, cuda=cfg.device == "cuda")
    except ConfigError as exc:
        return str(exc)
    return None


def speed(cfg, skip: int, deadline: float = math.inf) -> dict:
    """Median tokens/s and MFU over the steps after the first `skip` (warm-up, compilation)."""
    if time.perf_counter() > deadline:
        return {"available": False, "reason": "skipped: time budget spent"}
    why = _refused(cfg)
    if why:
        return {"available": False, "reason": why}
    try:
        records = train_and_read(cfg)[skip:]
    except Exception as exc:  # one failed run must not hide the others' figures
        return {"available": False, "reason": f"failed: {type(exc).__name__}: {exc}"}
    mfu = [r["mfu"] for r in records if r["mfu"] is not None]
    return {"available": True, "steps_timed": len(records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "step_time_s": statistics.median(r["step_time_s"] for r in records),
            "mfu": statistics.median(mfu) if mfu else None,
            "final_loss": records[-1]["loss"] if records else None}


def speed_checks(smoke: bool, cache: str, device: str, deadline: float = math.inf) -> dict:
    skip = 1 if smoke else 4
    runs = {name: speed(config(smoke, o, cache, device), skip, deadline)
            for name, o in SPEED_VARIANTS.items()}
    best = max((r for r in runs.values() if r.get("mfu") is not None),
               key=lambda r: r["mfu"], default=None)
    fp8 = speed(config(smoke, SPEED_VARIANTS["compiled_chunked"] + ["precision.dtype=fp8"],
                       cache, device), skip, deadline)
    out = {"runs": runs, "best_mfu": best["mfu"] if best else None, "mfu_target": 0.5,
           "compile_speedup": _ratio(runs["compiled"], runs["eager"]),
           "fp8": fp8, "fp8_speedup": _ratio(fp8, runs["compiled_chunked"])}
    return out


def _ratio(a: dict, b: dict) -> float | None:
    if not (a.get("available") and b.get("available")):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def memory_checks(smoke: bool, cache: str, device: str,
                  deadline: float = math.inf) -> list[dict]:
    """Estimator (`memory.estimator.estimate`, the most loaded rank's peak) against the measured
    peak: `torch.cuda.max_memory_allocated` over a 3-step run on CUDA, less what was allocated
    before it; on a CPU the peak of live tensors (`LiveTensorMeter`) over the same run."""
    rows = []
    for name, overrides in MEMORY_LAYOUTS.items():
        cfg = config(smoke, overrides + ["training.steps=3", "training.kernels=torch"], cache,
                     device)
        est = estimate(cfg.model, cfg.layout())
        label = f"{cfg.layout().short()}-seq{cfg.training.seq_len}"
        if time.perf_counter() > deadline:
            rows.append({"layout": name, "label": label, "estimated_bytes": est.total,
                         "error": "skipped: time budget spent"})
            continue
        try:
            measured, left_before = _measured_peak(cfg, device)
        except Exception as exc:  # one failed run must not hide the others' figures
            rows.append({"layout": name, "label": label, "estimated_bytes": est.total,
                         "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            continue
        rows.append({"layout": name, "label": label,
                     "estimated_bytes": est.total, "estimated_reserved_bytes": est.reserved,
                     "measured_bytes": measured, "allocated_before_bytes": left_before,
                     "ratio_measured_to_estimated":
                     measured / est.total if est.total else None})
    return rows


def _measured_peak(cfg, device: str) -> tuple[int, int]:
    """(the run's own peak bytes, bytes still allocated before it). The run's peak leaves out
    what earlier runs of this process left allocated; the second figure shows whether they left
    any (it should be about zero: a run frees its model, masters and optimizer state)."""
    gc.collect()
    if torch.cuda.is_available() and device != "cpu":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_and_read(cfg)
        return torch.cuda.max_memory_allocated() - before, before
    with LiveTensorMeter() as meter:
        train_and_read(cfg)
    return meter.peak_bytes, 0
