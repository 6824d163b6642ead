"""What the engine can run: `check_supported(cfg)` refuses, before any process starts, the
combinations that are not implemented, naming the key, the value and what to do instead.

Needs no torch, so the launcher and the prediction tools can call it cheaply.
"""

from __future__ import annotations

from ultrascale.config import Config, ConfigError


def check_supported(cfg: Config) -> None:
    """Raise ConfigError for settings the engine cannot run yet (never fall back silently)."""
    p, m = cfg.parallel, cfg.model
    unsupported = []
    # -- pipeline parallel (parallel/pipeline/) ----------------------------------------------------
    if p.pp > 1:
        from ultrascale.parallel.pipeline.schedules import validate_schedule
        try:
            validate_schedule(p.pp_schedule, p.pp, cfg.training.grad_accum_steps,
                              p.pp_virtual_stages, m.num_layers)
        except ValueError as e:
            unsupported.append(("parallel.pp_schedule", p.pp_schedule, str(e).rstrip(".")))
        # dp, ZeRO-1/2 and tp (with or without sequence parallel) compose: tests/test_pipeline_*.
        if p.tp > 1 and p.pp_schedule == "zero_bubble":
            unsupported.append(("parallel.pp_schedule", p.pp_schedule, "zero_bubble defers the "
                                "weight gradients of plain linears, and tensor-parallel matmuls "
                                "are not deferred yet; with tp > 1 use 1f1b or interleaved"))
    # -- end pipeline parallel ---------------------------------------------------------------------
    if p.cp > 1:
        unsupported.append(("parallel.cp", p.cp, "context parallel is not implemented yet; set cp=1"))
    if p.ep > 1 or m.num_experts:
        unsupported.append(("model.num_experts", m.num_experts,
                            "mixture of experts is not implemented yet; use a dense model"))
    # -- data parallel / ZeRO (parallel/data.py, zero.py, zero3.py) -------------------------------
    if p.zero > 0 and p.cp > 1:
        unsupported.append(("parallel.zero", p.zero, "ZeRO shards over dp only; with cp > 1 the "
                            "gradients would also need a cp reduction of the shards. Set zero=0"))
    # -- end data parallel / ZeRO ------------------------------------------------------------------
    if cfg.precision.dtype in ("fp16", "fp8"):
        unsupported.append(("precision.dtype", cfg.precision.dtype,
                            "only fp32 and bf16 are implemented; use bf16 on GPUs, fp32 on CPUs"))
    if unsupported:
        raise ConfigError("\n".join(f"{key}={value!r}: {why}." for key, value, why in unsupported))
