"""The one device mesh that owns every process group, served as named views.

Atomic dimensions, outermost to innermost: pp, the data-parallel parts, cp, tp. tp is innermost so
its ranks are neighbours (same node, fastest links); pp is outermost because it sends the least.
Data parallel is one dimension `dp`, or two when it is carved:

    hybrid sharding   dp = dp_replicate x dp_shard   (ZeRO shards inside dp_shard)
    expert parallel   dp = edp x ep                  (experts are split over ep)
    both              dp = dp_replicate x edp_shard x ep, dp_shard = edp_shard x ep,
                      edp = dp_replicate x edp_shard (an expert's ZeRO shards over edp_shard,
                      its replicas across dp_replicate, as torchtitan's HSDP with ep)

Views flatten several atomic dimensions into one group (after torchtitan's `build_mesh`):
`dp` (when carved), `dp_cp` (gradients of dense weights are summed over every rank that saw other
tokens: data and context parallel), `dp_shard_cp` (hybrid ZeRO's shard group), `edp_cp` (expert
weights). Code asks for a view by name; nothing indexes the mesh by position.

Where parameters live (split over tp or ep, two pipeline copies of a tied embedding) is recorded
by the strategies in `placements`, by plain-model name; `replicas(name)` and `grad_dim(name)`
answer from it for the gradient norm, the buckets, ZeRO and checkpoints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ultrascale.config import Config


@dataclass
class Placement:
    """How one parameter is laid out across the mesh."""

    sharded: tuple[str, ...] = ()  # atomic dims it is split over ("tp", "ep")
    copies: int = 1  # identical copies besides the mesh replicas (a tied embedding on 2 stages)
    expert: bool = False  # an expert weight: replicated over edp (x cp), not all of dp


def atomic_dims(cfg: Config) -> list[tuple[str, int]]:
    """(name, size) of the mesh's atomic dimensions, outermost first."""
    p = cfg.parallel
    shard = p.dp_shard or p.dp
    if shard < p.dp and p.ep > 1:
        dp = [("dp_replicate", p.dp // shard), ("edp_shard", shard // p.ep), ("ep", p.ep)]
    elif shard < p.dp:
        dp = [("dp_replicate", p.dp // shard), ("dp_shard", shard)]
    elif p.ep > 1:
        dp = [("edp", p.dp // p.ep), ("ep", p.ep)]
    else:
        dp = [("dp", p.dp)]
    return [("pp", p.pp), *dp, ("cp", p.cp), ("tp", p.tp)]


def view_dims(atomic: list[str]) -> dict[str, tuple[str, ...]]:
    """Every named view and the atomic dimensions it flattens, for a mesh of `atomic` dims."""
    dp_parts = tuple(d for d in atomic if d not in ("pp", "cp", "tp"))
    views = {d: (d,) for d in atomic}
    views["dp"] = dp_parts
    views["dp_cp"] = dp_parts + ("cp",)
    # Aliases, so that code asks the same names whatever the carving.
    if "edp_shard" in atomic:  # hybrid sharding with expert parallel
        views["dp_shard"] = ("edp_shard", "ep")
        views["edp"] = ("dp_replicate", "edp_shard")
    views.setdefault("dp_shard", views["dp"] if "dp_replicate" not in atomic else ("dp_shard",))
    views.setdefault("dp_replicate", ())
    views["dp_shard_cp"] = views["dp_shard"] + ("cp",)
    views.setdefault("edp", views["dp"] if "ep" not in atomic else ("edp",))
    views.setdefault("ep", ())
    views["edp_cp"] = views["edp"] + ("cp",)
    # The group an expert weight's ZeRO shards span under hybrid sharding (elsewhere unused).
    views.setdefault("edp_shard", ())
    views["edp_shard_cp"] = views["edp_shard"] + ("cp",)
    return views


@dataclass
class ParallelContext:
    """Where this process sits: its device, the mesh, its coordinate on each named view."""

    device: torch.device
    rank: int
    world_size: int
    sizes: dict[str, int]  # every view's size ("world" included)
    views: dict[str, tuple[str, ...]]  # view -> atomic dims
    meshes: dict[tuple[str, ...], DeviceMesh] = field(default_factory=dict)  # atomic dims -> mesh
    mesh: DeviceMesh | None = None  # the root mesh of the atomic dims (None on one process)
    placements: dict[str, Placement] = field(default_factory=dict)

    def size(self, view: str) -> int:
        return self.sizes[view]

    def _mesh(self, view: str) -> DeviceMesh | None:
        dims = self.views[view]
        if self.mesh is None or self.sizes[view] == 1:
            return None
        return self.meshes[dims]

    def coord(self, view: str) -> int:
        """This rank's index along `view` (0 when it has size 1 or there is no mesh)."""
        mesh = self._mesh(view)
        return 0 if mesh is None else mesh.get_local_rank(0)

    def group(self, view: str):
        """The process group of a view; "world" (or no mesh) is the default group."""
        if view == "world":
            return None
        mesh = self._mesh(view)
        return None if mesh is None else mesh.get_group(0)

    def peers(self, view: str) -> list[int]:
        """Global ranks along `view` through this rank, in the view's order."""
        if view == "world":
            return list(range(self.world_size))
        mesh = self._mesh(view)
        return [self.rank] if mesh is None else dist.get_process_group_ranks(mesh.get_group(0))

    def ring(self, view: str) -> tuple[int, int]:
        """(previous, next) global rank around the ring of `view`."""
        peers, i = self.peers(view), self.coord(view)
        return peers[(i - 1) % len(peers)], peers[(i + 1) % len(peers)]

    # -- parameters -------------------------------------------------------------------------
    def place(self, name: str, *, sharded: tuple[str, ...] = (), copies: int | None = None,
              expert: bool | None = None) -> None:
        """Record where the parameter `name` lives (strategies call this as they split it)."""
        p = self.placements.setdefault(name, Placement())
        p.sharded = tuple(dict.fromkeys(p.sharded + sharded))
        if copies is not None:
            p.copies = copies
        if expert is not None:
            p.expert = expert

    def placement(self, name: str) -> Placement:
        return self.placements.get(name, Placement())

    def grad_dim(self, name: str) -> str:
        """The view over which the gradient of `name` is summed: every rank that holds the same
        weight and saw other tokens."""
        base = "edp" if self.placement(name).expert else "dp"
        return base + "_cp" if self.sizes["cp"] > 1 else base

    def shard_dim(self, name: str) -> str:
        """The view ZeRO shards `name` over: its gradient view, within dp_shard when hybrid (an
        expert weight's: the dp_shard ranks that hold its expert, edp_shard)."""
        if self.sizes["dp_replicate"] > 1:
            group = "edp_shard" if self.placement(name).expert else "dp_shard"
            return group + "_cp" if self.sizes["cp"] > 1 else group
        return self.grad_dim(name)

    def replicas(self, name: str) -> int:
        """Ranks holding an identical copy of `name` (and of its reduced gradient)."""
        p = self.placement(name)
        atomic = [d for d in self.views["dp_cp"] + ("tp",) if d not in p.sharded]
        return math.prod(self.sizes[d] for d in atomic) * p.copies

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def without_mesh(cls, device: torch.device | str = "cpu", rank: int = 0,
                     world_size: int = 1, **sizes: int) -> "ParallelContext":
        """A context whose every view is the default group (one process, or tests of one
        transfer): `sizes` of the atomic dims pp, dp, cp, tp (1 when not given)."""
        atomic = {d: sizes.get(d, 1) for d in ("pp", "dp", "cp", "tp")}
        views = view_dims(list(atomic))
        all_sizes = {v: math.prod(atomic[d] for d in dims) for v, dims in views.items()}
        return cls(torch.device(device), rank, world_size, {**all_sizes, "world": world_size},
                   views)


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
    atomic = atomic_dims(cfg)
    names = [d for d, _ in atomic]
    views = view_dims(names)
    atomic_size = dict(atomic)
    sizes = {v: math.prod(atomic_size[d] for d in dims) for v, dims in views.items()}
    sizes["world"] = cfg.parallel.world_size
    device = resolve_device(cfg.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.parallel.world_size:
        raise WorldSizeError(world, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return ParallelContext.without_mesh(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    root = init_device_mesh(device.type, tuple(s for _, s in atomic), mesh_dim_names=tuple(names))
    meshes: dict[tuple[str, ...], DeviceMesh] = {}
    for dims in dict.fromkeys(views.values()):
        if not dims or math.prod(atomic_size[d] for d in dims) == 1:
            continue
        # Every rank creates every view in the same order (each is a collective).
        meshes[dims] = root[dims[0]] if len(dims) == 1 else root[dims]._flatten("_".join(dims))
    return ParallelContext(device, dist.get_rank(), dist.get_world_size(), sizes, views, meshes,
                           root)


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
