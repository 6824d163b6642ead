"""A run that loses a rank goes on by itself: restarted from its last checkpoint, on fewer ranks if
some are gone for good, at the same global batch.

This costs little here because a checkpoint resumes exactly in any layout (checkpoint/) and the
sampler picks a step's sequences from the seed and the step alone (data/sampler.py): a restart in
another dp, with the gradient accumulation raised to keep the batch, trains the same steps.

- Local launcher (`launch.max_restarts`, `launch.min_dp`): launch.spawn_local asks `next_attempt`
  after a failed attempt. A rank whose device is gone (`DeviceLost`, a CUDA "fallen off the bus")
  takes its dp replica out of the next attempt, down to `launch.min_dp`.
- torchrun (`--max-restarts N`, `--nnodes MIN:MAX`): torch's elastic agent restarts the workers and
  re-forms the world across the nodes left (or returned); each worker of a restarted attempt sees
  TORCHELASTIC_RESTART_COUNT > 0 and resumes the newest checkpoint (`resume_on_restart`), at the dp
  its WORLD_SIZE gives (`parallel.dp: auto` with `training.global_batch_size`).

Each restart is a line of `<run>/restarts.jsonl` with its cause. Torch-free.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ultrascale.checkpoint.index import CheckpointError, find_latest, load_meta
from ultrascale.config import Config, ConfigError, build_config
from ultrascale.distributed.recorder import diagnose_dir
from ultrascale.rank_guard import describe_exception

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's; our launcher sets it too
DRILL_ENV = "ULTRASCALE_FAULT_DRILL"
RESTARTS_FILE = "restarts.jsonl"


class DeviceLost(RuntimeError):
    """This rank's device is gone for good: the next attempt runs without its dp replica."""


def attempt() -> int:
    """0 for a first start, n for the n-th restart."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


# ---------------------------------------------------------------------------------------------
# A failed attempt and the next one


@dataclass
class Failure:
    """What ended an attempt, as the launcher saw it."""

    cause: str  # one line
    failed: list[int] = field(default_factory=list)  # ranks that ended badly on their own
    lost: list[int] = field(default_factory=list)  # ranks whose device is gone for good
    restartable: bool = True  # False: a configuration error (it would fail again the same way)


def _resume_setting(cfg: Config) -> str:
    """Where a restart resumes: the newest checkpoint of the run (`auto`; before the first one,
    `auto` starts the same run again from step 0), unless the first attempt began from another
    run's checkpoint and this one has none yet."""
    own = cfg.checkpoint.dir and find_latest(Path(cfg.checkpoint.dir)) is not None
    return "auto" if own or cfg.checkpoint.resume == "none" else cfg.checkpoint.resume


def shrunk(cfg: Config, replicas_lost: int, min_dp: int) -> Config:
    """`cfg` on the dp replicas left, at the same global batch (grad_accum_steps raised): the
    largest dp the rules accept, at least `min_dp`. Raises ConfigError when none is."""
    left = cfg.parallel.dp - replicas_lost
    data = cfg.model_dump(mode="json")
    data["training"]["global_batch_size"] = cfg.global_batch_size
    data["training"].pop("grad_accum_steps")
    reasons = []
    for dp in range(left, min_dp - 1, -1):
        data["parallel"]["dp"] = dp
        if data["parallel"].get("dp_shard") and dp % data["parallel"]["dp_shard"]:
            data["parallel"]["dp_shard"] = None if dp == 1 else data["parallel"]["dp_shard"]
        try:
            return build_config(data)
        except ConfigError as exc:
            reasons.append(f"dp={dp}: {exc}")
    why = f" ({'; '.join(reasons)})" if reasons else ""
    raise ConfigError(f"{replicas_lost} of {cfg.parallel.dp} dp replica(s) lost for good; no dp "
                      f"from {left} down to launch.min_dp={min_dp} keeps the global batch of "
                      f"{cfg.global_batch_size} sequences{why}.")


