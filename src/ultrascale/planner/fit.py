"""Fitting the H100 constants on the playbook's runs (`planner/playbook.py`): what the profiles
`h100-playbook` and `h100-playbook-nvls` (and every H100-class profile, `hardware.H100_FIT`) hold.

    python -m ultrascale.planner.fit                      # the worst-cell fit (the profiles' constants)
    python -m ultrascale.planner.fit --objective least-squares   # every run alike
    python -m ultrascale.planner.fit --hold-out 3.57G     # fit without that model's runs, judge on them
    python -m ultrascale.planner.fit --hold-out 64        # fit on 1 to 32 nodes, judge the 64-node cells
    python -m ultrascale.planner.fit --save-fit DIR       # write the two fitted profiles

The fitted quantities (`FIT_PARAMS`) are the compute and host efficiencies both states share, the
inter-node start-up, and the state without SHARP's tensor-parallel ring-step wait and fabric; the
state with SHARP keeps the bus bandwidths its jobs measured (`playbook.nvls_*`). Two objectives:
the worst cell's median error (the acceptance's own measure; `fit_worst_cell`, deterministic, about
a minute) and the soft-L1 least squares of every run's log error (`fit`, a few seconds). Held out
(`held_out`), the constants are fitted on part of the runs and each cell's figures are given for
the rest beside the fitted ones. Needs scipy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ultrascale.planner.hardware import Link
from ultrascale.planner.playbook import (
    CSV, PLAYBOOK_STATES, ClusterStates, Run, best_runs, cell_errors, cell_figures, load_runs, nvls,
    oom_layouts, predicted, summary, usable,
)


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


# ------------------------------------------------------------------------------------------------
# Held out: fitted on part of the runs, judged on the rest


def held_out_cells(hold_out: str):
    """Which cells `hold_out` names: a model's (1.34G, 3.57G) or a node count's (e.g. 64)."""
    if hold_out.isdigit():
        return lambda key: key[1] == int(hold_out)
    return lambda key: key[0] == hold_out


def held_out(runs: list[Run], hold_out: str, objective: str = "least-squares",
             states: ClusterStates = PLAYBOOK_STATES) -> dict:
    """Fit the constants without the runs of the cells `hold_out` names, then every cell's
    figures (`playbook.cell_figures`) on them: the held-out cells' and, beside them, the fitted
    ones', each group with its summary (`playbook.summary`)."""
    held = held_out_cells(hold_out)
    cells, ooms = best_runs(runs), oom_layouts(runs)
    if not any(held(key) for key in cells):
        models, nodes = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
        raise ValueError(f"--hold-out {hold_out}: no such cells; give a model ("
                         f"{', '.join(models)}) or a node count ({', '.join(map(str, nodes))})")
    train = [r for r in runs if not held((r.model_name, r.nodes))]
    fitter = fit_worst_cell if objective == "worst-cell" else fit
    fitted = fitter(train, states)
    groups: dict[str, tuple[list, list]] = {"held_out": ([], []), "fitted": ([], [])}
    for key in sorted(cells):
        figures, errs = cell_figures(key, cells[key], fitted, ooms[key])
        group_cells, group_errors = groups["held_out" if held(key) else "fitted"]
        group_cells.append(figures)
        group_errors.extend(errs)
    return {"hold_out": hold_out, "objective": objective,
            "constants": {f: float(v) for f, v in zip(FIT_FIELDS, params_of(fitted))},
            **{name: {"cells": c, "summary": summary(c, e)} for name, (c, e) in groups.items()}}


