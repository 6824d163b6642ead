"""The planner against a sweep measured on this machine (`ultrascale sweep`).

    python -m ultrascale.planner.sweep_compare ...                # as benchmarks/planner_vs_sweep.py

    ultrascale calibrate --ranks 4                                   # the profile (local)
    ultrascale sweep benchmarks/sweep_cpu_4ranks.yaml                # the measurements
    python benchmarks/planner_vs_sweep.py                            # this comparison
    python benchmarks/planner_vs_sweep.py --csv A/results.csv --csv B/results.csv --json out.json
    python benchmarks/planner_vs_sweep.py --csv sweeps/r6/results.csv   # a sweep with --repeats 6

The recorded comparisons (benchmarks/planner_notes.md, "On a CPU machine: calibrate and sweep"):

    D=benchmarks/data/planner_sweep_cpu_4ranks_xeon        # one sweep with --repeats 6
    python benchmarks/planner_vs_sweep.py --profile $D/local.yaml --csv $D/results.csv \
        [--markdown] [--across median] [--best-of 1 --best-of 3]
    python benchmarks/planner_vs_sweep.py --profile $D/local_2.yaml --csv $D/results_2.csv \
        [--without-cache-model]                             # the second sweep, with the cache model
    D=benchmarks/data/planner_sweep_cpu_4ranks             # ten sweeps on another machine
    python benchmarks/planner_vs_sweep.py --profile $D/local.yaml \
        $(for f in $(ls -v $D/sweep*.csv); do echo --csv $f; done) [--markdown] [--across median]

For every layout of the grid that ran: the measured step time (the sweep's median over the steps
after the first; with several --csv, repeats of the sweep, or one sweep run with `--repeats`, the
lowest of those medians: on a machine shared with other jobs, the least disturbed run of each
layout; `--across median` takes their median instead), the cost model's prediction on the profile
(`planner.cost.predict`), and their ranks. Figures: Spearman rank correlation of predicted
and measured step times, median relative error, and the planner's first choice: `planner.plan`
searching the same dimensions as the grid (its dp/tp/pp, ZeRO stages and micro-batch sizes, at the
grid's global batch, sequence length and dtype; no recompute, 1F1B), walking down its ranking to the
first layout the engine runs (`parallel.check_supported`), whose
measured step time is set against the best measured (the gap; target <= 10%). With several
sweeps, also how well they agree with each other (Spearman of each pair over the layouts both
ran): the ceiling for any prediction of a single sweep.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr

from ultrascale.config import ConfigError, build_config, layout_sections
from ultrascale.layout import Layout
from ultrascale.parallel.support import check_supported
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import Hardware, get_hardware
from ultrascale.planner.search import SearchSpace, plan
from ultrascale.planner.sweep import load_grid

# The repository's recorded grid (benchmarks/; give --grid elsewhere).
GRID = Path(__file__).resolve().parents[3] / "benchmarks" / "sweep_cpu_4ranks.yaml"


def _key(lay: Layout) -> tuple:
    return (lay.dp, lay.tp, lay.pp, lay.zero, lay.mbs, lay.grad_accum)


def short(lay: Layout) -> str:
    return f"dp{lay.dp}-tp{lay.tp}-pp{lay.pp}-zero{lay.zero}-mbs{lay.mbs}-acc{lay.grad_accum}"


# Each sweep (or repeat of one): its label and run name -> (step time, load average).
Sweeps = list[tuple[str, dict[str, tuple[float, float | None]]]]


def read_sweeps(csv_paths: list[Path]) -> Sweeps:
    """Each sweep's successful runs: (label, run name -> (step time, load average as the run
    ended)). A results.csv of a sweep with repeats (`step_time_s_each`) counts as one sweep per
    repeat (its load figure is the fastest repeat's, the others' are not recorded)."""
    sweeps = []
    for path in csv_paths:
        with open(path, newline="") as fh:
            rows = [r for r in csv.DictReader(fh) if r["status"] == "ok" and r.get("step_time_s")]
        each = {r["name"]: r["step_time_s_each"].split(";") for r in rows
                if r.get("step_time_s_each")}
        if not each:
            sweeps.append((str(path), {r["name"]: (float(r["step_time_s"]),
                                                   float(r["load_1min"]) if r.get("load_1min")
                                                   else None) for r in rows}))
            continue
        for k in range(max(len(v) for v in each.values())):
            sweeps.append((f"{path} repeat {k + 1}",
                           {name: (float(t[k]), None) for name, t in each.items()
                            if k < len(t) and t[k]}))
    return sweeps


def measured_step_times(sweeps: Sweeps) -> dict[str, list[tuple[float, float | None]]]:
    """Run name -> (step time, load average as the run ended) of the successful runs, one per
    sweep (or repeat)."""
    out: dict[str, list[tuple[float, float | None]]] = {}
    for _, runs in sweeps:
        for name, point in runs.items():
            out.setdefault(name, []).append(point)
    return out


def sweep_agreement(sweeps: Sweeps) -> list[dict]:
    """Spearman rank correlation of each pair of sweeps (or repeats), over the layouts both ran."""
    out = []
    for i in range(len(sweeps)):
        for j in range(i + 1, len(sweeps)):
            (a, x), (b, y) = sweeps[i], sweeps[j]
            both = sorted(set(x) & set(y))
            if len(both) >= 3:
                rho = spearmanr([x[k][0] for k in both], [y[k][0] for k in both])
                out.append({"a": a, "b": b, "layouts": len(both),
                            "spearman": float(rho.statistic)})
    return out


def engine_runs(cfg) -> bool:
    try:
        check_supported(cfg)
    except ConfigError:
        return False
    return True


def compare(grid_path: Path, csv_paths: list[Path], profile: str | Hardware,
            across: str = "best") -> dict:
    return compare_sweeps(grid_path, read_sweeps(csv_paths), profile, across)


def without_cache_model(hw: Hardware) -> Hardware:
    """The profile as `ultrascale calibrate` gave it before it measured elementwise work at two
    sizes: one efficiency for all memory-bound work, the in-cache one of its 256-token probe (per
    dtype where it measured each), and the update's measured time kept (its bytes rescaled to that
    efficiency)."""
    if not hw.cached_eff:
        return hw
    by_dtype = {d: hw.cached_eff_by_dtype.get(d, e) for d, e in hw.hbm_eff_by_dtype.items()}
    return hw.with_(hbm_eff=hw.cached_eff, cache_bytes=None, cached_eff=None,
                    hbm_eff_by_dtype=by_dtype, cached_eff_by_dtype={},
                    optimizer_bytes_per_param=hw.optimizer_bytes_per_param
                    * hw.cached_eff / hw.hbm_eff)


def compare_sweeps(grid_path: Path, sweeps: Sweeps, profile: str | Hardware,
                   across: str = "best") -> dict:
    grid = load_grid(grid_path)
    hw = profile if isinstance(profile, Hardware) else get_hardware(profile)
    measured = measured_step_times(sweeps)
    rows, failed = [], []
    model, base_cfg = None, None
    for run in grid.runs:
        cfg = build_config(grid.base, grid.fixed + run.overrides)
        model, base_cfg = cfg.model, cfg
        lay = cfg.layout()
        p = predict(cfg.model, lay, hw, memory=False)
        if run.name not in measured:
            failed.append(short(lay))
            continue
        times = [t for t, _ in measured[run.name]]
        pick = min(times) if across == "best" else statistics.median(times)
        rows.append({"layout": short(lay), "key": _key(lay), "measured_s": pick,
                     "measured_all_s": times, "load_1min": [ld for _, ld in measured[run.name]],
                     "predicted_s": p.step_time_s,
                     "dominant": p.dominant,
                     "breakdown_s": {k: round(v, 4) for k, v in p.breakdown.items()}})
    if len(rows) < 3:
        raise SystemExit(f"only {len(rows)} successful runs in "
                         f"{', '.join(label for label, _ in sweeps)}")
    for key, rank_key in (("measured_s", "measured_rank"), ("predicted_s", "predicted_rank")):
        for i, r in enumerate(sorted(rows, key=lambda r: r[key]), 1):
            r[rank_key] = i
    rho = float(spearmanr([r["predicted_s"] for r in rows],
                          [r["measured_s"] for r in rows]).statistic)
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]

    # The planner's own search over the grid's dimensions.
    lays = [build_config(grid.base, grid.fixed + r.overrides).layout() for r in grid.runs]
    space = SearchSpace(tp=sorted({x.tp for x in lays}), pp=sorted({x.pp for x in lays}),
                        zero=sorted({x.zero for x in lays}), mbs=sorted({x.mbs for x in lays}),
                        recompute=["none"], schedules=["1f1b"], sequence_parallel=False,
                        dtype=lays[0].dtype, zero_with_pp=False)
    first = lays[0]
    world = first.world_size
    result = plan(model, world, first.global_batch_tokens, hw, seq_len=first.seq_len, top=None,
                  space=space)
    by_key = {r["key"]: r for r in rows}
    best = min(rows, key=lambda r: r["measured_s"])
    ranked = []
    choice = None
    for i, p in enumerate(result.ranked, 1):
        cfg = build_config(_with_layout(base_cfg.model_dump(mode="json"), p.layout))
        runs = engine_runs(cfg)
        ranked.append({"rank": i, "layout": short(p.layout), "predicted_s": p.step_time_s,
                       "engine_runs": runs, "measured": _key(p.layout) in by_key})
        if choice is None and runs:
            choice = (i, p)
    out = {"profile": hw.name, "profile_source": hw.source, "runs": len(rows),
           "sweeps": [label for label, _ in sweeps], "across": across,
           "failed": failed, "spearman": rho, "median_error": statistics.median(errors),
           "considered": result.considered, "best_measured": best["layout"],
           "best_measured_s": best["measured_s"], "planner_top": ranked[:5], "rows": rows,
           "sweep_agreement": sweep_agreement(sweeps)}
    if choice is not None:
        i, p = choice
        row = by_key.get(_key(p.layout))
        out["first_choice"] = short(p.layout)
        out["first_choice_rank"] = i
        out["first_choice_measured_s"] = row["measured_s"] if row else None
        out["first_choice_gap"] = row["measured_s"] / best["measured_s"] - 1 if row else None
    return out


def setting_pairs(res: dict, a: str = "zero1", b: str = "zero0") -> list[dict]:
    """Layouts that differ only in one setting (`a` against `b` in the short name, ZeRO-1 against
    ZeRO-0 by default): step time of a over b, measured and predicted. Whether the model favours
    one setting more than the measurements do, beyond the pairs' own spread."""
    by_name = {r["layout"]: r for r in res["rows"]}
    out = []
    for name, r in sorted(by_name.items()):
        other = by_name.get(name.replace(a, b)) if a in name else None
        if other:
            out.append({"layout": name, "measured": r["measured_s"] / other["measured_s"],
                        "predicted": r["predicted_s"] / other["predicted_s"]})
    return out


