"""The playbook's published H100 runs, the planner's reference (benchmarks/data/
playbook_bench_1b_3b.csv): the runs, the cluster's two states, and the figures of the planner on
them.

Rows used: status Success, dp x tp x pp = 8 x nodes, global batch 256 x 4096 tokens, and for
pp > 1 only runs after nanotron's pipeline-engine fix (after_pp_fix). Repeated layouts keep their
best run. The cluster ran in two states, and every job measured which before it trained: its
node's all-reduce ran with NVLink SHARP (~458 GB/s bus bandwidth; profile `h100-playbook-nvls`)
or without it (~425 GB/s; profile `h100-playbook`, whose tensor-parallel ring steps wait ~0.27 ms
each). Each run is predicted on the profile of its own job's state, as a planner is used on a
cluster calibrated the day it runs.

For each (model, nodes) cell `evaluate` gives: the median relative error of predicted
tokens/s/GPU and the Spearman rank correlation of predicted and measured (each run on its state's
profile); then the planner, on the profile of the state in which the cell's best measured layout
ran, searching only the dimensions those runs explored (their tp, pp and micro-batch values,
ZeRO 0/1, sequence parallel, 1F1B, no recompute, keeping what fits by the memory estimator with
nanotron's implementation): its rank of the best measured layout, and the measured throughput of
its highest-ranked layout measured in that state as a fraction of the best measured (the MFU
ratio: same model, same FLOPs per token); and the same ratio for its first choice itself where
that layout was measured in that state. `planner/fit.py` fits the H100 constants on these runs;
`benchmarks/planner_vs_playbook.py` prints it all.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.cost import estimate_memory, predict
from ultrascale.planner.hardware import H100_PLAYBOOK, H100_PLAYBOOK_NVLS, Hardware
from ultrascale.planner.search import SearchSpace, plan
from ultrascale.playbook_rows import row_models, shape_key

# The repository's recorded data: a source checkout has it (an installed package does not: give
# the commands --csv).
BENCHMARK_DATA = Path(__file__).resolve().parents[3] / "benchmarks" / "data"
CSV = BENCHMARK_DATA / "playbook_bench_1b_3b.csv"
SEQ = 4096
GLOBAL_SEQS = 256  # 1M tokens


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
    """The rows that reach 1M tokens on every GPU of their nodes (a few test rows do not); each
    row's model as `playbook_rows.row_models` reads it."""
    runs = []
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    models = row_models(rows)
    for row in rows:
        name, model = models[shape_key(row)]
        dp, tp, pp = int(row["dp"]), int(row["tp"]), int(row["pp"])
        mbs, acc = int(row["mbs"]), int(float(row["batch_accum"]))
        nodes = int(float(row["nodes"]))
        if dp * tp * pp != nodes * 8 or dp * mbs * acc != GLOBAL_SEQS:
            continue
        lay = Layout(dp=dp, tp=tp, pp=pp, zero=int(row["zero_stage"]), mbs=mbs, grad_accum=acc,
                     seq_len=SEQ, sequence_parallel=tp > 1, pp_schedule="1f1b", dtype="bf16",
                     grad_accum_dtype="fp32", bucket_mb=25.0)
        tok = float(row["tok/s/gpu"]) if row["status"] == "Success" else None
        runs.append(Run(name, model, nodes, lay, row["status"], tok,
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


def oom_layouts(runs: list[Run]) -> dict:
    """The layouts that ran out of memory, per (model, nodes) cell."""
    out: dict = defaultdict(set)
    for r in runs:
        if r.status == "OOM":
            out[(r.model_name, r.nodes)].add(r.layout)
    return out


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
    """The figures of every cell and their summary (the module's docstring says which)."""
    cells = best_runs(runs)
    ooms = oom_layouts(runs)
    out = {"hardware": {"nvls": states.nvls.name, "no_nvls": states.no_nvls.name},
           "per_run_fabric": per_run_fabric, "cells": []}
    all_errors: list[float] = []
    for key in sorted(cells, key=lambda k: (k[0], k[1])):
        figures, errs = cell_figures(key, cells[key], states, ooms[key], per_run_fabric)
        all_errors.extend(errs)
        out["cells"].append(figures)
    out["summary"] = summary(out["cells"], all_errors)
    return out


def cell_figures(key: tuple, cell: dict, states: ClusterStates, ooms: set,
                 per_run_fabric: bool = False) -> tuple[dict, list[float]]:
    """One cell's figures, and its runs' relative errors."""
    from scipy.stats import spearmanr

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
    result = plan(model, key[1] * 8, GLOBAL_SEQS * SEQ, states.named(state), seq_len=SEQ,
                  top=None, space=cell_space(meas), runtime=states.runtime)
    order = [p.layout for p in result.ranked]
    rank_best = order.index(best_lay) + 1 if best_lay in order else None
    first_measured = next((i for i, lay in enumerate(order) if lay in same_state), None)
    first_is_measured = bool(order) and order[0] in same_state
    # Measured layouts the memory estimator calls too big: the planner never ranks them.
    refused = sum(not estimate_memory(model, lay, states.of(r), states.runtime).fits
                  for lay, r in cell.items())
    figures = {
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
        "planner_top5_oom_in_runs": sum(lay in ooms for lay in order[:5]),
        "measured_called_too_big": refused,
    }
    return figures, errs


def summary(cells_: list[dict], all_errors: list[float]) -> dict:
    """Over the cells: how many meet each target."""
    literal = [c["planner_first_mfu_ratio"] for c in cells_ if c["planner_first_measured"]]
    return {
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
