"""A torchrun job that grows back (issue 49): two elastic agents on this machine stand in for two
nodes (`--nnodes 1:2`). Agent A starts alone and trains at dp1; agent B joins a few steps later;
torch's agent re-forms the world and the workers resume the newest checkpoint at dp2, with the
gradient accumulation halved to keep the global batch. The losses must equal one process's.

    python benchmarks/elastic_grow_back.py            # 3.5 minutes on a loaded 2-core machine
    python benchmarks/elastic_grow_back.py --smoke    # 8 steps, A waits at step 5 until B joins

Prints the restart's line, the world each checkpointed step ran in and the largest relative
difference from an uninterrupted run (fp32: at most ~1e-6; seen here: 4e-8). Fails (exit 1) when
the world did not grow from 1 rank to 2 mid-run, a step is missing, or the losses part.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ultrascale.checkpoint.index import load_meta
from ultrascale.config import build_config
from ultrascale.elastic import DRILL_ENV
from ultrascale.train.trainer import train

STEPS = 40
SMOKE_STEPS, SMOKE_STALL = 8, 5
SETTINGS = [f"training.steps={STEPS}", "training.warmup_steps=1", "training.seq_len=32",
            "training.micro_batch_size=2", "logging.progress=false", "logging.sample_tokens=0",
            "device=cpu", "precision.dtype=fp32", "logging.every=1"]


def free_port() -> int:
    """A port for this run's rendezvous (a fixed one would join a concurrent run's agents)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(folder: Path, log: Path, settings: list[str], port: int,
          drill: str = "") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", f"grow{port}", "--max-restarts", "3",
           "--rdzv-conf", "last_call_timeout=2,join_timeout=60", "-m", "ultrascale.cli", "train"]
    for s in settings + ["checkpoint.every=2", "checkpoint.keep=50", "logging.run_dir=run",
                         "parallel.dp=auto", "training.global_batch_size=8",
                         "checkpoint.resume=auto"]:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop(DRILL_ENV, None)
    if drill:
        env[DRILL_ENV] = drill
    # its own session: a failed run stops the agent and its workers together
    return subprocess.Popen(cmd, cwd=folder, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def wait_for(agents: dict[str, subprocess.Popen], done, deadline: float) -> str | None:
    """Poll until `done()`; the reason it cannot happen (an agent failed, the deadline passed)."""
    while not done():
        for name, proc in agents.items():
            if proc.poll() not in (None, 0):
                return f"agent {name} failed (exit {proc.returncode})"
        if time.monotonic() > deadline:
            return "the deadline passed"
        time.sleep(0.2)
    return None


def stop(agents: dict[str, subprocess.Popen]) -> None:
    for proc in agents.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in agents.values():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def worlds(run: Path) -> dict[int, int]:
    """Checkpointed step -> the world size that wrote it."""
    return {int(p.name.split("_")[-1]): load_meta(p)["world_size"]
            for p in sorted((run / "checkpoints").glob("step_*"))}


def grown(run: Path, steps: int) -> list[str]:
    """What shows that the world did not grow from 1 to 2 mid-run (empty: it did)."""
    problems = []
    written = worlds(run)
    if set(written.values()) != {1, 2} or written.get(steps) != 2:
        problems.append(f"checkpoints' worlds {written}: expected 1 rank first, 2 at the end")
    lines = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()] \
        if (run / "restarts.jsonl").is_file() else []
    if not any("world changed from 1 to 2" in x["cause"] and x["dp"] == 2 for x in lines):
        problems.append(f"no restart line says the world changed from 1 to 2: {lines}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help=f"{SMOKE_STEPS} steps, A waiting at step {SMOKE_STALL} for B")
    smoke = ap.parse_args(argv).smoke
    steps = SMOKE_STEPS if smoke else STEPS
    settings = [s for s in SETTINGS if not s.startswith("training.steps=")]
    settings.append(f"training.steps={steps}")
    folder = Path(tempfile.mkdtemp(prefix="grow_back_"))
    run, deadline = folder / "run", time.monotonic() + (300 if smoke else 900)
    metrics = run / "metrics.jsonl"
    # Smoke: A's worker stalls as step SMOKE_STALL begins (after step 4's checkpoint) until its
    # agent re-forms the world for B, so B always joins mid-run however slowly it starts. The
    # timed run lets A train on while B starts: a join at whatever step it comes.
    port = free_port()
    agents = {"A": agent(folder, folder / "a.log", settings, port,
                         f"stall:rank=0:step={SMOKE_STALL}" if smoke else "")}
    if smoke:
        ready = lambda: f"stall at step {SMOKE_STALL}" in (folder / "a.log").read_text()  # noqa
    else:
        ready = lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 6  # noqa
    why = wait_for(agents, ready, deadline)
    if why is None:
        agents["B"] = agent(folder, folder / "b.log", settings, port)
        why = wait_for(agents, lambda: all(p.poll() == 0 for p in agents.values()), deadline)
    stop(agents)
    if why is not None:
        print(f"error: {why}; the agents' logs: {folder}/a.log, b.log")
        return 1
    problems = grown(run, steps)
    if problems:
        print("error: the world did not grow back: " + "; ".join(problems) + f" ({folder})")
        return 1
    logged = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        logged[record["step"]] = record
    reference = train(build_config({}, settings + ["parallel.dp=1",
                                                   "training.grad_accum_steps=4"]),
                      generate_sample=False)
    worst = max(abs(logged[s]["loss"] - reference.losses[s - 1]) / reference.losses[s - 1]
                for s in logged)
    print((run / "restarts.jsonl").read_text().strip())
    print("world size by checkpointed step: " + ", ".join(f"{s}: {w}"
                                                          for s, w in worlds(run).items()))
    print(f"steps logged: {sorted(logged) == list(range(1, steps + 1))} ({len(logged)} of "
          f"{steps}); largest relative loss difference from one process: {worst:.1e}")
    return 0 if worst < 1e-5 and sorted(logged) == list(range(1, steps + 1)) else 1


if __name__ == "__main__":
    sys.exit(main())