def best_of(grid_path: Path, sweeps: Sweeps, profile: str | Hardware, k: int,
            limit: int = 500) -> dict:
    """The figures a sweep with k repeats would give on this machine, drawn from the sweeps at
    hand: for each set of k of them (all sets, or `limit` of them chosen at random with a fixed
    seed), each layout at its fastest of the k, against the prediction. How many repeats a
    ranking needs before the machine's noise stops deciding it."""
    sets = list(itertools.combinations(range(len(sweeps)), k))
    if len(sets) > limit:
        sets = random.Random(0).sample(sets, limit)
    rho, gap = [], []
    for chosen in sets:
        res = compare_sweeps(grid_path, [sweeps[i] for i in chosen], profile)
        rho.append(res["spearman"])
        gap.append(res.get("first_choice_gap"))
    met = sum(r >= 0.8 and g is not None and g <= 0.10 for r, g in zip(rho, gap))
    gaps = [g for g in gap if g is not None]
    return {"k": k, "sets": len(sets), "spearman_median": statistics.median(rho),
            "spearman_min": min(rho), "spearman_max": max(rho),
            "gap_median": statistics.median(gaps) if gaps else None, "both_targets_met": met}


def _with_layout(data: dict, lay: Layout) -> dict:
    """The config sections of `data` with the layout's keys set in them."""
    out = dict(data)
    for section, keys in layout_sections(lay).items():
        out[section] = {**out.get(section, {}), **keys}
    return out


