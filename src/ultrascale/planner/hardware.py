"""Hardware profiles: what the cost model needs to know about a device and the links between them.

A profile holds peak dense rates per dtype, memory, HBM bandwidth, devices per node, and for each
link level (intra-node, inter-node) the bus bandwidth of each collective kind and a per-step latency.
It also carries the handful of efficiency constants that turn peaks into achieved rates (matmul
efficiency curve, attention kernel efficiency, HBM efficiency). Those are fitted, not guessed: the
H100 figures come from `benchmarks/planner_vs_playbook.py --fit` on the playbook's H100 runs, and a
local profile from `ultrascale calibrate`. The other GPUs reuse the H100's efficiency constants
(same software stack, same kernel families) with their own datasheet peaks and links.

Bus bandwidth follows nccl-tests: a collective over n ranks moving S bytes per rank takes
S * (n-1)/n / busbw (all-gather, reduce-scatter, all-to-all) or 2 S (n-1)/n / busbw (all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from ultrascale.devices import PEAK_FLOPS

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
GB = 1e9


@dataclass(frozen=True)
class Link:
    """One link level: bus bandwidth (bytes/s) per collective kind, latency (s) per algorithm step,
    and for the inter-node level the fabric's capacity (bytes/s, per kind) that the nodes of one
    collective share: an oversubscribed fabric gives each of k nodes at most fabric / k. The
    playbook cluster shows it plainly: its measured all-reduce bus bandwidth halves each time the
    node count doubles past 4 nodes.

    The inter-node `busbw` is a whole node's, every device of it taking part (as nccl-tests reports
    it across nodes); `share` is the part of the node's links one group gets when the node's
    devices are split among several groups running at once (`theory.rates.inter_share`). Point-to-point
    bandwidth is one device's. The fabric cap is fitted per collective group.

    `job_fabric_bw` (bytes/s, for the kinds it names) is a fabric that every node of the job
    loads at once, whatever group a collective runs in: each byte crossing nodes then also takes
    job_nodes / (share x job_fabric_bw), so a node's bus bandwidth goes as
    1 / (1 / busbw + job_nodes / job_fabric_bw), the form the playbook cluster's jobs measured
    with NVLink SHARP (all-gather 227 to 44 GB/s on 4 to 64 nodes), and a group with `share` of
    the node's links gets that share of it. `job_nodes` is set per job (`Hardware.for_job`)."""

    busbw: dict[str, float]
    latency_s: float
    fabric_bw: dict[str, float] | None = None
    job_fabric_bw: dict[str, float] | None = None
    job_nodes: int = 1

    def __post_init__(self):
        bad = {k: v for k, v in (self.job_fabric_bw or {}).items() if not v > 0}
        if bad or self.job_nodes < 1:
            raise ValueError(f"link: job_fabric_bw needs capacities above 0 (bytes/s; got {bad}) "
                             f"and job_nodes at least 1 (got {self.job_nodes})")

    def bw(self, kind: str, nodes: int = 1, share: float = 1.0) -> float:
        bw = (self.busbw.get(kind) or self.busbw["all_reduce"]) * share
        if self.fabric_bw and nodes > 1:
            fabric = self.fabric_bw.get(kind) or self.fabric_bw["all_reduce"]
            bw = min(bw, fabric / nodes)
        if self.job_fabric_bw and nodes > 1 and kind in self.job_fabric_bw:
            bw = 1.0 / (1.0 / bw + self.job_nodes / (share * self.job_fabric_bw[kind]))
        return bw


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype
    memory_bytes: float
    hbm_bw: float  # bytes/s
    devices_per_node: int
    intra: Link
    inter: Link
    # Achieved matmul rate = peak * matmul_eff_max * F / (F + matmul_half_flops) for a GEMM of F FLOPs:
    # big GEMMs approach matmul_eff_max, small ones are dominated by launch and tail effects.
    matmul_eff_max: float = 0.75
    matmul_half_flops: float = 2e9
    # CPU profiles, per dtype as `ultrascale calibrate` fits them: the half-rate size, and the
    # half-rate smallest dimension, a second factor d / (d + half_dim) where d is the GEMM's
    # smallest dimension (a narrow inner or outer dimension runs below a square GEMM of the same
    # FLOPs: a small model's linears). A dtype missing here takes `matmul_half_flops` and no
    # narrow-dimension factor (GPU profiles, and profiles calibrated before).
    matmul_half_flops_by_dtype: dict[str, float] = field(default_factory=dict)
    matmul_half_dim_by_dtype: dict[str, float] = field(default_factory=dict)
    attention_eff: float = 0.45  # flash attention, fraction of peak
    # CPU profiles: flash attention's fraction of each dtype's own peak, as `ultrascale calibrate`
    # measures it (a CPU's bf16 attention kernel reaches a far smaller share of its bf16 peak than
    # the fp32 one of fp32's). A dtype missing here takes `attention_eff`.
    attention_eff_by_dtype: dict[str, float] = field(default_factory=dict)
    # CPU profiles: the same per head dimension, dtype -> {head_dim: fraction of the peak}, as
    # `ultrascale calibrate` measures it at a few head dimensions with grouped kv heads (the
    # kernel's rate falls with the head dimension). Between two measured head dimensions the
    # fraction is interpolated in log(head_dim); beyond them, the nearest one's. A dtype missing
    # here takes `attention_eff_by_dtype`.
    attention_eff_by_head_dim: dict[str, dict[int, float]] = field(default_factory=dict)
    hbm_eff: float = 0.7  # fraction of HBM bandwidth reached by elementwise kernels
    # CPU profiles: a core's own cache (its L2, bytes) and the efficiency elementwise work reaches
    # while its tensors fit in it. `hbm_eff` is then the efficiency out of that cache, where the
    # copy bandwidth is measured; a block whose widest activation holds S bytes runs the share
    # cache_bytes / S of its traffic at `cached_eff` (`theory.rates.memory_time`). None: one efficiency
    # whatever the size (GPUs, whose activations dwarf their L2).
    cache_bytes: float | None = None
    cached_eff: float | None = None
    # CPU profiles: the elementwise efficiencies (`hbm_eff`, `cached_eff`) of work in each dtype,
    # as `ultrascale calibrate` measures them with the block's own ops in that dtype: a CPU's bf16
    # norms, rotary, SwiGLU and casts take about as long per element as fp32's, so per byte they
    # reach a smaller share of the copy bandwidth. A dtype missing here takes `hbm_eff` and
    # `cached_eff` (GPU profiles, and profiles calibrated before); one missing only from
    # `cached_eff_by_dtype` runs at its `hbm_eff_by_dtype` in the cache too.
    hbm_eff_by_dtype: dict[str, float] = field(default_factory=dict)
    cached_eff_by_dtype: dict[str, float] = field(default_factory=dict)
    # Share of the last backward under which the data-parallel reduction runs hidden (its kernels
    # take SMs and HBM bandwidth from the backward; 0.507 fitted on H100s).
    dp_overlap: float = 1.0
    # Fixed time per transformer layer and micro-batch, forward plus backward: host-side work
    # (kernel launches, Python) that the GPU waits for, whatever the layer's size.
    layer_overhead_s: float = 0.0
    # CPU profiles: the same measured with the block in each dtype (a bf16 block's host work
    # differs: its norms' casts, other kernels' dispatch). A dtype missing here takes
    # `layer_overhead_s` (GPU profiles, whose figure was fitted on whole steps, and profiles
    # calibrated before).
    layer_overhead_by_dtype: dict[str, float] = field(default_factory=dict)
    # Fraction of the shorter of a pass's waits (host work per layer, collective latencies) and
    # its device work (FLOPs, bytes) that hides under the longer: a GPU runs ahead of its host and
    # computes while a collective's latency passes. 0 on a CPU, where the same cores do both.
    host_overlap: float = 0.0
    # Memory traffic of the optimizer update per local parameter (bytes): 30 for a fused Adam
    # (see theory.optimizer.ADAM_BYTES_PER_PARAM); an unfused per-tensor AdamW plus the gradient norm streams
    # over the parameters several times, which `ultrascale calibrate` measures.
    optimizer_bytes_per_param: float = 30.0
    # CPU profiles: the cores that the ranks of one node share. `peak_flops` and `hbm_bw` are then
    # the rates of one core (one thread), and a rank computes on its share of the node's cores:
    # cores // ranks threads, or a time slice of one core when ranks outnumber cores. None: each
    # device computes on its own (GPUs).
    host_cores: int | None = None
    # CPU profiles: when ranks outnumber cores they run in time slices, and at each blocking
    # transfer or collective one side is often off its core when the other arrives: the exchange
    # waits this long for its next slice. Measured by `ultrascale calibrate`: a ping-pong between
    # two ranks doing the same work between messages while the others compute, less the same
    # ping-pong with everyone idle.
    wakeup_s: float = 0.0
    # Latency of one step of a ring collective (NCCL's few microseconds). A collective over n
    # ranks takes n - 1 steps (2 (n - 1) for an all-reduce); the gradient reduction runs one
    # collective per bucket, and each pays its steps.
    ring_step_s: float = 0.0
    # A wait per ring step of every tensor-parallel collective, on top of the link's latency: a
    # property of a cluster's state, not of a GPU. The playbook cluster's jobs whose node ran its
    # all-reduce without NVLink SHARP pay ~0.27 ms per step, on one node as on 64, with or without
    # pipeline parallelism (docs/planner.md); 0 on a healthy cluster.
    tp_step_wait_s: float = 0.0
    # Device memory that no tensor count sees: the CUDA context and the collective library's own
    # buffers (NCCL allocates them per communicator, more with NVLink SHARP). A layout fits when
    # the estimator's reserved bytes fit in the rest (`usable_memory_bytes`).
    outside_allocator_bytes: float = 0.0
    source: str = "datasheet"

    def __post_init__(self):
        if self.outside_allocator_bytes < 0 or (
                self.memory_bytes > 0 and self.outside_allocator_bytes >= self.memory_bytes):
            raise ValueError(
                f"hardware profile {self.name!r}: outside_allocator_bytes "
                f"{self.outside_allocator_bytes:.4g} must be at least 0 and below memory_bytes "
                f"{self.memory_bytes:.4g} (it is the part of the device's memory the CUDA context "
                "and NCCL hold; 5 GiB on the GPU profiles)")

    @property
    def usable_memory_bytes(self) -> float:
        """What the framework's tensors and allocator can have: the device's memory less what the
        CUDA context and the communication library hold."""
        return self.memory_bytes - self.outside_allocator_bytes

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"hardware {self.name!r} has no peak rate for dtype {dtype!r}; "
                             f"known: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def attention_rate(self, dtype: str, head_dim: float | None = None) -> float:
        """Flash attention's achieved FLOP/s in `dtype` (at `head_dim` where the profile
        measured it per head dimension)."""
        return self.peak(dtype) * self.attention_eff_at(dtype, head_dim)

    def attention_eff_at(self, dtype: str, head_dim: float | None = None) -> float:
        """Flash attention's fraction of the `dtype` peak at `head_dim` (None: the profile's
        figure for the dtype, whatever the head dimension)."""
        measured = self.attention_eff_by_head_dim.get(dtype)
        if not measured or not head_dim:
            return self.attention_eff_by_dtype.get(dtype, self.attention_eff)
        return log_interpolate({float(d): e for d, e in measured.items()}, float(head_dim))

    def matmul_curve(self, dtype: str) -> tuple[float, float]:
        """(half-rate FLOPs, half-rate smallest dimension: 0 for none) of GEMMs in `dtype`."""
        return (self.matmul_half_flops_by_dtype.get(dtype, self.matmul_half_flops),
                self.matmul_half_dim_by_dtype.get(dtype, 0.0))

    def layer_overhead(self, dtype: str) -> float:
        """The host's fixed work per layer, forward and backward, for a block in `dtype`."""
        return self.layer_overhead_by_dtype.get(dtype, self.layer_overhead_s)

    def elementwise_effs(self, dtype: str) -> tuple[float, float | None]:
        """(out of a core's cache, in it: None where not measured) efficiencies of memory-bound
        work on tensors of `dtype`, as fractions of `hbm_bw`."""
        if dtype in self.hbm_eff_by_dtype:
            return self.hbm_eff_by_dtype[dtype], self.cached_eff_by_dtype.get(dtype)
        return self.hbm_eff, self.cached_eff

    def with_(self, **changes) -> "Hardware":
        return replace(self, **changes)

    def for_job(self, nodes: int) -> "Hardware":
        """The profile as a job on `nodes` nodes sees it: a fabric the whole job shares
        (`Link.job_fabric_bw`) divided among that many nodes."""
        if not self.inter.job_fabric_bw or self.inter.job_nodes == nodes:
            return self
        return replace(self, inter=replace(self.inter, job_nodes=nodes))

    # ---- YAML ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown hardware profile keys {sorted(unknown)}; known: {sorted(known)}")
        data = dict(data)
        for level in ("intra", "inter"):
            link = data[level]
            if isinstance(link, Link):
                continue
            fabric, job = link.get("fabric_bw"), link.get("job_fabric_bw")
            data[level] = Link(
                busbw={k: float(v) for k, v in link["busbw"].items()},
                latency_s=float(link["latency_s"]),
                fabric_bw={k: float(v) for k, v in fabric.items()} if fabric else None,
                job_fabric_bw={k: float(v) for k, v in job.items()} if job else None,
                job_nodes=int(link.get("job_nodes", 1)))
        data["peak_flops"] = {k: float(v) for k, v in data["peak_flops"].items()}
        if data.get("attention_eff_by_head_dim"):  # YAML keys may come back as strings
            data["attention_eff_by_head_dim"] = {
                dt: {int(d): float(e) for d, e in by_dim.items()}
                for dt, by_dim in data["attention_eff_by_head_dim"].items()}
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Hardware":
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"hardware profile {str(path)!r} must hold a mapping")
        return cls.from_dict(data)