def lost_replicas(cfg: Config, ranks: list[int], coordinates: list[dict[str, int]]) -> set[int]:
    """The dp coordinates of the replicas that hold `ranks`."""
    return {coordinates[r]["dp"] for r in ranks if r < len(coordinates)}


def next_attempt(cfg: Config, failure: Failure, coordinates: list[dict[str, int]]) -> Config:
    """The configuration of the restart after `failure`: resumed from the newest checkpoint, on
    the replicas left. Raises ConfigError when it cannot go on (with the reason)."""
    data = cfg.model_dump(mode="json")
    data["checkpoint"]["resume"] = _resume_setting(cfg)
    nxt = build_config(data)
    if not failure.lost:
        return nxt
    if cfg.launch.min_dp is None:
        raise ConfigError(f"rank(s) {', '.join(map(str, failure.lost))} lost their device for "
                          "good and launch.min_dp is not set: set launch.min_dp to go on with "
                          "fewer dp replicas.")
    return shrunk(nxt, len(lost_replicas(cfg, failure.lost, coordinates)), cfg.launch.min_dp)


def surviving_devices(visible: list[str], lost: list[int], world: int) -> list[str]:
    """The devices (CUDA_VISIBLE_DEVICES entries, rank r on entry r) of the next attempt's
    `world` ranks: those of the ranks not lost, in order."""
    left = [d for r, d in enumerate(visible) if r not in set(lost)]
    return left[:world]


def log_restart(cfg: Config, number: int, failure: Failure, nxt: Config) -> dict:
    """Append the restart to `<run>/restarts.jsonl`; returns the line written."""
    line = {"restart": number, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cause": failure.cause, "failed_ranks": failure.failed, "lost_ranks": failure.lost,
            "resume": str(find_latest(Path(nxt.checkpoint.dir)) or nxt.checkpoint.resume)
            if nxt.checkpoint.dir else nxt.checkpoint.resume,
            "world_size": nxt.parallel.world_size, "dp": nxt.parallel.dp,
            "grad_accum_steps": nxt.training.grad_accum_steps,
            "global_batch": nxt.global_batch_size, "layout": nxt.layout().short()}
    path = Path(cfg.logging.run_dir) / RESTARTS_FILE
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def read_restarts(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / RESTARTS_FILE
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---------------------------------------------------------------------------------------------
# Under torchrun


def resume_on_restart(cfg: Config) -> Config:
    """A worker of a restarted attempt (torchrun's, or ours) resumes the run's newest checkpoint
    instead of starting over."""
    if attempt() == 0 or cfg.checkpoint.resume == "auto":
        return cfg
    data = cfg.model_dump(mode="json")
    data["checkpoint"]["resume"] = _resume_setting(cfg)
    return build_config(data)


def notes(cfg: Config, launched: bool) -> list[str]:
    """The local launcher's keys said to do nothing under torchrun/srun (torchrun's own flags
    do it there)."""
    if not launched or (not cfg.launch.max_restarts and cfg.launch.min_dp is None):
        return []
    return ["launch.max_restarts and launch.min_dp are the local launcher's: under torchrun, "
            "--max-restarts N and --nnodes MIN:MAX restart and resize the run (docs/faults.md)."]


def check_torchrun_restarts() -> None:
    """Refuse torchrun restarts that would hang: torch's agent shares its rendezvous store with
    the workers by default, and a restarted attempt then reads the failed one's addresses from it
    (pytorch/pytorch#135712; seen with torch 2.13 and gloo)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max-restarts {restarts} with torch's shared rendezvous store: a restarted "
            "attempt would read the failed one's addresses and hang (pytorch/pytorch#135712). "
            "Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (e.g. "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...`; docs/faults.md).")


def _failure_file(cfg: Config, rank: int) -> Path:
    return Path(cfg.logging.run_dir) / "rank_logs" / f"rank_{rank}.failure.json"


def note_torchrun_failure(cfg: Config, exc: BaseException, rank: int) -> None:
    """A torchrun worker's failure, in the run folder for the next attempt's line; a collective
    that timed out is explained from every rank's recorder file first."""
    record = describe_exception(exc)
    if record["kind"] == "collective_timeout":
        lines = diagnose_dir(Path(cfg.logging.run_dir) / "rank_logs", cfg.parallel.world_size)
        for line in lines:
            print(f"rank {rank}: {line}", file=sys.stderr, flush=True)
        record["message"] = lines[0] if lines else record["message"]
    path = _failure_file(cfg, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "rank": rank}))


