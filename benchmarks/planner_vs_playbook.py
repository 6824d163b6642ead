"""The planner against the playbook's published H100 runs (benchmarks/data/playbook_bench_1b_3b.csv).

    python benchmarks/planner_vs_playbook.py            # figures per (model, nodes) cell
    python benchmarks/planner_vs_playbook.py --fit      # refit the H100 constants first (26 s)
    python benchmarks/planner_vs_playbook.py --fit --objective least-squares   # every run alike
    python benchmarks/planner_vs_playbook.py --sensitivity   # the worst cell, each constant moved
    python benchmarks/planner_vs_playbook.py --json out.json
    python benchmarks/planner_vs_playbook.py --fit --fit-on 1.34G   # hold the 3.57G runs out
    python benchmarks/planner_vs_playbook.py --per-micro-batch     # time per micro-batch by layout
    python benchmarks/planner_vs_playbook.py --per-layer-split     # micro-batch 1: fixed + per layer
    python benchmarks/planner_vs_playbook.py --fabric              # the bus bandwidths each job measured
    python benchmarks/planner_vs_playbook.py --per-run-fabric      # each run on its job's bandwidths
    python benchmarks/planner_vs_playbook.py --one-state h100-playbook   # one profile for every run
    python benchmarks/planner_vs_playbook.py --fit --set dp_overlap=1    # refit with one field changed
    python benchmarks/planner_vs_playbook.py --cell 1.34G:64             # one cell, run by run
    python benchmarks/planner_vs_playbook.py --fit --runtime nanotron-balanced  # nanotron's pp split

The cluster ran in two states, and every job measured which before it trained: its node's
all-reduce ran with NVLink SHARP (~458 GB/s bus bandwidth; profile `h100-playbook-nvls`) or
without it (~425 GB/s; profile `h100-playbook`, whose tensor-parallel ring steps wait ~0.27 ms
each). Each run is predicted on the profile of its own job's state, as a planner is used on a
cluster calibrated the day it runs (`--one-state NAME` predicts every run on one profile instead).
Rows used: status Success, dp x tp x pp = 8 x nodes, global batch 256 x 4096 tokens, and for
pp > 1 only runs after nanotron's pipeline-engine fix (after_pp_fix). Repeated layouts keep
their best run.

For each (model, nodes) cell: median relative error of predicted tokens/s/GPU and Spearman rank
correlation of predicted and measured (each run on its state's profile); then the planner, on
the profile of the state in which the cell's best measured layout ran, searching only the
dimensions those runs explored (their tp, pp and micro-batch values, ZeRO 0/1, sequence parallel,
1F1B, no recompute, keeping what fits by the memory estimator with nanotron's runtime): its rank
of the best measured layout, and the measured throughput of its highest-ranked layout measured in
that state as a fraction of the best measured (the MFU ratio: same model, same FLOPs per token);
and the same ratio for its first choice itself where that layout was measured in that state.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.cost import estimate_memory, predict
from ultrascale.planner.hardware import (
    H100_PLAYBOOK, H100_PLAYBOOK_NVLS, Hardware, Link, get_hardware,
)
from ultrascale.planner.search import SearchSpace, plan
from ultrascale.theory.pipeline import busiest_stage_layers

CSV = Path(__file__).resolve().parent / "data" / "playbook_bench_1b_3b.csv"
SEQ = 4096
GLOBAL_SEQS = 256  # 1M tokens


def playbook_model(hidden: int, layers: int) -> ModelConfig:
    # Both benchmark models: 32 heads without GQA, SwiGLU width 8192, 131k vocabulary, tied.
    return ModelConfig(preset=None, hidden_size=hidden, num_layers=layers, num_heads=32,
                       num_kv_heads=32, ffn_hidden_size=8192, vocab_size=131072,
                       tie_embeddings=True)


@dataclass
class Run:
    model_name: str
    model: ModelConfig
    nodes: int
    layout: Layout
    status: str
    tokens_per_gpu: float | None
    after_pp_fix: bool
    # The bus bandwidths (GB/s) the job measured before training, per collective kind: over all
    # its GPUs (inter-node from 2 nodes on), and inside one node.
    inter_gbs: dict[str, float] | None = None
    intra_gbs: dict[str, float] | None = None


def load_runs(path: Path = CSV) -> list[Run]:
    """The rows that reach 1M tokens on every GPU of their nodes (a few test rows do not)."""
    models = {}
    runs = []
    with open(path) as fh:
        for row in csv.DictReader(fh):
            hidden, layers = int(row["hidden_size"]), int(row["num_layers"])
            name = row["name"].split("_")[0]
            if name not in models:
                models[name] = playbook_model(hidden, layers)
            dp, tp, pp = int(row["dp"]), int(row["tp"]), int(row["pp"])
            mbs, acc = int(row["mbs"]), int(float(row["batch_accum"]))
            nodes = int(float(row["nodes"]))
            if dp * tp * pp != nodes * 8 or dp * mbs * acc != GLOBAL_SEQS:
                continue
            lay = Layout(dp=dp, tp=tp, pp=pp, zero=int(row["zero_stage"]), mbs=mbs, grad_accum=acc,
                         seq_len=SEQ, sequence_parallel=tp > 1, pp_schedule="1f1b", dtype="bf16",
                         grad_accum_dtype="fp32", bucket_mb=25.0)
            tok = float(row["tok/s/gpu"]) if row["status"] == "Success" else None
            runs.append(Run(name, models[name], nodes, lay, row["status"], tok,
                            row["after_pp_fix"] == "True", _gbs(row, ""), _gbs(row, " Intra-node")))
    return runs


_GBS_COLUMNS = {"all_reduce": ("AllReduce", "AR"), "all_gather": ("AllGather", "AG"),
                "reduce_scatter": ("ReduceScatter", "RS")}


def _gbs(row: dict, where: str) -> dict[str, float] | None:
    """The row's bus bandwidths per kind: `where` "" for the whole job, " Intra-node" for one node."""
    out = {}
    for kind, (long, short) in _GBS_COLUMNS.items():
        text = row.get(f"{short if where else long}{where} (GB/s)", "")
        if not text:
            return None
        out[kind] = float(text)
    return out


