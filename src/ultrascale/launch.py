"""Start the ranks: run as one rank under torchrun/srun, or spawn `dp*tp*pp*cp` local ranks through
torch's own launcher (`torch.distributed.run`), which stops every rank when one fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from ultrascale.config import Config, ConfigError, build_config
from ultrascale.data.tokenizers import load_tokenizer
from ultrascale.parallel import check_supported

SPAWNED_ENV = "ULTRASCALE_SPAWNED"  # set for ranks started by our own local launcher


def adopt_slurm_env() -> None:
    """Under plain `srun` (no torchrun) take the rank from Slurm's variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("Running under srun without torchrun needs MASTER_ADDR and MASTER_PORT "
                          "in the environment (e.g. the first host of $SLURM_JOB_NODELIST); or run "
                          "`srun torchrun ... -m ultrascale.cli train`.")


def is_launched_rank() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_paths(cfg: Config) -> Config:
    """Fill the output paths: each fresh run gets its own folder, so nothing is overwritten."""
    data = cfg.model_dump(mode="json")
    log, ck = data["logging"], data["checkpoint"]
    if not ck["dir"] and not log["run_dir"] and ck["resume"] == "auto":
        # A fresh run folder has no checkpoint: say where to look instead of starting over.
        raise ConfigError("checkpoint.resume=auto needs the run to continue: set logging.run_dir "
                          "to its folder (its checkpoints/ is searched) or checkpoint.dir to the "
                          "folder of checkpoints (e.g. runs/<run>/checkpoints).")
    if not log["run_dir"]:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_dir = Path("runs") / stamp
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = Path("runs") / f"{stamp}-{n}"
        log["run_dir"] = str(run_dir)
    if not log["metrics_file"]:
        log["metrics_file"] = str(Path(log["run_dir"]) / "metrics.jsonl")
    if not ck["dir"]:
        ck["dir"] = str(Path(log["run_dir"]) / "checkpoints")
    return build_config(data)


def preflight(cfg: Config) -> None:
    """Checks that need the file system, done once before any process starts."""
    check_supported(cfg)
    src = cfg.data.source
    if src != "builtin" and not Path(src).exists():
        raise ConfigError(f"data.source={src!r} does not exist. Give a text/JSON-lines file, a "
                          "folder of them, a .bin from `ultrascale tokenize`, or data.source=builtin.")
    if src.endswith(".bin") and not Path(src + ".json").is_file():
        raise ConfigError(f"data.source={src!r} has no sidecar {Path(src).name}.json; write "
                          "pre-tokenized data with `ultrascale tokenize`.")
    try:
        tok = load_tokenizer(cfg.data.tokenizer)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}.")
    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not (Path(resume) / "meta.json").is_file():
        raise ConfigError(f"checkpoint.resume={resume!r} is not a checkpoint folder (no "
                          "meta.json). Give a step_XXXXXXXX folder, or checkpoint.resume=auto.")
    if cfg.logging.tensorboard:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package: "
                              "pip install tensorboard (or pip install -e '.[tensorboard]').")
    if cfg.logging.wandb:
        raise ConfigError("logging.wandb=true: Weights & Biases logging is not implemented; use "
                          "the metrics file (logging.metrics_file) or logging.tensorboard=true.")
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible; use device=auto or cpu.")


def spawn_local(cfg: Config) -> int:
    """Start world_size local ranks with torch.distributed.run on this machine."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    config_file.write_text(cfg.to_yaml())
    n = cfg.parallel.world_size
    env = dict(os.environ)
    env[SPAWNED_ENV] = "1"
    # Share the cores between ranks instead of letting each rank start one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "--log-dir", str(run_dir / "rank_logs"), "-m", "ultrascale.cli", "train",
           str(config_file)]
    return subprocess.call(cmd, env=env)


@record  # on failure, torchrun shows this rank's traceback as the root cause
def run_rank(cfg: Config) -> int:
    from rich.console import Console

    from ultrascale.distributed.mesh import WorldSizeError, shutdown
    from ultrascale.train.trainer import ResumeError, train

    try:
        result = train(cfg)
    except (WorldSizeError, ResumeError, ConfigError) as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        console = Console()
        first, last = result.losses[0] if result.losses else None, \
            result.losses[-1] if result.losses else None
        if result.losses:
            console.print(f"[bold]done[/]: {len(result.losses)} steps, loss {first:.3f} -> {last:.3f}")
        elif result.resumed_from is not None:
            console.print(f"nothing to do: {result.resumed_from} is already at training.steps="
                          f"{cfg.training.steps}; raise training.steps to train further.")
        if result.sample is not None:
            console.print("[bold]sample[/]:")
            console.print(result.sample, markup=False, highlight=False)
        console.print(f"metrics:    {result.metrics_file}")
        console.print(f"checkpoint: {result.checkpoint}")
        console.print(f"run folder: {cfg.logging.run_dir}")
    return 0