def print_report(res: dict, markdown: bool) -> None:
    rows = sorted(res["rows"], key=lambda r: r["measured_s"])
    if markdown:
        print("| layout | measured s | each sweep or repeat s | predicted s | measured rank "
              "| predicted rank | pred/meas | dominant (predicted) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            each = " / ".join(f"{t:.2f}" for t in r["measured_all_s"])
            print(f"| {r['layout']} | {r['measured_s']:.3f} | {each} | {r['predicted_s']:.3f} | "
                  f"{r['measured_rank']} | {r['predicted_rank']} | "
                  f"{r['predicted_s'] / r['measured_s']:.2f} | {r['dominant']} |")
    else:
        print(f"{'layout':<30} {'measured s':>10} {'pred s':>8} {'m#':>3} {'p#':>3} "
              f"{'p/m':>5}  {'dominant':<12} each sweep or repeat (load)")
        for r in rows:
            each = ", ".join(f"{t:.2f}" + (f" ({ld:.0f})" if ld is not None else "")
                             for t, ld in zip(r["measured_all_s"], r["load_1min"]))
            print(f"{r['layout']:<30} {r['measured_s']:10.3f} {r['predicted_s']:8.3f} "
                  f"{r['measured_rank']:>3} {r['predicted_rank']:>3} "
                  f"{r['predicted_s'] / r['measured_s']:5.2f}  {r['dominant']:<12} {each}")
    print()
    print(f"profile: {res['profile']} ({res['profile_source']})")
    print(f"layouts: {res['runs']} measured in {len(res['sweeps'])} sweep(s) or repeats, "
          f"{'lowest' if res['across'] == 'best' else 'median'} of the per-sweep medians"
          + (f"; failed or missing: {', '.join(res['failed'])}" if res["failed"] else ""))
    print(f"Spearman rank correlation, predicted vs measured step time: {res['spearman']:.3f}")
    print(f"median relative error of the predicted step time: {res['median_error']:.1%}")
    pairs = res["sweep_agreement"]
    if pairs:
        rhos = [p["spearman"] for p in pairs]
        print(f"sweeps against each other, Spearman over {len(pairs)} pair(s): min {min(rhos):.2f}, "
              f"median {statistics.median(rhos):.2f}, max {max(rhos):.2f}")
    print(f"planner's top layouts (of {res['considered']} considered):")
    for t in res["planner_top"]:
        note = "" if t["engine_runs"] else "  (the engine does not run it yet)"
        print(f"  {t['rank']}. {t['layout']}  predicted {t['predicted_s']:.3f} s{note}")
    print(f"best measured: {res['best_measured']} {res['best_measured_s']:.3f} s")
    if res.get("first_choice_measured_s") is not None:
        print(f"planner's first choice the engine runs: {res['first_choice']} (#"
              f"{res['first_choice_rank']}), measured {res['first_choice_measured_s']:.3f} s: "
              f"{res['first_choice_gap']:+.1%} against the best measured")
    elif res.get("first_choice"):
        print(f"planner's first choice {res['first_choice']} was not measured")


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=description or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=Path, default=GRID, help=f"the sweep's grid ({GRID.name})")
    ap.add_argument("--csv", type=Path, action="append",
                    help="results.csv of the sweep (repeatable; default: the grid's out folder)")
    ap.add_argument("--profile", default="local", help="hardware profile (default local)")
    ap.add_argument("--across", choices=["best", "median"], default="best",
                    help="with several sweeps: the lowest (default) or the median of each "
                         "layout's step times")
    ap.add_argument("--json", type=Path, help="write the figures and the table as JSON")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--best-of", type=int, action="append", metavar="K",
                    help="also: the figures of every set of K of the sweeps (repeatable), each "
                         "layout at its fastest of the K: how many repeats this machine needs")
    ap.add_argument("--pair", nargs=2, metavar=("A", "B"),
                    help="also: step time of each layout named with A over the same layout named "
                         "with B (e.g. --pair zero1 zero0), measured and predicted")
    ap.add_argument("--without-cache-model", action="store_true",
                    help="predict with one elementwise efficiency (the profile's in-cache one), as "
                         "calibrations before the two-size elementwise probe did")
    args = ap.parse_args(argv)
    csvs = args.csv or [load_grid(args.grid).out / "results.csv"]
    profile = get_hardware(args.profile)
    if args.without_cache_model:
        profile = without_cache_model(profile)
    if args.best_of:
        sweeps = read_sweeps(csvs)
        print(f"{'K':>3} {'sets':>5} {'Spearman median (min-max)':>26} {'gap median':>10} "
              f"{'both targets met':>17}")
        for k in args.best_of:
            if not 1 <= k <= len(sweeps):
                raise SystemExit(f"--best-of {k}: choose 1 to {len(sweeps)} (the sweeps given)")
            b = best_of(args.grid, sweeps, profile, k)
            gap = f"{b['gap_median']:+.1%}" if b["gap_median"] is not None else "-"
            print(f"{k:>3} {b['sets']:>5} {b['spearman_median']:>13.2f} ({b['spearman_min']:.2f}-"
                  f"{b['spearman_max']:.2f}) {gap:>10} {b['both_targets_met']:>7} of {b['sets']}")
        return 0
    res = compare(args.grid, csvs, profile, args.across)
    print_report(res, args.markdown)
    if args.pair:
        pairs = setting_pairs(res, *args.pair)
        print(f"{args.pair[0]} over {args.pair[1]}, {len(pairs)} pair(s):")
        for q in pairs:
            print(f"  {q['layout']:<30} measured {q['measured']:.3f}  predicted {q['predicted']:.3f}")
        if pairs:
            meas, pred = ([q[k] for q in pairs] for k in ("measured", "predicted"))
            print(f"  median: measured {statistics.median(meas):.3f} ({min(meas):.2f}-"
                  f"{max(meas):.2f}), predicted {statistics.median(pred):.3f} ({min(pred):.2f}-"
                  f"{max(pred):.2f})")
    if args.json:
        res = {**res, "rows": [{k: v for k, v in r.items() if k != "key"} for r in res["rows"]]}
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