def measured_step_s(r: Run) -> float:
    """The run's step time: its global batch over its throughput."""
    return r.layout.global_batch_tokens / (r.tokens_per_gpu * r.layout.world_size)


def usable(r: Run) -> bool:
    """A successful run that measured what it claims: pipeline runs from before nanotron's
    pipeline-engine fix (after_pp_fix False) measured the bug, not the layout."""
    return r.status == "Success" and (r.layout.pp == 1 or r.after_pp_fix)


def best_runs(runs: list[Run]) -> dict:
    """Usable runs per cell, one per layout (the best of repeated runs)."""
    cells: dict = defaultdict(dict)
    for r in runs:
        if not usable(r):
            continue
        cell = cells[(r.model_name, r.nodes)]
        if r.layout not in cell or r.tokens_per_gpu > cell[r.layout].tokens_per_gpu:
            cell[r.layout] = r
    return cells


# ------------------------------------------------------------------------------------------------
# The cluster's two states


NVLS_GBS = 440  # a node's all-reduce above this ran with NVLink SHARP (~458 GB/s); ~425 without


def nvls(run: Run) -> bool:
    """Whether the run's job measured its node's all-reduce with NVLink SHARP (the cluster's
    first state) rather than without (the second, most runs)."""
    return run.intra_gbs["all_reduce"] >= NVLS_GBS


@dataclass(frozen=True)
class ClusterStates:
    """The playbook cluster's profile in each of its two states; a run is predicted on the one its
    own job measured. The same profile twice is one state for every run (`--one-state`).
    `runtime`: the implementation the runs are predicted for (theory.implementation.IMPLEMENTATIONS)."""

    nvls: Hardware
    no_nvls: Hardware
    runtime: str = "nanotron"

    def of(self, run: Run) -> Hardware:
        return self.named(nvls(run))

    def named(self, state: bool) -> Hardware:
        """The profile of a state (True: with NVLink SHARP)."""
        return self.nvls if state else self.no_nvls


PLAYBOOK_STATES = ClusterStates(nvls=H100_PLAYBOOK_NVLS, no_nvls=H100_PLAYBOOK)


def nvls_inter_all_reduce_gbs(runs: list[Run]) -> float:
    """The inter-node all-reduce bus bandwidth that the jobs with NVLink SHARP measured on 4 to 64
    nodes (median, GB/s): flat with the node count, because SHARP reduces in the switches.
    `h100-playbook-nvls` takes it as measured."""
    return statistics.median(r.inter_gbs["all_reduce"] for r in runs
                             if usable(r) and r.nodes >= 4 and nvls(r))


def nvls_gather_scatter_law(runs: list[Run]) -> dict[str, tuple[float, float]]:
    """Per kind (all-gather, reduce-scatter), the (bus bandwidth, job fabric) in GB/s of the law
    1 / bw = 1 / busbw + nodes / fabric, least squares on the inverse of the medians that the jobs
    with NVLink SHARP measured over all their nodes, on 4 to 64 nodes: a fabric that every node of
    the job loads at once (`Link.job_fabric_bw`). `h100-playbook-nvls` takes it, rounded."""
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        by_nodes: dict = defaultdict(list)
        for r in runs:
            if usable(r) and r.nodes >= 4 and nvls(r):
                by_nodes[r.nodes].append(r.inter_gbs[kind])
        nodes = sorted(by_nodes)
        a = np.array([[1.0, n] for n in nodes])
        inverse = np.array([1.0 / statistics.median(by_nodes[n]) for n in nodes])
        base, per_node = np.linalg.lstsq(a, inverse, rcond=None)[0]
        out[kind] = (1.0 / base, 1.0 / per_node)
    return out


def run_hardware(hw: Hardware, run: Run) -> Hardware:
    """`hw` with the bus bandwidths the run's own job measured (a calibration per job): inside a
    node its node's figures, across nodes the whole job's as the node's bus bandwidth, no fabric
    cap (the job's figure already holds it)."""
    def link(base, gbs, fabric):
        busbw = dict(base.busbw, **{k: v * 1e9 for k, v in (gbs or {}).items()})
        return type(base)(busbw=busbw, latency_s=base.latency_s,
                          fabric_bw=base.fabric_bw if fabric else None,
                          job_fabric_bw=base.job_fabric_bw if fabric else None)
    inter = run.inter_gbs if run.nodes > 1 else None
    return hw.with_(intra=link(hw.intra, run.intra_gbs, True),
                    inter=link(hw.inter, inter, inter is None))


def predicted(model: ModelConfig, lay: Layout, hw: Hardware, runtime: str = "nanotron") -> float:
    return predict(model, lay, hw, memory=False, runtime=runtime).tokens_per_s_per_device


# ------------------------------------------------------------------------------------------------
# Fitting the efficiency constants