def print_held_out(res: dict) -> None:
    print(f"{'model':<6} {'nodes':>5} {'runs':>4} {'med.err':>7} {'rho':>6} {'best@':>5} "
          f"{'1st/best':>8}  cell")
    for name in ("held_out", "fitted"):
        for c in res[name]["cells"]:
            ratio = c["first_choice_mfu_ratio"]
            print(f"{c['model']:<6} {c['nodes']:>5} {c['runs']:>4} {c['median_rel_error']:>7.1%} "
                  f"{c['spearman']:>6.2f} {str(c['planner_rank_of_best_measured']):>5} "
                  f"{(f'{ratio:.1%}' if ratio is not None else '-'):>8}  "
                  f"{name.replace('_', ' ')}")
    for name in ("held_out", "fitted"):
        s = res[name]["summary"]
        n = s["cells"]
        print(f"{name.replace('_', ' ')}: {n} cells, {s['runs']} runs, median error "
              f"{s['median_rel_error_all_runs']:.1%}; median error <= 15%: "
              f"{s['cells_error_le_15pct']}/{n}; Spearman >= 0.8: {s['cells_spearman_ge_0.8']}/{n};"
              f" best measured in top 5: {s['cells_best_in_top5']}/{n}; first measured choice "
              f"within 5%: {s['cells_first_within_5pct']}/{n}")


# ------------------------------------------------------------------------------------------------
# The command


def add_fit_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a fit (this command's, and `planner_vs_playbook.py --fit`'s)."""
    ap.add_argument("--objective", choices=["worst-cell", "least-squares"], default="worst-cell",
                    help="minimise the worst cell's median error (the profiles' constants; "
                         "fit_worst_cell), or the soft-L1 least squares of every run's log error")
    ap.add_argument("--csv", type=Path, default=CSV)
    ap.add_argument("--save-fit", type=Path,
                    help="save the two fitted profiles here (DIR/<name>.yaml)")
    ap.add_argument("--fit-max-nodes", type=int, default=64,
                    help="fit only on runs of at most this many nodes (32: the 64-node cells are "
                         "then out of sample)")
    ap.add_argument("--bound", action="append", default=[], metavar="NAME=LO:HI",
                    help="other bounds for one of the fitted constants (e.g. "
                         "matmul_half_flops=1e8:3.1e9)")


def parse_bounds(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, tuple[float, float]]:
    bounds = {name: tuple(float(x) for x in span.split(":"))
              for name, span in (item.split("=", 1) for item in items)}
    unknown = set(bounds) - set(FIT_FIELDS)
    if unknown:
        ap.error(f"--bound: unknown constant(s) {sorted(unknown)}; fitted: {', '.join(FIT_FIELDS)}")
    return bounds


def fit_states(runs: list[Run], states: ClusterStates, objective: str, max_nodes: int,
               bounds: dict, save: Path | None = None, source: str = "") -> ClusterStates:
    """Fit, print the constants (and save the profiles)."""
    t0 = time.time()
    fitter = fit_worst_cell if objective == "worst-cell" else fit
    states = fitter(runs, states, max_nodes, bounds)
    if save:
        for hw in (states.nvls, states.no_nvls):
            hw.with_(source=f"fit on {source}").save(save / f"{hw.name}.yaml")
    print(f"fitted in {time.time() - t0:.0f}s:",
          {f: float(f"{v:.3g}") for f, v in zip(FIT_FIELDS, params_of(states))})
    return states


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultrascale.planner.fit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_arguments(ap)
    ap.add_argument("--hold-out", metavar="MODEL_OR_NODES",
                    help="fit without the cells of this model (1.34G, 3.57G) or node count, then "
                         "their figures beside the fitted cells'")
    args = ap.parse_args(argv)
    bounds = parse_bounds(ap, args.bound)
    if not args.csv.is_file():
        ap.error(f"--csv {args.csv}: no such file (the playbook's runs: benchmarks/data/"
                 "playbook_bench_1b_3b.csv in a source checkout)")
    runs = load_runs(args.csv)
    if args.hold_out:
        try:
            res = held_out(runs, args.hold_out, args.objective)
        except ValueError as exc:
            ap.error(str(exc))
        print(f"fitted ({args.objective}) without the {args.hold_out} cells:",
              {f: float(f"{v:.3g}") for f, v in res["constants"].items()})
        print_held_out(res)
        return 0
    fit_states(runs, PLAYBOOK_STATES, args.objective, args.fit_max_nodes, bounds, args.save_fit,
               args.csv.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
