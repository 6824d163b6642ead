"""Start the ranks: run as one rank under torchrun/srun, or start `dp*tp*pp*cp` local ranks with
our own launcher (supervisor.py: one process per rank, a log each, watched until they end).

Before anything starts: the paths of the run are fixed (its compute dtype, `precision.dtype:
auto`, was fixed when the config was validated), every check runs (preflight.py), and the run
folder gets `config.yaml` (the resolved tree) and `layout.yaml` (the mesh and each rank's place
in it).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import yaml

from ultrascale import elastic
from ultrascale.config import Config, ConfigError, build_config
from ultrascale.devices import cuda_device_count, gpu_driver_present, local_cores, uses_cuda
from ultrascale.preflight import Report, preflight  # noqa: F401  (preflight: API)
from ultrascale.rank_guard import guard_rank, record_failure  # noqa: F401  (guard_rank: API)

SPAWNED_ENV = "ULTRASCALE_SPAWNED"  # set for ranks started by our own local launcher
# Collective timeouts when launch.collective_timeout_s is not given: a local run's ranks share one
# machine, so a wait of minutes means one is stuck; a cluster's first steps may wait on slow nodes.
LOCAL_COLLECTIVE_TIMEOUT_S = 300.0
CLUSTER_COLLECTIVE_TIMEOUT_S = 600.0
# The device mesh's order, outermost to innermost (distributed/mesh.py `atomic_dims`, where dp may
# be carved into two parts of the same span; a test keeps the two equal): tp innermost.
MESH_ORDER = ("pp", "dp", "cp", "tp")


def adopt_slurm_env() -> None:
    """Under plain `srun` (no torchrun) take the rank from Slurm's variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "SLURM_NTASKS_PER_NODE" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0]
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("Running under srun without torchrun needs MASTER_ADDR and MASTER_PORT "
                          "in the environment (e.g. the first host of $SLURM_JOB_NODELIST); or run "
                          "`srun torchrun ... -m ultrascale.cli train`.")


def is_launched_rank() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_spawned_rank() -> bool:
    return bool(os.environ.get(SPAWNED_ENV))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launcher_world_size() -> int | None:
    """The world size `parallel.dp: auto` divides: WORLD_SIZE under torchrun/srun, otherwise the
    GPUs of this machine (None on a machine without any)."""
    if is_launched_rank():
        return int(os.environ["WORLD_SIZE"])
    if not gpu_driver_present():
        return None
    return cuda_device_count() or None


def check_world_size(cfg: Config) -> None:
    """Under torchrun/srun: the processes started against the layout, before anything else."""
    if not is_launched_rank() or is_spawned_rank():
        return
    world, p = int(os.environ["WORLD_SIZE"]), cfg.parallel
    if world != p.world_size:
        raise ConfigError(
            f"The launcher started {world} process(es) but the layout needs parallel.dp x tp x pp "
            f"x cp = {p.dp} x {p.tp} x {p.pp} x {p.cp} = {p.world_size}. Start {p.world_size} "
            f"processes (e.g. torchrun --nproc-per-node {p.world_size}), change the layout so its "
            f"product is {world}, or set parallel.dp=auto.")


def _run_name() -> str:
    """A fresh run folder's name. Ranks under torchrun/srun resolve it each on its own, so it must
    come out the same on all: the job's id where there is one."""
    if is_launched_rank() and not is_spawned_rank():
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            return f"slurm-{job}" + (f".{os.environ['SLURM_STEP_ID']}"
                                     if os.environ.get("SLURM_STEP_ID") else "")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id != "none":
            return f"torchrun-{run_id}"
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def resolve_paths(cfg: Config) -> Config:
    """Fill the output paths (each fresh run gets its own folder, so nothing is overwritten) and
    the collective timeout."""
    data = cfg.model_dump(mode="json")
    log, ck = data["logging"], data["checkpoint"]
    if not ck["dir"] and not log["run_dir"] and ck["resume"] == "auto":
        # A fresh run folder has no checkpoint: say where to look instead of starting over.
        raise ConfigError("checkpoint.resume=auto needs the run to continue: set logging.run_dir "
                          "to its folder (its checkpoints/ is searched) or checkpoint.dir to the "
                          "folder of checkpoints (e.g. runs/<run>/checkpoints).")
    if not log["run_dir"]:
        name = _run_name()
        run_dir = Path("runs") / name
        n = 1
        while run_dir.exists() and not is_launched_rank():
            n += 1
            run_dir = Path("runs") / f"{name}-{n}"
        log["run_dir"] = str(run_dir)
    if not log["metrics_file"]:
        log["metrics_file"] = str(Path(log["run_dir"]) / "metrics.jsonl")
    if not ck["dir"]:
        ck["dir"] = str(Path(log["run_dir"]) / "checkpoints")
    if data["launch"]["collective_timeout_s"] is None:
        local = not is_launched_rank() or is_spawned_rank()
        data["launch"]["collective_timeout_s"] = (LOCAL_COLLECTIVE_TIMEOUT_S if local
                                                  else CLUSTER_COLLECTIVE_TIMEOUT_S)
    return build_config(data)


