"""Run the `ultrascale` command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A small, fast configuration for CLI tests (the tiny preset, short sequences).
FAST = ["--set", "training.steps=6", "--set", "training.warmup_steps=1",
        "--set", "training.seq_len=32", "--set", "training.micro_batch_size=2",
        "--set", "logging.progress=false", "--set", "logging.sample_tokens=0",
        "--set", "device=cpu"]


# A sitecustomize that hides the packages only requirements-test.txt installs (scipy, pytest,
# transformers, ...): a command run with it sees what `pip install -r requirements.txt` gives.
RUNTIME_ONLY = Path(__file__).resolve().parent / "runtime_only"


def runtime_only_env(base: dict | None = None) -> dict:
    """`base` (default: this process's environment) with the test-only packages hidden, in this
    process's children and theirs (the ranks)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(RUNTIME_ONLY)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    return env


def ultrascale(*args: str, cwd=None, timeout: float = 300, env: dict | None = None,
               launcher: list[str] | None = None,
               runtime_only: bool = False) -> subprocess.CompletedProcess:
    """`ultrascale ARGS` in a subprocess; runtime_only: with requirements.txt's packages alone."""
    cmd = (launcher or [sys.executable, "-m", "ultrascale.cli"]) + list(args)
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    if runtime_only:
        full_env = runtime_only_env(full_env)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
