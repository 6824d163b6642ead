"""The whole model's weights from a checkpoint of any layout (for export and generate).

A checkpoint holds each rank's own tensors in the form its layout keeps them (tensor-parallel
slices, pipeline stages, ZeRO's flat shards). Rather than re-implement every layout's format, this
starts the checkpoint's own layout on this machine's CPUs (gloo, one process per rank, as many as
the checkpoint was written by), each rank loads its file as a resumed run would, and the runtime's
`full_state_dict` gathers the plain-model weights (the same code the parity tests hold against one
process); rank 0 writes them to one safetensors file that the caller reads. A checkpoint of replicas
only (one rank, or data parallel without ZeRO) needs none of that: rank 0's file holds the whole
model under its plain names.

Each rank holds what it held in training (its shards of the weights and optimizer state) plus the
gathered weights on rank 0: a checkpoint of a model that fits this machine's memory as a run on
its CPUs does.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ultrascale.config import Config


def checkpoint_config(path: str | Path) -> Config:
    """The configuration a checkpoint was written with, set to run on this machine's CPUs."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no meta.json): give a "
                                "step_XXXXXXXX folder written by `ultrascale train`.")
    data = json.loads(meta_file.read_text())["config"]
    data["device"] = "cpu"
    data["precision"] = {**data.get("precision", {}), "dtype": "fp32"}
    data["training"] = {**data["training"], "compile": False, "kernels": "torch"}
    data["checkpoint"] = {**data["checkpoint"], "resume": "none"}
    return Config.model_validate(data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather(rank: int, world: int, port: int, config: dict, checkpoint: str, out: str) -> None:
    """One rank: build the checkpoint's layout, load its file, gather, rank 0 writes."""
    from ultrascale.checkpoint import load_checkpoint
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel, shutdown
    from ultrascale.models.llama import build_model
    from ultrascale.parallel import parallelize

    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = Config.model_validate(config)
    t = cfg.training
    ctx = init_parallel(cfg, timeout_s=600.0)
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, t.seed), ctx, cfg)
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay)
    _, tensors = load_checkpoint(Path(checkpoint), ctx.rank, rt.checkpoint_source_rank())
    rt.load_local_state(tensors)
    state = rt.full_state_dict()
    if ctx.rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, out)
    if world > 1:
        shutdown()


def plain_state(checkpoint: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(the checkpoint's config, its plain-model weights by name), whatever its layout."""
    cfg = checkpoint_config(checkpoint)
    world, p = cfg.parallel.world_size, cfg.parallel
    if world == p.dp and p.zero == 0 and not cfg.model.num_experts:
        # Replicas only (one rank, or plain data parallel): rank 0's file holds the whole model
        # under its plain names, as a resumed run reads it. Nothing to start.
        tensors = load_file(str(Path(checkpoint) / "rank_00000.safetensors"))
        return cfg, {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "weights.safetensors")
        args = (world, _free_port(), cfg.model_dump(mode="json"), str(checkpoint), out)
        if world == 1:
            _gather(0, *args)
        else:
            import torch.multiprocessing as mp
            mp.start_processes(_gather, args=args, nprocs=world, start_method="spawn")
        return cfg, load_file(out)