def rank_coordinates(cfg: Config) -> list[dict[str, int]]:
    """Each rank's coordinate on every mesh dimension (row-major over MESH_ORDER)."""
    sizes = {"pp": cfg.parallel.pp, "dp": cfg.parallel.dp, "cp": cfg.parallel.cp,
             "tp": cfg.parallel.tp}
    out = []
    for r in range(cfg.parallel.world_size):
        coord, rest = {}, r
        for dim in reversed(MESH_ORDER):
            rest, coord[dim] = divmod(rest, sizes[dim])
        out.append({d: coord[d] for d in MESH_ORDER})
    return out


def layout_record(cfg: Config) -> dict:
    p = cfg.parallel
    return {
        "layout": cfg.layout().short(),
        "world_size": p.world_size,
        "mesh": {d: getattr(p, d) for d in MESH_ORDER},
        "mesh_order": "outermost to innermost; tp ranks are neighbours",
        "zero": p.zero,
        "global_batch": {"sequences": cfg.global_batch_size,
                         "tokens": cfg.global_batch_size * cfg.training.seq_len},
        "ranks": {r: c for r, c in enumerate(rank_coordinates(cfg))},
    }


def write_run_files(cfg: Config) -> Path:
    """config.yaml (what the ranks read back) and layout.yaml in the run folder."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    (run_dir / "layout.yaml").write_text(yaml.safe_dump(layout_record(cfg), sort_keys=False,
                                                        default_flow_style=None))
    return run_dir / "config.yaml"


def threads_per_rank(world: int) -> int:
    return max(1, local_cores() // world)


def changed_settings(cfg: Config) -> list[str]:
    """`key: value` of every setting that differs from the defaults of its model (the preset or
    Hugging Face folder it names, whose own values are defaults too), in the tree's order."""
    from ultrascale.checkpoint.resume import flatten

    source = {k: v for k, v in cfg.model.model_dump(mode="json").items()
              if k in ("preset", "from_hf", "hf_config")}
    try:
        base = flatten(build_config({"model": source}).model_dump(mode="json"))
    except ConfigError:  # (a model of shape keys alone: every key of it is the user's)
        base = flatten(build_config({}).model_dump(mode="json"))
    now = flatten(cfg.model_dump(mode="json"))
    return [f"{k}: {_text(v)}" for k, v in now.items() if base.get(k, object()) != v]