def log_interpolate(points: dict[float, float], x: float) -> float:
    """The value at `x` of the piecewise-linear curve through `points` (x -> y) in log(x); beyond
    the points, the nearest one's value."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            t = math.log(x / lo) / math.log(hi / lo)
            return points[lo] + t * (points[hi] - points[lo])
    return points[xs[-1]]


def _plain(obj):
    """Builtin types only (fits hand back numpy floats), so that the YAML stays readable."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item"):
        return obj.item()
    return obj


def _link(ar: float, ag: float, rs: float, a2a: float, p2p: float, latency_s: float,
          fabric: tuple[float, float] | None = None) -> Link:
    """Bandwidths in GB/s; `fabric` is the (all-reduce, other kinds) fabric capacity in GB/s."""
    return Link(busbw=dict(all_reduce=ar * GB, all_gather=ag * GB, reduce_scatter=rs * GB,
                           all_to_all=a2a * GB, p2p=p2p * GB), latency_s=latency_s,
                fabric_bw=None if fabric is None else dict(
                    all_reduce=fabric[0] * GB, all_gather=fabric[1] * GB,
                    reduce_scatter=fabric[1] * GB, all_to_all=fabric[1] * GB, p2p=fabric[1] * GB))


# H100 SXM cluster as in the playbook runs: intra-node bus bandwidths are the medians the nanotron
# benchmark measured on one node (NVLink 4 with NVLS all-reduce); inter-node from 8x400 Gb/s
# InfiniBand per node (50 GB/s per GPU). Efficiencies, host work, overlap and the ring step: fitted
# on those runs, each on the profile of its cluster state, to minimise the worst (model, nodes)
# cell's median error (`benchmarks/planner_vs_playbook.py --fit`; docs/planner.md), rounded.
H100_FIT = dict(matmul_eff_max=0.85, matmul_half_flops=2.84e10, attention_eff=0.173, hbm_eff=0.95,
                dp_overlap=0.507, layer_overhead_s=4.61e-3, host_overlap=0.893,
                ring_step_s=2.16e-6)