def log_torchrun_attempt(cfg: Config) -> dict | None:
    """Rank 0 of a torchrun attempt that continues the run after a restart (its failed
    workers' records say why: none when a rank was killed or its node lost) or in another world
    (torch's agent re-formed it: a node left or joined) writes its line; returns it."""
    folder = Path(cfg.logging.run_dir) / "rank_logs"
    files = sorted(folder.glob("rank_*.failure.json"))
    records = [json.loads(p.read_text()) for p in files]
    for p in files:  # consumed: the next attempt's causes are its own
        p.unlink(missing_ok=True)
    latest = find_latest(Path(cfg.checkpoint.dir)) if cfg.checkpoint.dir else None
    try:
        was = load_meta(latest)["world_size"] if latest is not None and \
            cfg.checkpoint.resume == "auto" else cfg.parallel.world_size
    except CheckpointError:  # a damaged newest, which auto passes over (checkpoint/resume.py)
        was = cfg.parallel.world_size
    if not attempt() and was == cfg.parallel.world_size:
        return None
    causes = [f"rank {r['rank']}: {r['type']}: {r['message']}" for r in records[:3]]
    if was != cfg.parallel.world_size:
        causes.append(f"the world changed from {was} to {cfg.parallel.world_size} rank(s) "
                      "(torch's agent re-formed it: a node left or joined)")
    cause = "; ".join(causes) or "no rank left a record: a rank was killed or its node lost " \
        "(torchrun's log names it)"
    return log_restart(cfg, len(read_restarts(Path(cfg.logging.run_dir))) + 1,
                       Failure(cause, [r["rank"] for r in records]), cfg)


# ---------------------------------------------------------------------------------------------
# A fault drill: make a rank fail on purpose, to see the restart work (tests, a new cluster)


@dataclass
class FaultDrill:
    """`ULTRASCALE_FAULT_DRILL=ACTION:rank=R[,R...]:step=S`, in the first attempt of a run that
    did not resume (the trainer drops it on a resume):
    kill    the rank SIGKILLs itself as step S begins (a crash, the out-of-memory killer)
    stall   the rank stops before step S's first collective, for good (a hung rank)
    lose    the rank's device is gone (`DeviceLost`): the replica leaves the run
    """

    action: str
    ranks: tuple[int, ...]
    step: int

    ACTIONS = ("kill", "stall", "lose")

    @classmethod
    def from_env(cls) -> "FaultDrill | None":
        spec = os.environ.get(DRILL_ENV, "").strip()
        if not spec or attempt() > 0:
            return None
        try:
            action, *parts = spec.split(":")
            fields = dict(p.split("=", 1) for p in parts)
            drill = cls(action, tuple(int(r) for r in fields["rank"].split(",")),
                        int(fields["step"]))
        except (ValueError, KeyError):
            drill = None
        if drill is None or drill.action not in cls.ACTIONS:
            raise ConfigError(f"{DRILL_ENV}={spec!r}: write ACTION:rank=R[,R...]:step=S with "
                              f"ACTION one of {', '.join(cls.ACTIONS)} (e.g. kill:rank=1:step=3).")
        return drill

    def strike(self, step: int, rank: int) -> None:
        """Called as each step begins."""
        if step != self.step or rank not in self.ranks:
            return
        print(f"fault drill: rank {rank} {self.action} at step {step}", flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "lose":
            raise DeviceLost(f"fault drill: rank {rank}'s device is gone at step {step}")
        while True:  # stall: until the launcher stops it
            time.sleep(1.0)