def _text(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def describe(cfg: Config, report: Report, local_ranks: int, launched: bool) -> str:
    """What is about to run: the settings that differ from the defaults (the whole tree goes to
    the run folder's config.yaml), the layout, the memory estimate, the ranks."""
    p = cfg.parallel
    changed = changed_settings(cfg)
    lines = [f"ultrascale train: {cfg.model.preset or cfg.model.from_hf or 'custom'} model, "
             f"{len(changed)} setting(s) differ from its defaults:"] + [
             f"  {line}" for line in changed] + [
             f"(every setting: {Path(cfg.logging.run_dir) / 'config.yaml'}, written at launch; "
             "defaults and meanings: `ultrascale config keys`)", "",
             f"layout: {cfg.layout().short()} on {p.world_size} rank(s) (mesh pp x dp x "
             f"cp x tp = {p.pp} x {p.dp} x {p.cp} x {p.tp}, tp innermost)",
             f"global batch: {cfg.global_batch_size} sequences x {cfg.training.seq_len} tokens = "
             f"{cfg.global_batch_size * cfg.training.seq_len:,} tokens",
             f"precision: {cfg.precision.summary()}",
             "attention: " + ("SDPA's fastest kernel for this shape (cuDNN, flash or "
                              "memory-efficient), measured on the GPU at start and cached; rank "
                              "0's log and the first metrics record name it"
                              if report.device != "cpu" else
                              "PyTorch's fused CPU kernel (SDPA), in fp32")]
    if report.data_line:
        lines.append(report.data_line)
    if report.memory_line:
        lines.append(f"memory: {report.memory_line}")
    if report.resume_line:
        lines.append(report.resume_line)
    if launched:
        lines.append(f"ranks: this process is rank {rank()} of {p.world_size} (started by "
                     "torchrun/srun)")
    else:
        threads = os.environ.get("OMP_NUM_THREADS") or threads_per_rank(local_ranks)
        lines.append(f"ranks: {local_ranks} local process(es), rank 0..{local_ranks - 1} on "
                     f"{report.device}, {threads} thread(s) each; output in "
                     f"{cfg.logging.run_dir}/rank_logs/rank_N.log")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def spawn_local(cfg: Config, report: Report | None = None) -> int:
    """Start world_size local ranks with our launcher (supervisor.LocalRanks) and wait for them;
    after a failure start them again from the last checkpoint, up to launch.max_restarts times,
    without the replicas whose device is gone (elastic.py)."""
    from ultrascale.supervisor import LocalRanks

    env = dict(os.environ)
    env[SPAWNED_ENV] = "1"
    # Share the cores between ranks instead of letting each rank start one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(cfg.parallel.world_size)))
    restart, most = 0, cfg.launch.max_restarts
    while True:
        config_file = write_run_files(cfg)
        cmd = [sys.executable, "-m", "ultrascale.cli", "train", str(config_file)]
        ranks = LocalRanks(cmd, cfg.parallel.world_size, Path(cfg.logging.run_dir) / "rank_logs",
                           env, collective_timeout_s=cfg.launch.collective_timeout_s,
                           memory_line=report.memory_line if report else "",
                           save_on_signal_s=cfg.checkpoint.save_on_signal_s, attempt=restart)
        code = ranks.run()
        failure = ranks.failure
        if code == 0 or failure is None or not failure.restartable or not most:
            return code
        if restart == most:
            print(f"error: no restart left (launch.max_restarts={most}, all used)",
                  file=sys.stderr)
            return code
        try:
            nxt = elastic.next_attempt(cfg, failure, rank_coordinates(cfg))
        except ConfigError as exc:
            print(f"error: no restart: {exc}", file=sys.stderr)
            return code
        restart += 1
        line = elastic.log_restart(cfg, restart, failure, nxt)
        print(f"restart {restart} of {most}: {failure.cause}; from {line['resume']} on "
              f"{nxt.parallel.world_size} rank(s), {nxt.layout().short()} (logged in "
              f"{Path(cfg.logging.run_dir) / elastic.RESTARTS_FILE})", file=sys.stderr, flush=True)
        if failure.lost and uses_cuda(cfg.device):  # the next ranks on the devices left
            visible = env.get("CUDA_VISIBLE_DEVICES") or ",".join(
                map(str, range(cuda_device_count())))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(elastic.surviving_devices(
                visible.split(","), failure.lost, nxt.parallel.world_size))
        cfg = nxt


def nccl_flight_recorder(cfg: Config) -> None:
    """On GPUs, NCCL's flight recorder: each rank keeps its last collectives (torch's ring
    buffer) and dumps them to `<run>/nccl_trace/rank_N` when its watchdog times one out (read
    them with `python -m torch.distributed.flight_recorder.fr_trace <run>/nccl_trace`). Set before
    the process group starts; a user's own settings win."""
    if not uses_cuda(cfg.device):
        return
    folder = Path(cfg.logging.run_dir) / "nccl_trace"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "rank_"))