# Per-step latency of an intra-node collective: NVLink's few microseconds. (The fit drives it to
# its floor: the host-side work around each collective is in `layer_overhead_s`, and it hides
# under the device's work as `host_overlap` says.)
INTRA_LATENCY = 5e-6
# A GPU training job's device memory outside PyTorch's allocator: the CUDA context (~0.5 GiB) and
# NCCL's buffers, per communicator and channel (one communicator with an all-reduce took ~1.6 GB,
# three or more ~6 GB in NVIDIA/nccl#864; NVLS communicators take more). Fitted on the playbook's
# H100 runs: with 5 GiB kept free, the memory estimator calls 98.1% of their 1385 runs right, OOM
# or not (97.0% with none; `benchmarks/memory_vs_playbook.py --outside-gib G`: 98.0-98.1% from
# 4.8 to 7 GiB).
GPU_OUTSIDE_ALLOCATOR = 5 * 2**30
# Inter-node: plus an InfiniBand step on a healthy fabric (nccl-tests order of magnitude, 20 us).
# The playbook cluster's fitted start-up latency is far larger (below).
INTER_LATENCY = INTRA_LATENCY + 20e-6

H100 = Hardware(
    name="h100", peak_flops=dict(PEAK_FLOPS["h100"]),
    memory_bytes=80 * 2**30, hbm_bw=3.35e12, devices_per_node=8,
    intra=_link(457, 262, 262, 262, 300, INTRA_LATENCY),
    inter=_link(340, 168, 168, 100, 45, INTER_LATENCY),
    outside_allocator_bytes=GPU_OUTSIDE_ALLOCATOR,
    source="datasheet + fit on playbook H100 runs, non-blocking fabric", **H100_FIT)

