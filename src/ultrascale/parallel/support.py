"""What the engine can run: `check_supported(cfg)` refuses, before any process starts, the
combinations that are not implemented, naming the key, the value and what to do instead.

The rules are the rules package's (`engine_violations`: the pipeline schedules' conditions, then the gaps
in `ENGINE_GAPS`), which the planner also asks so that it ranks only what runs here. Needs no torch,
so the launcher and the prediction tools can call it cheaply.
"""

from __future__ import annotations

from ultrascale.config import Config, ConfigError
from ultrascale.kernels import triton_usable
from ultrascale.rules import engine_violations


def check_supported(cfg: Config) -> None:
    """Raise ConfigError for settings the engine cannot run yet (never fall back silently)."""
    # The engine runs every dtype (its precision rules are the config's): `auto` needs no
    # resolving here.
    refused = engine_violations(cfg.model, cfg.layout())
    if refused:
        raise ConfigError("\n".join(v.line() for v in refused))
    if cfg.training.kernels == "triton":
        # Where the device is known here; an `auto` device that turns out to be a CPU is refused
        # by the rank itself (parallel/kernels.py), with the same message.
        usable, why = triton_usable("cpu" if cfg.device == "cpu" else "cuda")
        if not usable:
            raise ConfigError(f"training.kernels=triton: {why}. Use training.kernels=auto or "
                              "torch.")