# (name, lower bound, upper bound, scale). The bounds keep the constants physical: cuBLAS reaches
# at most ~85% of the H100's dense peak and half of that on GEMMs of at most 30 GFLOP, flash
# attention 15-80%, elementwise kernels at most 95% of HBM bandwidth, host work per layer under
# 10 ms, overlap between 0 and 1, an inter-node latency under 5 ms, a ring step under 0.1 ms, a
# tp ring-step wait under 3 ms, fabric capacities and bus bandwidths within what 8 x 400 Gb/s per
# node and NVLink allow.
FIT_PARAMS = (
    ("matmul_eff_max", 0.5, 0.85, 0.1),
    ("matmul_half_flops", 1e8, 3e10, 1e9),
    ("attention_eff", 0.15, 0.8, 0.1),
    ("hbm_eff", 0.3, 0.95, 0.1),
    ("layer_overhead_s", 0.0, 0.01, 1e-4),
    ("host_overlap", 0.0, 1.0, 0.1),
    ("dp_overlap", 0.0, 1.0, 0.1),
    ("inter_latency_s", 0.0, 5e-3, 1e-4),
    ("ring_step_s", 0.0, 1e-4, 1e-6),
    # without NVLink SHARP
    ("tp_step_wait_s", 0.0, 3e-3, 1e-4),
    ("fabric_all_reduce_gbs", 50.0, 5000.0, 100.0),
    ("fabric_other_gbs", 50.0, 5000.0, 100.0),
    # (the state with SHARP keeps the inter-node bandwidths its jobs measured)
)
FIT_FIELDS = tuple(name for name, *_ in FIT_PARAMS)
# Where both fits start (FIT_PARAMS order; the least-squares fit's constants), so that `--fit`
# gives the same constants whatever the profiles hold now.
FIT_START = np.array([0.85, 3.0e10, 0.15, 0.95, 4.61e-3, 0.891, 0.522, 0.466e-3, 2.21e-6,
                      0.272e-3, 153.0, 455.0])


def params_of(states: ClusterStates) -> np.ndarray:
    """The fitted quantities as a vector (FIT_PARAMS order), read back from the profiles."""
    ring = states.no_nvls
    return np.array([ring.matmul_eff_max, ring.matmul_half_flops, ring.attention_eff,
                     ring.hbm_eff, ring.layer_overhead_s, ring.host_overlap, ring.dp_overlap,
                     ring.inter.latency_s,
                     ring.ring_step_s, ring.tp_step_wait_s,
                     ring.inter.fabric_bw["all_reduce"] / 1e9,
                     ring.inter.fabric_bw["all_gather"] / 1e9])


def apply(states: ClusterStates, x: np.ndarray) -> ClusterStates:
    """Both profiles with the constants `x` (FIT_PARAMS order): shared compute and host
    constants and inter-node latency, the state without SHARP's tp ring-step wait and fabric (the
    state with SHARP keeps the bandwidths its jobs measured)."""
    (eff, half, attn, hbm, per_layer, overlap, dp_overlap, inter_lat, ring_step, tp_wait, fab_ar,
     fab_other) = (float(v) for v in x)
    shared = dict(matmul_eff_max=eff, matmul_half_flops=half, attention_eff=attn, hbm_eff=hbm,
                  layer_overhead_s=per_layer, host_overlap=overlap, dp_overlap=dp_overlap,
                  ring_step_s=ring_step)
    ring = states.no_nvls
    fabric = {k: (fab_ar if k == "all_reduce" else fab_other) * 1e9 for k in ring.inter.busbw}
    ring = ring.with_(inter=Link(busbw=ring.inter.busbw, latency_s=inter_lat, fabric_bw=fabric),
                      tp_step_wait_s=tp_wait, **shared)
    sharp = states.nvls
    sharp = sharp.with_(inter=replace(sharp.inter, latency_s=inter_lat), **shared)
    return ClusterStates(nvls=sharp, no_nvls=ring, runtime=states.runtime)


def fit_bounds(bounds: dict[str, tuple[float, float]] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, scale) of the fitted constants, FIT_PARAMS order, with `bounds` replacing some
    (lo, hi)."""
    rows = [((bounds or {}).get(name, (lo, hi)), scale) for name, lo, hi, scale in FIT_PARAMS]
    return (np.array([b[0] for b, _ in rows]), np.array([b[1] for b, _ in rows]),
            np.array([scale for _, scale in rows]))


def fit(runs: list[Run], states: ClusterStates = PLAYBOOK_STATES, max_nodes: int = 64,
        bounds: dict[str, tuple[float, float]] | None = None) -> ClusterStates:
    """Least squares on log(predicted / measured) of every usable run of at most `max_nodes`
    nodes, each on its state's profile. `bounds` replaces some of FIT_PARAMS' (lo, hi)."""
    from scipy.optimize import least_squares

    data = [(r.model, r.layout, r.tokens_per_gpu, nvls(r)) for r in runs
            if usable(r) and r.nodes <= max_nodes]
    lo, hi, scale = fit_bounds(bounds)
    x0 = np.clip(FIT_START, lo, hi)

    def residuals(z):
        fitted = apply(states, z * scale)
        return np.array([math.log(predicted(m, lay, fitted.named(s), states.runtime) / tok)
                         for m, lay, tok, s in data])

    # A soft-L1 loss keeps a few broken runs (a stalled node, a pre-fix pipeline engine) from
    # dragging the constants.
    res = least_squares(residuals, x0 / scale, bounds=(lo / scale, hi / scale), loss="soft_l1",
                        f_scale=0.1, diff_step=1e-3)
    return apply(states, res.x * scale)


def cell_pairs(cell: dict, states: ClusterStates, per_run_fabric: bool = False) -> list:
    """(predicted, measured) tokens/s/GPU of each run of a cell, on its state's profile (and its
    job's own bandwidths with `per_run_fabric`)."""
    pairs = []
    for lay, r in cell.items():
        hw = states.of(r)
        pairs.append((predicted(r.model, lay, run_hardware(hw, r) if per_run_fabric else hw,
                                states.runtime), r.tokens_per_gpu))
    return pairs