# The playbook's own cluster, in the two states its jobs measured before training (the CSV's
# bandwidth columns). Real properties of that cluster, not of H100s: plan on them only to compare
# with those runs. In both, an inter-node collective starts up in a fitted 0.606 ms per doubling of
# the nodes it spans. (That nanotron's ZeRO reduce-scatter does not overlap the backward is a
# property of the runtime, not of the cluster: theory.implementation.NANOTRON.)
PLAYBOOK_INTER_LATENCY = 0.606e-3

# Most jobs: the node's all-reduce ran without NVLink SHARP (~425 GB/s instead of ~458). Every
# ring step of a tensor-parallel collective then waits ~0.27 ms, on 1 node as on 64, with or
# without pipeline parallelism; and the fabric is shared: the all-reduce bus bandwidth the jobs
# measured halves each time the node count doubles past 4 (a group over k nodes gets at most
# fabric / k, fitted).
H100_PLAYBOOK = H100.with_(name="h100-playbook",
                           inter=_link(340, 168, 168, 100, 45, PLAYBOOK_INTER_LATENCY,
                                       fabric=(141, 455)),
                           tp_step_wait_s=0.271e-3,
                           source="playbook cluster without NVLink SHARP (nanotron benchmark): "
                                  "fit on its runs")

# The other jobs: NVLink SHARP on, no tp ring-step wait; the inter-node all-reduce reduces in the
# switches at a flat 183 GB/s bus bandwidth from 4 to 64 nodes (the median those jobs measured);
# all-gather and reduce-scatter cross a fabric that the whole job shares: their bus bandwidth over
# all of a job's nodes, as those jobs measured it (medians 227, 178, 124, 75, 44 GB/s on 4 to 64
# nodes), is 1 / (1 / 306 + nodes / 3300) GB/s for all-gather and 1 / (1 / 287 + nodes / 3380) for
# reduce-scatter (least squares on 1 / bandwidth; `benchmarks/planner_vs_playbook.py --fabric`).
# A tensor-parallel group over 4 nodes of a 64-node job runs near the job's figure, not a 4-node
# job's: 1.34G at tp 32 on 64 nodes takes 46 ms (ZeRO-0) and 34 ms (ZeRO-1) more per sequence of
# a micro-batch from 1 to 16 (`--per-micro-batch`), i.e. its ~163 all-gathers and reduce-scatters
# of 16 MB per sequence (`cost.tp_block_collectives` per block, and the ends) move at ~57 and
# ~77 GB/s (44 measured for the job, 227 on 4 nodes).
H100_PLAYBOOK_NVLS = H100.with_(name="h100-playbook-nvls",
                                inter=replace(_link(183, 306, 287, 100, 45,
                                                    PLAYBOOK_INTER_LATENCY),
                                              job_fabric_bw={"all_gather": 3300 * GB,
                                                             "reduce_scatter": 3380 * GB}),
                                source="playbook cluster with NVLink SHARP (nanotron benchmark): "
                                       "inter-node bandwidths as its jobs measured them, the "
                                       "rest fitted on its runs")

