"""The one device mesh that owns every process group.

Dimensions, outermost to innermost: pp, dp, cp, tp. tp is innermost so its ranks are neighbours
(same node, fastest links); pp is outermost because it sends the least.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ultrascale.config import Config

MESH_DIMS = ("pp", "dp", "cp", "tp")
# Sub-dimensions of dp for hybrid sharding; without it dp_shard is dp and dp_replicate is 1.
HYBRID_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class ParallelContext:
    """Where this process sits: its device, its mesh and its coordinate on each dimension."""

    mesh: DeviceMesh | None
    device: torch.device
    rank: int
    world_size: int
    sizes: dict[str, int]
    # Hybrid sharding (parallel.dp_shard < dp): dp split into (dp_replicate, dp_shard), dp_shard
    # inner (neighbouring ranks). A second mesh of the same ranks owns those two groups.
    hybrid_mesh: DeviceMesh | None = None

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def _mesh_of(self, dim: str) -> DeviceMesh | None:
        if dim in HYBRID_DIMS:
            return self.hybrid_mesh if self.hybrid_mesh is not None else (
                self.mesh if dim == "dp_shard" else None)
        return self.mesh

    def coord(self, dim: str) -> int:
        """This rank's index along `dim` (0 when the dimension has size 1 or there is no mesh)."""
        mesh = self._mesh_of(dim)
        if mesh is None or self.sizes[dim] == 1:
            return 0
        return mesh.get_local_rank("dp" if mesh is self.mesh and dim == "dp_shard" else dim)

    def group(self, dim: str):
        """The process group of a mesh dimension; "world" (or no mesh) is the default group."""
        mesh = self._mesh_of(dim)
        if mesh is None or dim == "world":
            return None
        return mesh.get_group("dp" if mesh is self.mesh and dim == "dp_shard" else dim)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda was asked for but CUDA is not available; use "
                               "device=cpu or device=auto.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_parallel(cfg: Config, timeout_s: float = 600.0) -> ParallelContext:
    """Join the process group (if launched distributed) and build the mesh of `cfg.parallel`.

    Expects the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when the world
    has more than one rank; a single process runs without any process group.
    """
    p = cfg.parallel
    sizes = {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp}
    shard = p.dp_shard or p.dp
    sizes.update(dp_replicate=p.dp // shard, dp_shard=shard)
    device = resolve_device(cfg.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != p.world_size:
        raise WorldSizeError(world, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return ParallelContext(None, device, 0, 1, sizes)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device.type, tuple(sizes[d] for d in MESH_DIMS),
                            mesh_dim_names=MESH_DIMS)
    hybrid = None
    if shard < p.dp:  # same ranks, dp unflattened as (dp_replicate, dp_shard)
        ranks = mesh.mesh.reshape(p.pp, p.dp // shard, shard, p.cp, p.tp)
        hybrid = DeviceMesh(device.type, ranks,
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return ParallelContext(mesh, device, dist.get_rank(), dist.get_world_size(), sizes, hybrid)


class WorldSizeError(RuntimeError):
    def __init__(self, world: int, cfg: Config):
        p = cfg.parallel
        super().__init__(
            f"The launcher started {world} process(es) but the layout needs parallel.dp x tp x pp "
            f"x cp = {p.dp} x {p.tp} x {p.pp} x {p.cp} = {p.world_size}. Start {p.world_size} "
            f"processes (e.g. torchrun --nproc-per-node {p.world_size}), or change the layout so "
            f"its product is {world}."
        )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
