"""Run the `ultrascale` command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

# A small, fast configuration for CLI tests (the tiny preset, short sequences).
FAST = ["--set", "training.steps=6", "--set", "training.warmup_steps=1",
        "--set", "training.seq_len=32", "--set", "training.micro_batch_size=2",
        "--set", "logging.progress=false", "--set", "logging.sample_tokens=0",
        "--set", "device=cpu"]


def ultrascale(*args: str, cwd=None, timeout: float = 300, env: dict | None = None,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable, "-m", "ultrascale.cli"]) + list(args)
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