def cell_errors(runs: list[Run], states: ClusterStates) -> tuple[dict, float]:
    """Median relative error of each cell's runs (one per layout, as `evaluate` takes them), each
    on its state's profile, and the median over all of them."""
    errs = {key: [abs(p - t) / t for p, t in cell_pairs(cell, states)]
            for key, cell in best_runs(runs).items()}
    return ({key: statistics.median(e) for key, e in errs.items()},
            statistics.median(x for e in errs.values() for x in e))


# The start-up latency scanned before the worst-cell search (s): the least-squares fit sits in a
# local minimum of the worst cell that the search's first steps do not leave.
LATENCY_SCAN = np.arange(0.40e-3, 0.801e-3, 0.025e-3)


def fit_worst_cell(runs: list[Run], states: ClusterStates = PLAYBOOK_STATES, max_nodes: int = 64,
                   bounds: dict[str, tuple[float, float]] | None = None,
                   evaluations: int = 1000) -> ClusterStates:
    """Calibrate on the acceptance's own measure: the constants that minimise the largest median
    error of a (model, nodes) cell, plus half the median error over all runs (which breaks ties
    toward the fit of every run). Least squares (`fit`) weighs every run alike, so the many runs
    on 1 to 16 nodes, where the inter-node start-up hardly shows, set the constants, and a median
    per cell is not what it minimises. Deterministic: from the least-squares fit, the start-up
    latency is scanned (`LATENCY_SCAN`), then Nelder-Mead moves every constant (log scale, within
    FIT_PARAMS' bounds)."""
    from scipy.optimize import minimize

    train = [r for r in runs if usable(r) and r.nodes <= max_nodes]
    start = params_of(fit(train, states, max_nodes, bounds))
    lo, hi, _ = fit_bounds(bounds)

    def objective_at(x: np.ndarray) -> float:
        medians, overall = cell_errors(train, apply(states, np.clip(x, lo, hi)))
        return max(medians.values()) + 0.5 * overall

    latency = FIT_FIELDS.index("inter_latency_s")
    scanned = [start.copy() for _ in LATENCY_SCAN]
    for x, value in zip(scanned, LATENCY_SCAN):
        x[latency] = value
    start = min(scanned, key=objective_at)
    # Log steps of 15%, alternately up and down, span the first simplex.
    n = len(start)
    simplex = np.vstack([np.zeros(n)] + [np.eye(n)[i] * (0.15 if i % 2 else -0.15)
                                          for i in range(n)])
    res = minimize(lambda z: objective_at(start * np.exp(z)), np.zeros(n), method="Nelder-Mead",
                   options=dict(maxfev=evaluations, initial_simplex=simplex, xatol=1e-3,
                                fatol=1e-4))
    return apply(states, np.clip(start * np.exp(res.x), lo, hi))


SENSITIVITY_FACTORS = (0.9, 0.95, 1.05, 1.1)


def sensitivity(runs: list[Run], states: ClusterStates = PLAYBOOK_STATES) -> dict:
    """The worst cell's median error with one fitted constant at a time scaled by each of
    SENSITIVITY_FACTORS (how far the calibration is from a cell over 15%), and as it is."""
    x0 = params_of(states)
    out = {"as_is": max(cell_errors(runs, states)[0].values())}
    for i, name in enumerate(FIT_FIELDS):
        out[name] = {}
        for factor in SENSITIVITY_FACTORS:
            x = x0.copy()
            x[i] *= factor
            out[name][factor] = max(cell_errors(runs, apply(states, x))[0].values())
    return out


