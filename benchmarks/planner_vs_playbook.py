"""The planner against the playbook's published H100 runs (benchmarks/data/playbook_bench_1b_3b.csv).

    python benchmarks/planner_vs_playbook.py            # figures per (model, nodes) cell
    python benchmarks/planner_vs_playbook.py --fit      # refit the H100 efficiency constants first
    python benchmarks/planner_vs_playbook.py --json out.json
    python benchmarks/planner_vs_playbook.py --fit --fit-on 1.34G   # hold the 3.57G runs out
    python benchmarks/planner_vs_playbook.py --per-micro-batch     # time per micro-batch by layout
    python benchmarks/planner_vs_playbook.py --fabric              # the bus bandwidths each job measured
    python benchmarks/planner_vs_playbook.py --per-run-fabric      # each run on its job's bandwidths

Profile: `h100-playbook` (the H100 constants fitted on these rows, plus the cluster's shared
fabric). Rows used: status Success, dp x tp x pp = 8 x nodes, global batch 256 x 4096 tokens, and
for pp > 1 only runs after nanotron's pipeline-engine fix (after_pp_fix). Repeated layouts keep
their best run.

For each (model, nodes) cell: median relative error of predicted tokens/s/GPU, Spearman rank
correlation of predicted and measured, the planner's rank of the best measured layout (searching
only the dimensions those runs explored: their tp, pp and micro-batch values, ZeRO 0/1, sequence
parallel, 1F1B, no recompute, keeping what fits by the memory estimator with nanotron's runtime),
and the measured throughput of the planner's highest-ranked measured layout as a fraction of the
best measured (the MFU ratio: same model, same FLOPs per token).
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import H100_PLAYBOOK, Hardware
from ultrascale.planner.search import SearchSpace, plan

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


def measured_by_layout(runs: list[Run]) -> dict:
    """Usable runs per cell, one figure per layout (the best of repeated runs)."""
    return {key: {lay: r.tokens_per_gpu for lay, r in cell.items()}
            for key, cell in best_runs(runs).items()}


def run_hardware(hw: Hardware, run: Run) -> Hardware:
    """`hw` with the bus bandwidths the run's own job measured (a calibration per job): inside a
    node its node's figures, across nodes the whole job's as the node's bus bandwidth, no fabric
    cap (the job's figure already holds it)."""
    def link(base, gbs, fabric):
        busbw = dict(base.busbw, **{k: v * 1e9 for k, v in (gbs or {}).items()})
        return type(base)(busbw=busbw, latency_s=base.latency_s,
                          fabric_bw=base.fabric_bw if fabric else None)
    inter = run.inter_gbs if run.nodes > 1 else None
    return hw.with_(intra=link(hw.intra, run.intra_gbs, True),
                    inter=link(hw.inter, inter, inter is None))


def predicted(model: ModelConfig, lay: Layout, hw: Hardware) -> float:
    return predict(model, lay, hw, memory=False).tokens_per_s_per_device


# ------------------------------------------------------------------------------------------------
# Fitting the efficiency constants


FIT_FIELDS = ("matmul_eff_max", "matmul_half_flops", "attention_eff", "hbm_eff",
              "intra_latency", "inter_latency", "fabric_scale", "layer_overhead_s", "host_overlap",
              "dp_overlap")


def apply(hw: Hardware, x: np.ndarray) -> Hardware:
    eff, half, attn, hbm, lat_i, lat_x, fabric_scale, mb, overlap, dp_ov = (float(v) for v in x)
    inter = type(hw.inter)(busbw=hw.inter.busbw, latency_s=lat_x,
                           fabric_bw={k: v * fabric_scale for k, v in H100_PLAYBOOK.inter.fabric_bw.items()})
    intra = type(hw.intra)(busbw=hw.intra.busbw, latency_s=lat_i)
    return hw.with_(matmul_eff_max=eff, matmul_half_flops=half, attention_eff=attn, hbm_eff=hbm,
                    intra=intra, inter=inter, layer_overhead_s=mb, host_overlap=overlap,
                    dp_overlap=dp_ov)


def fit(runs: list[Run], hw: Hardware, max_nodes: int = 32) -> Hardware:
    from scipy.optimize import least_squares

    data = [(r.model, r.layout, r.tokens_per_gpu) for r in runs
            if usable(r) and r.nodes <= max_nodes]
    x0 = np.array([min(hw.matmul_eff_max, 0.85), min(hw.matmul_half_flops, 3e10), max(hw.attention_eff, 0.15),
                   min(hw.hbm_eff, 0.95),
                   max(hw.intra.latency_s, 5e-6), hw.inter.latency_s, 1.0, hw.layer_overhead_s,
                   hw.host_overlap, hw.dp_overlap])
    # Bounds keep the constants physical: cuBLAS reaches at most ~85% of the H100's dense peak and
    # half of that on GEMMs of at most 30 GFLOP, flash attention 15-80%, elementwise kernels at
    # most 95% of HBM bandwidth, an NVLink step at least 5 us, overlap between 0 and 1.
    lo = np.array([0.5, 1e8, 0.15, 0.3, 5e-6, 0.0, 0.1, 0.0, 0.0, 0.0])
    hi = np.array([0.85, 3e10, 0.8, 0.95, 5e-3, 5e-2, 4.0, 0.01, 1.0, 1.0])
    scale = np.array([0.1, 1e9, 0.1, 0.1, 1e-4, 1e-3, 0.3, 1e-4, 0.1, 0.1])

    def residuals(z):
        h = apply(hw, z * scale)
        return np.array([math.log(predicted(m, lay, h) / tok) for m, lay, tok in data])

    # A soft-L1 loss keeps a few broken runs (a stalled node, a pre-fix pipeline engine) from
    # dragging the constants.
    res = least_squares(residuals, x0 / scale, bounds=(lo / scale, hi / scale), loss="soft_l1",
                        f_scale=0.1, diff_step=1e-3)
    return apply(hw, res.x * scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the H100 constants on the CSV first")
    ap.add_argument("--csv", type=Path, default=CSV)
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    ap.add_argument("--profile", type=Path, help="use this hardware profile YAML (e.g. a saved fit)")
    ap.add_argument("--save-fit", type=Path, help="with --fit: save the fitted profile here")
    ap.add_argument("--fit-max-nodes", type=int, default=32,
                    help="fit only on runs of at most this many nodes (default 32: on 64 nodes the "
                         "runs are slow in both of the cluster's states, each extra micro-batch "
                         "costing 0.7-0.8 s that no bandwidth explains; see --fabric)")
    ap.add_argument("--per-micro-batch", action="store_true",
                    help="print, for each (model, nodes, dp, tp, pp, zero) with 3+ micro-batch "
                         "sizes, the measured and predicted step time per micro-batch slot")
    ap.add_argument("--fabric", action="store_true",
                    help="print, per cell, the all-reduce bus bandwidths the jobs measured, split by "
                         "the node's own all-reduce (NVLS at ~458 GB/s, or ~425 without)")
    ap.add_argument("--per-run-fabric", action="store_true",
                    help="predict each run on the bus bandwidths its job measured (errors and "
                         "Spearman; the planner's ranking keeps the profile's one fabric)")
    ap.add_argument("--fit-on", choices=["1.34G", "3.57G"],
                    help="fit only on this model's runs (the other one is then held out)")
    args = ap.parse_args(argv)
    runs = load_runs(args.csv)
    hw = Hardware.load(args.profile) if args.profile else H100_PLAYBOOK
    t0 = time.time()
    if args.fit:
        train = [r for r in runs if args.fit_on in (None, r.model_name)]
        hw = fit(train, hw, args.fit_max_nodes)
        if args.save_fit:
            hw.with_(source=f"fit on {args.csv.name}").save(args.save_fit)
        print(f"fitted in {time.time() - t0:.0f}s:", {f: getattr(hw, f, None) for f in FIT_FIELDS},
              "intra", hw.intra, "inter", hw.inter)
    if args.per_micro_batch:
        print_per_micro_batch(runs, hw)
        return 0
    if args.fabric:
        print_fabric(runs, hw)
        return 0
    figures = evaluate(runs, hw, per_run_fabric=args.per_run_fabric)
    print_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print(f"({time.time() - t0:.0f}s)")
    return 0


def print_per_micro_batch(runs: list[Run], hw: Hardware) -> None:
    """Step time over (micro-batches + pp - 1), the slots of a 1F1B schedule, in ms, measured and
    predicted, for each layout family run at three or more micro-batch sizes: flat where host
    work and latencies bound the step, growing with the micro-batch where the device does."""
    cells = measured_by_layout(runs)
    families: dict = defaultdict(list)
    for (name, nodes), meas in cells.items():
        model = next(r.model for r in runs if r.model_name == name)
        for lay, tok in meas.items():
            families[(name, nodes, lay.dp, lay.tp, lay.pp, lay.zero)].append((lay, tok, model))
    print("model nodes dp tp pp zero | micro-batch sizes | ms per slot, measured | predicted")
    for key in sorted(families):
        fam = sorted(families[key], key=lambda x: x[0].mbs)
        if len(fam) < 3:
            continue
        meas, pred = [], []
        for lay, tok, model in fam:
            slots = lay.grad_accum + lay.pp - 1
            tokens = lay.global_batch_tokens
            meas.append(1e3 * tokens / (tok * lay.world_size) / slots)
            pred.append(1e3 * tokens / (predicted(model, lay, hw) * lay.world_size) / slots)
        print(f"{key[0]} n{key[1]} dp{key[2]} tp{key[3]} pp{key[4]} z{key[5]} | "
              f"{[x[0].mbs for x in fam]} | {' '.join(f'{m:.0f}' for m in meas)} | "
              f"{' '.join(f'{p:.0f}' for p in pred)}")


NVLS_GBS = 440  # a node's all-reduce above this ran with NVLink SHARP (~458 GB/s); ~425 without


def print_fabric(runs: list[Run], hw: Hardware) -> None:
    """The jobs' own bandwidth measurements per cell, in two groups by the node's all-reduce
    figure: the runs came from (at least) two states of the cluster, and the inter-node all-reduce
    bus bandwidth differs between them by up to 14x at the same node count."""
    groups: dict = defaultdict(lambda: ([], []))
    for r in runs:
        if usable(r) and r.inter_gbs and r.intra_gbs:
            groups[(r.model_name, r.nodes)][r.intra_gbs["all_reduce"] < NVLS_GBS].append(r)
    print("model nodes | node all-reduce >= 440 GB/s: runs, inter-node all-reduce GB/s (median), "
          "best tok/s/GPU | < 440 GB/s: the same")
    for key in sorted(groups):
        cols = []
        for rs in groups[key]:
            if rs:
                bw = statistics.median(r.inter_gbs["all_reduce"] for r in rs)
                best = max(rs, key=lambda r: r.tokens_per_gpu)
                cols.append(f"{len(rs):>3} {bw:6.0f} {best.tokens_per_gpu:8.0f} "
                            f"({best.layout.short()})")
            else:
                cols.append(f"{0:>3} {'-':>6} {'-':>8}")
        print(f"{key[0]} {key[1]:>3} | {cols[0]:<52} | {cols[1]}")
    # The state goes with the micro-batch on small clusters: predicted against measured there.
    errors: dict = defaultdict(list)
    for r in runs:
        if usable(r) and r.intra_gbs and r.layout.pp == 1 and r.layout.tp <= 2 and r.nodes <= 8:
            state = "first" if r.intra_gbs["all_reduce"] >= NVLS_GBS else "second"
            errors[(r.layout.mbs > 1, state)].append(
                predicted(r.model, r.layout, hw) / r.tokens_per_gpu - 1)
    print("tp 1-2, pp 1 on 1-8 nodes, predicted / measured - 1 (h100-playbook):")
    for (big, state), errs in sorted(errors.items()):
        print(f"  micro-batch {'>= 2' if big else '1'}, {state} state: {len(errs)} runs, median "
              f"{statistics.median(errs):+.0%}, from {min(errs):+.0%} to {max(errs):+.0%}")


def cell_space(meas: dict) -> SearchSpace:
    """The dimensions the cell's runs explored: their tp, pp and micro-batch values, ZeRO 0/1,
    sequence parallel, 1F1B, no recompute, no cp/ep."""
    layouts = list(meas)
    return SearchSpace(tp=sorted({l.tp for l in layouts}), pp=sorted({l.pp for l in layouts}),
                       cp=[1], ep=[1], zero=[0, 1], mbs=sorted({l.mbs for l in layouts}),
                       recompute=["none"], schedules=["1f1b"], tp_across_nodes=True,
                       grad_accum_dtype="fp32")


def evaluate(runs: list[Run], hw: Hardware, per_run_fabric: bool = False) -> dict:
    from scipy.stats import spearmanr

    cells = best_runs(runs)
    out = {"hardware": hw.name, "per_run_fabric": per_run_fabric, "cells": []}
    all_errors: list[float] = []
    for key in sorted(cells, key=lambda k: (k[0], k[1])):
        meas = {lay: r.tokens_per_gpu for lay, r in cells[key].items()}
        model = next(r.model for r in runs if r.model_name == key[0])
        pairs = [(predicted(model, lay, run_hardware(hw, r) if per_run_fabric else hw),
                  r.tokens_per_gpu) for lay, r in cells[key].items()]
        errs = [abs(p - t) / t for p, t in pairs]
        rho = float(spearmanr([p for p, _ in pairs], [t for _, t in pairs]).statistic)
        result = plan(model, key[1] * 8, GLOBAL_SEQS * SEQ, hw, seq_len=SEQ, top=None,
                      space=cell_space(meas), runtime="nanotron")
        order = [p.layout for p in result.ranked]
        best_lay = max(meas, key=meas.get)
        rank_best = order.index(best_lay) + 1 if best_lay in order else None
        first_measured = next((i for i, lay in enumerate(order) if lay in meas), None)
        all_errors.extend(errs)
        out["cells"].append({
            "model": key[0], "nodes": key[1], "runs": len(pairs),
            "median_rel_error": statistics.median(errs), "spearman": rho,
            "best_measured": best_lay.short(), "best_measured_tok_s_gpu": meas[best_lay],
            "planner_rank_of_best_measured": rank_best,
            "best_in_top5": rank_best is not None and rank_best <= 5,
            "planner_first": order[0].short() if order else None,
            "planner_first_measured": order[0] in meas if order else False,
            "first_measured_choice": (order[first_measured].short()
                                      if first_measured is not None else None),
            "first_measured_choice_rank": (first_measured + 1
                                           if first_measured is not None else None),
            "first_choice_mfu_ratio": (meas[order[first_measured]] / meas[best_lay]
                                       if first_measured is not None else None),
            "layouts_searched": result.considered, "layouts_fitting": len(order),
        })
    cells_ = out["cells"]
    out["summary"] = {
        "median_rel_error_all_runs": statistics.median(all_errors),
        "runs": len(all_errors),
        "cells_error_le_15pct": sum(c["median_rel_error"] <= 0.15 for c in cells_),
        "cells_spearman_ge_0.8": sum(c["spearman"] >= 0.8 for c in cells_),
        "cells_best_in_top5": sum(c["best_in_top5"] for c in cells_),
        "cells_first_within_5pct": sum((c["first_choice_mfu_ratio"] or 0) >= 0.95 for c in cells_),
        "cells": len(cells_),
    }
    return out


def print_figures(fig: dict) -> None:
    print(f"{'model':<6} {'nodes':>5} {'runs':>4} {'med.err':>7} {'rho':>6} {'best@':>5} "
          f"{'1st/best':>8}  planner first (measured choice)")
    for c in fig["cells"]:
        ratio = c["first_choice_mfu_ratio"]
        print(f"{c['model']:<6} {c['nodes']:>5} {c['runs']:>4} {c['median_rel_error']:>7.1%} "
              f"{c['spearman']:>6.2f} {str(c['planner_rank_of_best_measured']):>5} "
              f"{(f'{ratio:.1%}' if ratio is not None else '-'):>8}  {c['planner_first']} "
              f"({c['first_measured_choice']} #{c['first_measured_choice_rank']})")
    s = fig["summary"]
    n = s["cells"]
    print(f"median relative error over all {s['runs']} runs: {s['median_rel_error_all_runs']:.1%}")
    print(f"cells: {n}; median error <= 15%: {s['cells_error_le_15pct']}/{n}; Spearman >= 0.8: "
          f"{s['cells_spearman_ge_0.8']}/{n}; best measured in top 5: {s['cells_best_in_top5']}/{n}; "
          f"first measured choice within 5% of best: {s['cells_first_within_5pct']}/{n}")


if __name__ == "__main__":
    sys.exit(main())
