"""The planner against the playbook's published H100 runs: the report and its command
(`python benchmarks/planner_vs_playbook.py`, whose docstring lists the command lines; the runs and
the figures are `playbook.py`'s, the fit `fit.py`'s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from ultrascale.planner.cost import predict
from ultrascale.planner.fit import (
    FIT_FIELDS, SENSITIVITY_FACTORS, add_fit_arguments, fit_states, parse_bounds, sensitivity,
)
from ultrascale.planner.hardware import Hardware, get_hardware
from ultrascale.planner.playbook import (
    GLOBAL_SEQS, PLAYBOOK_STATES, SEQ, ClusterStates, Run, best_runs, cell_space, evaluate,
    load_runs, measured_step_s, nvls, nvls_gather_scatter_law, nvls_inter_all_reduce_gbs,
    oom_layouts, per_layer_split, predicted, usable, zero_pairs,
)
from ultrascale.planner.search import plan
from ultrascale.theory.pipeline import busiest_stage_layers


def print_sensitivity(runs: list[Run], states: ClusterStates) -> None:
    res = sensitivity(runs, states)
    print(f"worst cell's median error, each constant scaled (as is: {res['as_is']:.1%})")
    print(f"{'constant':<22}" + "".join(f"{f'x{f}':>8}" for f in SENSITIVITY_FACTORS))
    for name in FIT_FIELDS:
        print(f"{name:<22}" + "".join(f"{res[name][f]:>8.1%}" for f in SENSITIVITY_FACTORS))


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


def parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description or __doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the H100 constants on the CSV first")
    add_fit_arguments(ap)
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    ap.add_argument("--one-state", metavar="PROFILE",
                    help="predict every run on this one profile (a name or YAML), whatever state "
                         "its job measured")
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
    ap.add_argument("--fit-on", metavar="MODEL",
                    help="fit only on this model's runs, e.g. 1.34G (the others are then held "
                         "out)")
    ap.add_argument("--cell", metavar="MODEL:NODES",
                    help="print one cell: every run, its state, measured and predicted, and the "
                         "planner's first ten layouts (e.g. 1.34G:64)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a field of both profiles before anything else (e.g. dp_overlap=1)")
    ap.add_argument("--runtime", choices=["nanotron", "nanotron-balanced"], default="nanotron",
                    help="predict for nanotron with the even pipeline split the H100 constants "
                         "were fitted with, or with its own cost-balanced split (refit with --fit)")
    return ap


def states_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> ClusterStates:
    """The profiles the runs are predicted on: the playbook's two states, or `--one-state` for
    both, with `--set` fields and `--runtime`."""
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
    return replace(states, runtime=args.runtime)


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    ap = parser(description)
    args = ap.parse_args(argv)
    runs = load_runs(args.csv)
    states = states_of(ap, args)
    bounds = parse_bounds(ap, args.bound)
    t0 = time.time()
    names = sorted({r.model_name for r in runs})
    if args.fit_on is not None and args.fit_on not in names:
        ap.error(f"--fit-on {args.fit_on}: no such model in {args.csv}; give one of "
                 f"{', '.join(names)}")
    if args.fit:
        train = [r for r in runs if args.fit_on in (None, r.model_name)]
        states = fit_states(train, states, args.objective, args.fit_max_nodes, bounds,
                            args.save_fit, args.csv.name)
    if args.cell:
        name, _, nodes = args.cell.partition(":")
        cell = best_runs(runs).get((name, int(nodes) if nodes.isdigit() else -1))
        if cell is None:
            cells = sorted(best_runs(runs), key=lambda key: (key[0], key[1]))
            ap.error(f"--cell {args.cell}: no such cell; give MODEL:NODES, one of "
                     f"{', '.join(f'{m}:{n}' for m, n in cells)}")
        print_cell(cell, states, oom=oom_layouts(runs)[(name, int(nodes))])
        return 0
    for flag, report in ((args.per_layer_split, print_per_layer_split),
                         (args.per_micro_batch, print_per_micro_batch),
                         (args.fabric, print_fabric), (args.sensitivity, print_sensitivity)):
        if flag:
            report(runs, states)
            return 0
    figures = evaluate(runs, states, per_run_fabric=args.per_run_fabric)
    print_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    print(f"({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