# Non-blocking fabric assumed below (set `inter.fabric_bw` in a profile YAML for a cluster that
# shares its links).
H200 = H100.with_(name="h200", memory_bytes=141e9, hbm_bw=4.8e12,
                  source="datasheet; efficiencies from the H100 fit")

# H800 SXM (DeepSeek-V3's GPUs): the H100's compute and memory, NVLink cut to 400 GB/s (from
# 900, bidirectional): the H100's measured intra-node bus bandwidths scaled by 400/900; between
# nodes the same 8 x 400 Gb/s InfiniBand per node as the H100 profile.
_NVLINK_H800 = 400 / 900
H800 = H100.with_(name="h800",
                  intra=_link(*(round(bw * _NVLINK_H800) for bw in (457, 262, 262, 262, 300)),
                              INTRA_LATENCY),
                  source="datasheet (H100 compute, NVLink 400 GB/s, 8 x 400 Gb/s InfiniBand); "
                         "efficiencies from the H100 fit")

A100 = Hardware(
    name="a100", peak_flops=dict(PEAK_FLOPS["a100"]),
    memory_bytes=80 * 2**30, hbm_bw=2.04e12, devices_per_node=8,
    intra=_link(230, 135, 135, 135, 150, INTRA_LATENCY),
    inter=_link(170, 85, 85, 50, 22, INTER_LATENCY),
    outside_allocator_bytes=GPU_OUTSIDE_ALLOCATOR,
    source="datasheet; efficiencies from the H100 fit", **H100_FIT)