def print_sensitivity(runs: list[Run], states: ClusterStates) -> None:
    res = sensitivity(runs, states)
    print(f"worst cell's median error, each constant scaled (as is: {res['as_is']:.1%})")
    print(f"{'constant':<22}" + "".join(f"{f'x{f}':>8}" for f in SENSITIVITY_FACTORS))
    for name in FIT_FIELDS:
        print(f"{name:<22}" + "".join(f"{res[name][f]:>8.1%}" for f in SENSITIVITY_FACTORS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the H100 constants on the CSV first")
    ap.add_argument("--objective", choices=["worst-cell", "least-squares"], default="worst-cell",
                    help="with --fit: minimise the worst cell's median error (the profiles' "
                         "constants; fit_worst_cell), or the soft-L1 least squares of every run's "
                         "log error")
    ap.add_argument("--csv", type=Path, default=CSV)
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    ap.add_argument("--one-state", metavar="PROFILE",
                    help="predict every run on this one profile (a name or YAML), whatever state "
                         "its job measured")
    ap.add_argument("--save-fit", type=Path,
                    help="with --fit: save the two fitted profiles here (DIR/<name>.yaml)")
    ap.add_argument("--fit-max-nodes", type=int, default=64,
                    help="fit only on runs of at most this many nodes (32: the 64-node cells are "
                         "then out of sample)")
    ap.add_argument("--per-micro-batch", action="store_true",
                    help="print, for each (model, nodes, dp, tp, pp, zero) with 3+ micro-batch "
                         "sizes, the measured and predicted step time per micro-batch slot")
    ap.add_argument("--per-layer-split", action="store_true",
                    help="print, per tp, the step per micro-batch at micro-batch 1 split into a "
                         "part per micro-batch and a part per layer (both models' runs of a "
                         "layout), measured and predicted")
    ap.add_argument("--fabric", action="store_true",
                    help="print, per cell, the all-reduce bus bandwidths the jobs measured, split by "
                         "the node's own all-reduce (NVLS at ~458 GB/s, or ~425 without)")
    ap.add_argument("--sensitivity", action="store_true",
                    help="print the worst cell's median error with each fitted constant scaled by "
                         "0.9, 0.95, 1.05 and 1.1")
    ap.add_argument("--per-run-fabric", action="store_true",
                    help="predict each run on the bus bandwidths its job measured (errors and "
                         "Spearman; the planner's ranking keeps the profiles' links)")
    ap.add_argument("--fit-on", choices=["1.34G", "3.57G"],
                    help="fit only on this model's runs (the other one is then held out)")
    ap.add_argument("--bound", action="append", default=[], metavar="NAME=LO:HI",
                    help="with --fit: other bounds for one of the fitted constants (e.g. "
                         "matmul_half_flops=1e8:3.1e9)")
    ap.add_argument("--cell", metavar="MODEL:NODES",
                    help="print one cell: every run, its state, measured and predicted, and the "
                         "planner's first ten layouts (e.g. 1.34G:64)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a field of both profiles before anything else (e.g. dp_overlap=1)")
    ap.add_argument("--runtime", choices=["nanotron", "nanotron-balanced"], default="nanotron",
                    help="predict for nanotron with the even pipeline split the H100 constants "
                         "were fitted with, or with its own cost-balanced split (refit with --fit)")
    args = ap.parse_args(argv)
    runs = load_runs(args.csv)
    states = PLAYBOOK_STATES
    if args.one_state:
        one = get_hardware(args.one_state)
        states = ClusterStates(nvls=one, no_nvls=one)
    if args.set:
        changes = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
        fields = set(Hardware.__dataclass_fields__)
        if set(changes) - fields:
            ap.error(f"--set: unknown field(s) {sorted(set(changes) - fields)}; a profile has "
                     f"{', '.join(sorted(fields))}")
        states = replace(states, nvls=states.nvls.with_(**changes),
                         no_nvls=states.no_nvls.with_(**changes))
    states = replace(states, runtime=args.runtime)
    bounds = {name: tuple(float(x) for x in span.split(":"))
              for name, span in (item.split("=", 1) for item in args.bound)}
    unknown = set(bounds) - set(FIT_FIELDS)
    if unknown:
        ap.error(f"--bound: unknown constant(s) {sorted(unknown)}; fitted: {', '.join(FIT_FIELDS)}")
    t0 = time.time()
    if args.fit:
        train = [r for r in runs if args.fit_on in (None, r.model_name)]
        fitter = fit_worst_cell if args.objective == "worst-cell" else fit
        states = fitter(train, states, args.fit_max_nodes, bounds)
        if args.save_fit:
            for hw in (states.nvls, states.no_nvls):
                hw.with_(source=f"fit on {args.csv.name}").save(args.save_fit / f"{hw.name}.yaml")
        print(f"fitted in {time.time() - t0:.0f}s:",
              {f: float(f"{v:.3g}") for f, v in zip(FIT_FIELDS, params_of(states))})
    if args.cell:
        name, _, nodes = args.cell.partition(":")
        cell = best_runs(runs).get((name, int(nodes) if nodes.isdigit() else -1))
        if cell is None:
            ap.error(f"--cell {args.cell}: no such cell; give MODEL:NODES with MODEL 1.34G or "
                     f"3.57G and NODES 1, 2, 4, 8, 16, 32 or 64")
        print_cell(cell, states, oom=oom_layouts(runs)[(name, int(nodes))])
        return 0
    if args.per_layer_split:
        print_per_layer_split(runs, states)
        return 0
    if args.per_micro_batch:
        print_per_micro_batch(runs, states)
        return 0
    if args.fabric:
        print_fabric(runs, states)
        return 0
    if args.sensitivity:
        print_sensitivity(runs, states)
        return 0
    figures = evaluate(runs, states, per_run_fabric=args.per_run_fabric)
    print_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print(f"({time.time() - t0:.0f}s)")
    return 0


def oom_layouts(runs: list[Run]) -> dict:
    """The layouts that ran out of memory, per (model, nodes) cell."""
    out: dict = defaultdict(set)
    for r in runs:
        if r.status == "OOM":
            out[(r.model_name, r.nodes)].add(r.layout)
    return out


def print_cell(cell: dict, states: ClusterStates, top: int = 10,
               oom: set | frozenset = frozenset()) -> None:
    """Every run of one cell, best first: its state, measured and predicted tok/s/GPU and step
    time; then the planner's first layouts on the profile of the best run's state, as `evaluate`
    ranks them, with what the runs measured for them (or that they ran out of memory: `oom`)."""
    runs = sorted(cell.values(), key=lambda r: -r.tokens_per_gpu)
    print("state    tok/s/GPU measured  predicted  error | step s measured  predicted | layout")
    for r in runs:
        pred = predict(r.model, r.layout, states.of(r), memory=False, runtime=states.runtime)
        step = measured_step_s(r)
        error = pred.tokens_per_s_per_device / r.tokens_per_gpu - 1
        print(f"{'nvls' if nvls(r) else 'no-nvls':<8} {r.tokens_per_gpu:18.0f} "
              f"{pred.tokens_per_s_per_device:10.0f} {error:+6.0%} | "
              f"{step:15.3f} {pred.step_time_s:10.3f} | {r.layout.short()}")
    best = runs[0]
    result = plan(best.model, best.layout.world_size, GLOBAL_SEQS * SEQ, states.of(best),
                  seq_len=SEQ, top=None, space=cell_space(cell), runtime=states.runtime)
    print(f"the planner on {states.of(best).name} (the best run's state):")
    for i, p in enumerate(result.ranked[:top], 1):
        r = cell.get(p.layout)
        ran = (f"{r.tokens_per_gpu:7.0f} ({'nvls' if nvls(r) else 'no-nvls'})" if r
               else "OOM" if p.layout in oom else "not run")
        print(f"{i:3d} {p.layout.short():44s} predicted {p.tokens_per_s_per_device:7.0f}  "
              f"measured {ran}")


def per_layer_split(runs: list[Run], states: ClusterStates) -> dict:
    """Per tp, at micro-batch 1 and pp 1, the step time per micro-batch of the two models split
    into a part per micro-batch and a part per layer: each layout run on both models (16 and 28
    layers) in the same state gives t = fixed + layers x per_layer, measured and predicted. At
    micro-batch 1 a tp > 1 block is bound by latencies and host work, which do not depend on the
    width, so the two models differ by their layer count. Returns {tp: (pairs, medians of the
    measured fixed and per-layer ms, medians of the predicted ones)}."""
    index: dict = {}
    for (name, nodes), cell in best_runs(runs).items():
        for lay, r in cell.items():
            if lay.pp == 1 and lay.mbs == 1:
                index[(name, nodes, lay.dp, lay.tp, lay.zero, nvls(r))] = r
    splits: dict = defaultdict(list)
    for key, small in index.items():
        big = index.get(("3.57G",) + key[1:])
        if key[0] != "1.34G" or big is None:
            continue
        meas, pred = [], []
        for r in (small, big):
            lay = r.layout
            meas.append(measured_step_s(r) / lay.grad_accum)
            pred.append(predict(r.model, lay, states.of(r), memory=False,
                                runtime=states.runtime).step_time_s / lay.grad_accum)
        layers = (small.model.num_layers, big.model.num_layers)
        pair = []
        for t in (meas, pred):
            per_layer = (t[1] - t[0]) / (layers[1] - layers[0])
            pair.append((1e3 * (t[0] - layers[0] * per_layer), 1e3 * per_layer))
        splits[key[3]].append(pair)
    return {tp: (len(v), *(tuple(statistics.median(p[i][j] for p in v) for j in (0, 1))
                           for i in (0, 1)))
            for tp, v in sorted(splits.items())}


def print_per_layer_split(runs: list[Run], states: ClusterStates) -> None:
    print("tp | pairs | measured per micro-batch + per layer (ms) | predicted (micro-batch 1, pp 1, "
          "both models, medians)")
    for tp, (n, meas, pred) in per_layer_split(runs, states).items():
        print(f"{tp:>2} | {n:>5} | {meas[0]:7.1f} + {meas[1]:5.2f} x layers | "
              f"{pred[0]:7.1f} + {pred[1]:5.2f} x layers")


def print_per_micro_batch(runs: list[Run], states: ClusterStates) -> None:
    """Step time over (micro-batches + pp - 1), the slots of a 1F1B schedule, in ms, measured and
    predicted, for each layout family run at three or more micro-batch sizes in one state of the
    cluster: flat where host work and latencies bound the step, growing with the micro-batch where
    the device does."""
    families: dict = defaultdict(list)
    for (name, nodes), cell in best_runs(runs).items():
        for lay, r in cell.items():
            families[(name, nodes, lay.dp, lay.tp, lay.pp, lay.zero, nvls(r))].append(r)
    print("model nodes dp tp pp zero state | micro-batch sizes | ms per slot, measured | predicted")
    for key in sorted(families):
        fam = sorted(families[key], key=lambda r: r.layout.mbs)
        if len(fam) < 3:
            continue
        meas, pred = [], []
        for r in fam:
            lay = r.layout
            slot = lay.global_batch_tokens / lay.world_size / (lay.grad_accum + lay.pp - 1)
            meas.append(1e3 * slot / r.tokens_per_gpu)
            pred.append(1e3 * slot / predicted(r.model, lay, states.of(r), states.runtime))
        print(f"{key[0]} n{key[1]} dp{key[2]} tp{key[3]} pp{key[4]} z{key[5]} "
              f"{'nvls' if key[6] else 'no-nvls'} | {[r.layout.mbs for r in fam]} | "
              f"{' '.join(f'{m:.0f}' for m in meas)} | {' '.join(f'{p:.0f}' for p in pred)}")


def print_fabric(runs: list[Run], states: ClusterStates) -> None:
    """The jobs' own bandwidth measurements per cell, in two groups by the node's all-reduce
    figure: the runs came from two states of the cluster, and the inter-node all-reduce bus
    bandwidth differs between them by up to 14x at the same node count."""
    groups: dict = defaultdict(lambda: ([], []))
    for r in runs:
        if usable(r):
            groups[(r.model_name, r.nodes)][not nvls(r)].append(r)
    print("model nodes | node all-reduce >= 440 GB/s (NVLS): runs, inter-node all-reduce / "
          "all-gather GB/s (medians), best tok/s/GPU | < 440 GB/s: the same")
    for key in sorted(groups):
        cols = []
        for rs in groups[key]:
            if rs:
                ar = statistics.median(r.inter_gbs["all_reduce"] for r in rs)
                ag = statistics.median(r.inter_gbs["all_gather"] for r in rs)
                best = max(rs, key=lambda r: r.tokens_per_gpu)
                cols.append(f"{len(rs):>3} {ar:5.0f} {ag:5.0f} {best.tokens_per_gpu:7.0f} "
                            f"({best.layout.short()})")
            else:
                cols.append(f"{0:>3} {'-':>5} {'-':>5} {'-':>7}")
        print(f"{key[0]} {key[1]:>3} | {cols[0]:<56} | {cols[1]}")
    print(f"inter-node all-reduce with NVLS on 4-64 nodes, median: "
          f"{nvls_inter_all_reduce_gbs(runs):.0f} GB/s")
    for kind, (busbw, fabric) in nvls_gather_scatter_law(runs).items():
        print(f"inter-node {kind.replace('_', '-')} with NVLS on 4-64 nodes: "
              f"1 / (1 / {busbw:.0f} + nodes / {fabric:.0f}) GB/s (least squares on the inverse "
              "medians)")
    # What the state does to a tensor-parallel layer: the measured step over the prediction
    # without the tp ring-step wait, per ring step, and per collective by tp.
    waits: dict = defaultdict(list)
    per_call: dict = defaultdict(list)
    for (_, nodes), cell in best_runs(runs).items():
        for lay, r in cell.items():
            if lay.tp > 1:
                hw = states.of(r)
                plain = predict(r.model, lay, hw.with_(tp_step_wait_s=0.0),
                                memory=False, runtime=states.runtime)
                measured = measured_step_s(r)
                slots = lay.grad_accum + lay.pp - 1
                # A stalled collective outlasts the GEMM beside it: all 10 of a block show
                # (`cost.tp_block_collectives`; every run here is sequence parallel).
                calls = 10 * slots * busiest_stage_layers(r.model, lay)
                extra = measured - plain.step_time_s
                waits[(nvls(r), lay.pp > 1, nodes)].append(1e3 * extra / (calls * (lay.tp - 1)))
                per_call[(nvls(r), lay.tp)].append(1e3 * extra / calls)
    print("measured step minus the prediction without a tp ring-step wait, per tp ring step "
          "(ms, median over the tp > 1 runs):")
    for (sharp, piped, nodes), v in sorted(waits.items()):
        print(f"  {'nvls' if sharp else 'no-nvls':>7} {'pp > 1' if piped else 'pp = 1':>6} "
              f"{nodes:>2} nodes: {statistics.median(v):6.3f} ({len(v)} runs)")
    print("the same per tp collective (10 per block and micro-batch), by tp (ms, median): a wait "
          "per ring step grows with tp - 1, a wait per collective would show as a floor at tp 2")
    for sharp in (False, True):
        row = "  ".join(f"tp {tp}: {statistics.median(v):5.2f} ({len(v)})"
                        for (s, tp), v in sorted(per_call.items()) if s == sharp)
        print(f"  {'nvls' if sharp else 'no-nvls':>7} {row}")
    print("ZeRO-1 over ZeRO-0 of the same layout, same state (tok/s, median): measured | predicted")
    for (sharp, nodes), (meas, pred, n) in sorted(zero_pairs(runs, states).items()):
        print(f"  {'nvls' if sharp else 'no-nvls':>7} {nodes:>2} nodes: {meas:.2f} | {pred:.2f}"
              f" ({n} pairs)")


def zero_pairs(runs: list[Run], states: ClusterStates) -> dict:
    """ZeRO-1 against ZeRO-0 of the same layout, both run in the same state: per (state is NVLS,
    nodes), the medians of the measured and of the predicted tokens/s ratio, and the pairs'
    count. Without SHARP ZeRO-1 wins (its reduce-scatter beats the slow all-reduce); with it,
    nanotron's ZeRO-1 loses on 16-32 nodes: its reduce-scatter holds the backward up, where
    ZeRO-0's all-reduce runs under it."""
    pairs: dict = defaultdict(list)
    for (_, nodes), cell in best_runs(runs).items():
        for lay, r in cell.items():
            twin = cell.get(replace(lay, zero=0)) if lay.zero == 1 else None
            if twin is not None and nvls(twin) == nvls(r):
                hw = states.of(r)
                pairs[(nvls(r), nodes)].append((
                    r.tokens_per_gpu / twin.tokens_per_gpu,
                    predicted(r.model, lay, hw, states.runtime)
                    / predicted(r.model, twin.layout, hw, states.runtime)))
    return {key: (statistics.median(m for m, _ in v), statistics.median(p for _, p in v), len(v))
            for key, v in pairs.items()}


def cell_space(meas: dict) -> SearchSpace:
    """The dimensions the cell's runs explored: their tp, pp and micro-batch values, ZeRO 0/1,
    sequence parallel, 1F1B, no recompute, no cp/ep."""
    layouts = list(meas)
    return SearchSpace(tp=sorted({l.tp for l in layouts}), pp=sorted({l.pp for l in layouts}),
                       cp=[1], ep=[1], zero=[0, 1], mbs=sorted({l.mbs for l in layouts}),
                       recompute=["none"], schedules=["1f1b"], tp_across_nodes=True,
                       grad_accum_dtype="fp32")


def evaluate(runs: list[Run], states: ClusterStates = PLAYBOOK_STATES,
             per_run_fabric: bool = False) -> dict:
    from scipy.stats import spearmanr

    cells = best_runs(runs)
    ooms = oom_layouts(runs)
    out = {"hardware": {"nvls": states.nvls.name, "no_nvls": states.no_nvls.name},
           "per_run_fabric": per_run_fabric, "cells": []}
    all_errors: list[float] = []
    for key in sorted(cells, key=lambda k: (k[0], k[1])):
        cell = cells[key]
        meas = {lay: r.tokens_per_gpu for lay, r in cell.items()}
        model = next(iter(cell.values())).model
        pairs = cell_pairs(cell, states, per_run_fabric)
        errs = [abs(p - t) / t for p, t in pairs]
        rho = float(spearmanr([p for p, _ in pairs], [t for _, t in pairs]).statistic)
        # The planner on the cluster as it was when the best run ran; a layout measured in the
        # other state measured another cluster, so its figure does not judge this ranking (with
        # one profile for both states, every run does).
        best_lay = max(meas, key=meas.get)
        state = nvls(cell[best_lay])
        one_state = states.nvls == states.no_nvls
        same_state = {lay for lay, r in cell.items() if one_state or nvls(r) == state}
        result = plan(model, key[1] * 8, GLOBAL_SEQS * SEQ, states.named(state),
                      seq_len=SEQ,
                      top=None, space=cell_space(meas), runtime=states.runtime)
        order = [p.layout for p in result.ranked]
        rank_best = order.index(best_lay) + 1 if best_lay in order else None
        first_measured = next((i for i, lay in enumerate(order) if lay in same_state), None)
        first_is_measured = bool(order) and order[0] in same_state
        top5_oom = sum(lay in ooms[key] for lay in order[:5])
        # Measured layouts the memory estimator calls too big: the planner never ranks them.
        refused = sum(not estimate_memory(model, lay, states.of(r), states.runtime).fits
                      for lay, r in cell.items())
        all_errors.extend(errs)
        out["cells"].append({
            "model": key[0], "nodes": key[1], "runs": len(pairs),
            "runs_nvls": sum(nvls(r) for r in cell.values()),
            "median_rel_error": statistics.median(errs), "spearman": rho,
            "best_measured": best_lay.short(), "best_measured_tok_s_gpu": meas[best_lay],
            "state_of_best": "nvls" if state else "no-nvls",
            "planner_rank_of_best_measured": rank_best,
            "best_in_top5": rank_best is not None and rank_best <= 5,
            "planner_first": order[0].short() if order else None,
            "planner_first_measured": first_is_measured,
            "planner_first_mfu_ratio": (meas[order[0]] / meas[best_lay] if first_is_measured
                                        else None),
            "first_measured_choice": (order[first_measured].short()
                                      if first_measured is not None else None),
            "first_measured_choice_rank": (first_measured + 1
                                           if first_measured is not None else None),
            "first_choice_mfu_ratio": (meas[order[first_measured]] / meas[best_lay]
                                       if first_measured is not None else None),
            "layouts_searched": result.considered, "layouts_fitting": len(order),
            "planner_top5_oom_in_runs": top5_oom,
            "measured_called_too_big": refused,
        })
    cells_ = out["cells"]
    literal = [c["planner_first_mfu_ratio"] for c in cells_ if c["planner_first_measured"]]
    out["summary"] = {
        "median_rel_error_all_runs": statistics.median(all_errors),
        "runs": len(all_errors),
        "cells_error_le_15pct": sum(c["median_rel_error"] <= 0.15 for c in cells_),
        "cells_spearman_ge_0.8": sum(c["spearman"] >= 0.8 for c in cells_),
        "cells_best_in_top5": sum(c["best_in_top5"] for c in cells_),
        "cells_first_within_5pct": sum((c["first_choice_mfu_ratio"] or 0) >= 0.95 for c in cells_),
        "cells_planner_first_measured": len(literal),
        "cells_planner_first_within_5pct": sum(r >= 0.95 for r in literal),
        "planner_top5_oom_in_runs": sum(c["planner_top5_oom_in_runs"] for c in cells_),
        "measured_called_too_big": sum(c["measured_called_too_big"] for c in cells_),
        "cells": len(cells_),
    }
    return out


def print_figures(fig: dict) -> None:
    print(f"{'model':<6} {'nodes':>5} {'runs':>8} {'med.err':>7} {'rho':>6} {'best@':>5} "
          f"{'1st/best':>8}  best measured (state) | planner first (first measured choice)")
    for c in fig["cells"]:
        ratio = c["first_choice_mfu_ratio"]
        first = c["planner_first"]
        if c["planner_first_measured"]:
            first += f" {c['planner_first_mfu_ratio']:.1%}"
        print(f"{c['model']:<6} {c['nodes']:>5} {c['runs']:>4}/{c['runs_nvls']:<3} "
              f"{c['median_rel_error']:>7.1%} {c['spearman']:>6.2f} "
              f"{str(c['planner_rank_of_best_measured']):>5} "
              f"{(f'{ratio:.1%}' if ratio is not None else '-'):>8}  {c['best_measured']} "
              f"({c['state_of_best']}) | {first} ({c['first_measured_choice']} "
              f"#{c['first_measured_choice_rank']})")
    s = fig["summary"]
    n = s["cells"]
    print(f"runs: all/with NVLS. median relative error over all {s['runs']} runs: "
          f"{s['median_rel_error_all_runs']:.1%}")
    print(f"cells: {n}; median error <= 15%: {s['cells_error_le_15pct']}/{n}; Spearman >= 0.8: "
          f"{s['cells_spearman_ge_0.8']}/{n}; best measured in top 5: {s['cells_best_in_top5']}/{n}; "
          f"first measured choice within 5% of best: {s['cells_first_within_5pct']}/{n}; the "
          f"planner's first choice itself measured in {s['cells_planner_first_measured']} cells, "
          f"within 5% in {s['cells_planner_first_within_5pct']}")
    print(f"layouts of the planner's top 5 that ran out of memory in the runs: "
          f"{s['planner_top5_oom_in_runs']} of {5 * n}; measured layouts the memory estimator "
          f"calls too big: {s['measured_called_too_big']} of {s['runs']}")


if __name__ == "__main__":
    sys.exit(main())