def run_rank(cfg: Config) -> int:
    """Train as this rank. Under our launcher a failure is recorded for it (rank_guard) and the
    process ends at once; under torchrun, torch's `record` writes its error file, and ours goes
    to the run folder for the restart that may follow (elastic.py)."""
    nccl_flight_recorder(cfg)
    if is_spawned_rank():
        import socket
        place = ", ".join(f"{d} {c}" for d, c in rank_coordinates(cfg)[rank()].items())
        print(f"rank {rank()} of {cfg.parallel.world_size} ({place}): pid {os.getpid()} on "
              f"{socket.gethostname()}", flush=True)
        try:
            code = _train_and_report(cfg)
            print(f"rank {rank()}: finished", flush=True)
            _leave(code)
        except KeyboardInterrupt:  # a signal that could not wait for the step's end
            _say_stopped(cfg, None)
            os._exit(130)  # (no graceful shutdown: a peer may be in a collective)
        except BaseException as exc:  # noqa: BLE001  (recorded, then the process ends)
            record_failure(exc, rank())
            sys.stdout.flush()
            # No graceful shutdown: a peer may be stuck in a collective that would never return.
            os._exit(1)
    from torch.distributed.elastic.multiprocessing.errors import record

    if rank() == 0:  # a restart, or the agent's new world: its line in restarts.jsonl
        elastic.log_torchrun_attempt(cfg)
    try:
        return record(_train_and_report)(cfg)
    except BaseException as exc:
        elastic.note_torchrun_failure(cfg, exc, rank())
        raise


def _leave(code: int) -> None:
    """End a spawned rank that has finished: its checkpoint committed, its files closed, its
    process group destroyed. The interpreter's teardown is skipped: there the communication
    stack's C++ objects could abort a process that had finished ("terminate called without an
    active exception" after rank 1's `finished` line, gloo on torch 2.13, one run in hundreds),
    and the launcher would report a finished run as failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train_and_report(cfg: Config) -> int:
    from ultrascale.distributed.mesh import WorldSizeError, shutdown
    from ultrascale.train.oom import OutOfMemoryWatch
    from ultrascale.train.progress import tell
    from ultrascale.train.trainer import ResumeError, train

    watch = OutOfMemoryWatch(cfg, rank())
    try:
        with watch.watching():
            result = train(cfg, oom_watch=watch)
    except (WorldSizeError, ResumeError, ConfigError) as exc:
        if is_spawned_rank():
            record_failure(exc, rank(), kind="config")
            os._exit(2)
        shutdown()
        if rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        if not is_spawned_rank():  # ours ends at once (run_rank): a peer may never answer
            shutdown()
        raise
    shutdown()
    if result.interrupted:
        _say_stopped(cfg, result)
        return 128 + int(result.interrupted)
    if rank() == 0:
        lines = []
        if result.losses:
            lines.append(f"done: {len(result.losses)} steps, loss {result.losses[0]:.3f} -> "
                         f"{result.losses[-1]:.3f}")
        elif result.resumed_from is not None:
            lines.append(f"nothing to do: {result.resumed_from} is already at training.steps="
                         f"{cfg.training.steps}; raise training.steps to train further.")
        if result.sample is not None:
            lines += ["sample:", result.sample]
        lines += [f"metrics:    {result.metrics_file}", f"checkpoint: {result.checkpoint}",
                  f"run folder: {cfg.logging.run_dir}"]
        tell("\n".join(lines))
    return 0


def resume_command(cfg: Config) -> str:
    """The command that continues this run from its newest checkpoint."""
    return (f"ultrascale train {Path(cfg.logging.run_dir) / 'config.yaml'} "
            "--set checkpoint.resume=auto")


def _say_stopped(cfg: Config, result) -> None:
    """Rank 0 says where a run stopped by a signal is saved and how to continue it."""
    if rank() != 0:
        return
    import signal

    from ultrascale.checkpoint.index import find_latest
    from ultrascale.train.progress import tell

    if result is not None:
        name = signal.Signals(result.interrupted).name
        step = result.steps[-1] if result.steps else None
        saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint " \
            "(checkpoint.dir is not set)"
        head = f"stopped by {name} after step {step}: {saved}."
    else:
        latest = find_latest(Path(cfg.checkpoint.dir)) if cfg.checkpoint.dir else None
        head = ("stopped at once by a signal (the step in progress would not end within "
                f"checkpoint.save_on_signal_s={cfg.checkpoint.save_on_signal_s:g} s, or a second "
                f"signal came): nothing saved since {latest or 'the start (no checkpoint yet)'}.")
    tell(f"{head}\nresume with: {resume_command(cfg)}")