B200 = Hardware(
    name="b200", peak_flops=dict(PEAK_FLOPS["b200"]),
    memory_bytes=180e9, hbm_bw=8.0e12, devices_per_node=8,
    intra=_link(900, 520, 520, 520, 600, INTRA_LATENCY),
    inter=_link(340, 168, 168, 100, 45, INTER_LATENCY),
    outside_allocator_bytes=GPU_OUTSIDE_ALLOCATOR,
    source="datasheet; efficiencies from the H100 fit", **H100_FIT)

PROFILES: dict[str, Hardware] = {"h100": H100, "h100-playbook": H100_PLAYBOOK,
                                 "h100-playbook-nvls": H100_PLAYBOOK_NVLS, "h200": H200, "h800": H800,
                                 "a100": A100, "b200": B200}
ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "a100-80gb": "a100", "a100_80gb": "a100"}

# Where `ultrascale calibrate` writes the measured profile of this machine.
LOCAL_PROFILE = Path.home() / ".cache" / "ultrascale" / "hardware" / "local.yaml"


def get_hardware(name: str | Path) -> Hardware:
    """A built-in profile by name (h100, h200, h800, a100, b200), `local`, or a YAML file path."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key in PROFILES:
        return PROFILES[key]
    if key == "local":
        if not LOCAL_PROFILE.is_file():
            raise ValueError(f"no measured profile at {LOCAL_PROFILE}: run `ultrascale calibrate` "
                             "first, or name a built-in GPU (h100, h200, h800, a100, b200).")
        return Hardware.load(LOCAL_PROFILE)
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return Hardware.load(path)
    raise ValueError(f"unknown hardware {str(name)!r}: choose one of {', '.join(PROFILES)}, "
                     "`local` (after `ultrascale calibrate`), or give a profile YAML path.")


__all__ = ["Hardware", "Link", "PROFILES", "get_hardware", "LOCAL_PROFILE", "COLLECTIVES"]

