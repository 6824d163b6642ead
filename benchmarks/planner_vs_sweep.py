"""The planner against a sweep measured on this machine (`ultrascale sweep`).

    ultrascale calibrate --ranks 4                                   # the profile (local)
    ultrascale sweep benchmarks/sweep_cpu_4ranks.yaml                # the measurements
    python benchmarks/planner_vs_sweep.py                            # this comparison
    python benchmarks/planner_vs_sweep.py --csv A/results.csv --csv B/results.csv --json out.json

The recorded comparison (docs/planner.md, "On this machine: calibrate and sweep"):

    D=benchmarks/data/planner_sweep_cpu_4ranks
    python benchmarks/planner_vs_sweep.py --profile $D/local.yaml \
        $(for f in $(ls -v $D/sweep*.csv); do echo --csv $f; done) [--markdown] [--across median]

For every layout of the grid that ran: the measured step time (the sweep's median over the steps
after the first; with several --csv, repeats of the sweep, the lowest of those medians: on a machine
shared with other jobs, the least disturbed run of each layout; `--across median` takes their
median instead), the cost model's prediction on the profile (`planner.cost.predict`), and their
ranks. Figures: Spearman rank correlation of predicted
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
import json
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr

from ultrascale.config import ConfigError, build_config
from ultrascale.layout import Layout
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import get_hardware
from ultrascale.planner.search import SearchSpace, plan
from ultrascale.planner.sweep import load_grid

GRID = Path(__file__).with_name("sweep_cpu_4ranks.yaml")


def _key(lay: Layout) -> tuple:
    return (lay.dp, lay.tp, lay.pp, lay.zero, lay.mbs, lay.grad_accum)


def short(lay: Layout) -> str:
    return f"dp{lay.dp}-tp{lay.tp}-pp{lay.pp}-zero{lay.zero}-mbs{lay.mbs}-acc{lay.grad_accum}"


def measured_step_times(csv_paths: list[Path]) -> dict[str, list[tuple[float, float | None]]]:
    """Run name -> (step time, load average as the run ended) of the successful runs, one per
    sweep."""
    out: dict[str, list[tuple[float, float | None]]] = {}
    for path in csv_paths:
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["status"] == "ok" and row.get("step_time_s"):
                    load = float(row["load_1min"]) if row.get("load_1min") else None
                    out.setdefault(row["name"], []).append((float(row["step_time_s"]), load))
    return out


def sweep_agreement(csv_paths: list[Path]) -> list[dict]:
    """Spearman rank correlation of each pair of sweeps, over the layouts both ran."""
    sweeps = []
    for path in csv_paths:
        with open(path, newline="") as fh:
            sweeps.append({r["name"]: float(r["step_time_s"]) for r in csv.DictReader(fh)
                           if r["status"] == "ok" and r.get("step_time_s")})
    out = []
    for i in range(len(sweeps)):
        for j in range(i + 1, len(sweeps)):
            both = sorted(set(sweeps[i]) & set(sweeps[j]))
            if len(both) >= 3:
                rho = spearmanr([sweeps[i][k] for k in both], [sweeps[j][k] for k in both])
                out.append({"a": str(csv_paths[i]), "b": str(csv_paths[j]), "layouts": len(both),
                            "spearman": float(rho.statistic)})
    return out


def engine_runs(cfg) -> bool:
    from ultrascale.parallel import check_supported

    try:
        check_supported(cfg)
    except ConfigError:
        return False
    return True


def compare(grid_path: Path, csv_paths: list[Path], profile: str, across: str = "best") -> dict:
    grid = load_grid(grid_path)
    hw = get_hardware(profile)
    measured = measured_step_times(csv_paths)
    rows, failed = [], []
    model, base_cfg = None, None
    for run in grid.runs:
        cfg = build_config(grid.base, grid.fixed + run.overrides)
        model, base_cfg = cfg.model, cfg
        lay = Layout.from_config(cfg)
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
        raise SystemExit(f"only {len(rows)} successful runs in {', '.join(map(str, csv_paths))}")
    for key, rank_key in (("measured_s", "measured_rank"), ("predicted_s", "predicted_rank")):
        for i, r in enumerate(sorted(rows, key=lambda r: r[key]), 1):
            r[rank_key] = i
    rho = float(spearmanr([r["predicted_s"] for r in rows],
                          [r["measured_s"] for r in rows]).statistic)
    errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]

    # The planner's own search over the grid's dimensions.
    lays = [Layout.from_config(build_config(grid.base, grid.fixed + r.overrides)) for r in grid.runs]
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
           "sweeps": [str(c) for c in csv_paths], "across": across,
           "failed": failed, "spearman": rho, "median_error": statistics.median(errors),
           "considered": result.considered, "best_measured": best["layout"],
           "best_measured_s": best["measured_s"], "planner_top": ranked[:5], "rows": rows,
           "sweep_agreement": sweep_agreement(csv_paths)}
    if choice is not None:
        i, p = choice
        row = by_key.get(_key(p.layout))
        out["first_choice"] = short(p.layout)
        out["first_choice_rank"] = i
        out["first_choice_measured_s"] = row["measured_s"] if row else None
        out["first_choice_gap"] = row["measured_s"] / best["measured_s"] - 1 if row else None
    return out


def _with_layout(data: dict, lay: Layout) -> dict:
    """The config sections of `data` with the layout's keys set in them."""
    out = dict(data)
    for section, keys in lay.config_overrides().items():
        out[section] = {**out.get(section, {}), **keys}
    return out


def print_report(res: dict, markdown: bool) -> None:
    rows = sorted(res["rows"], key=lambda r: r["measured_s"])
    if markdown:
        print("| layout | measured s | each sweep s | predicted s | measured rank | predicted rank "
              "| pred/meas | dominant (predicted) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            each = " / ".join(f"{t:.2f}" for t in r["measured_all_s"])
            print(f"| {r['layout']} | {r['measured_s']:.3f} | {each} | {r['predicted_s']:.3f} | "
                  f"{r['measured_rank']} | {r['predicted_rank']} | "
                  f"{r['predicted_s'] / r['measured_s']:.2f} | {r['dominant']} |")
    else:
        print(f"{'layout':<30} {'measured s':>10} {'pred s':>8} {'m#':>3} {'p#':>3} "
              f"{'p/m':>5}  {'dominant':<12} each sweep (load)")
        for r in rows:
            each = ", ".join(f"{t:.2f}" + (f" ({ld:.0f})" if ld is not None else "")
                             for t, ld in zip(r["measured_all_s"], r["load_1min"]))
            print(f"{r['layout']:<30} {r['measured_s']:10.3f} {r['predicted_s']:8.3f} "
                  f"{r['measured_rank']:>3} {r['predicted_rank']:>3} "
                  f"{r['predicted_s'] / r['measured_s']:5.2f}  {r['dominant']:<12} {each}")
    print()
    print(f"profile: {res['profile']} ({res['profile_source']})")
    print(f"layouts: {res['runs']} measured in {len(res['sweeps'])} sweep(s), "
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
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
    args = ap.parse_args(argv)
    csvs = args.csv or [load_grid(args.grid).out / "results.csv"]
    res = compare(args.grid, csvs, args.profile, args.across)
    print_report(res, args.markdown)
    if args.json:
        res = {**res, "rows": [{k: v for k, v in r.items() if k != "key"} for r in res["rows"]]}
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
