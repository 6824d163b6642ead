"""The memory estimator against the playbook's H100 runs (nanotron, 1.34B and 3.57B Llama models).

    python benchmarks/memory_vs_playbook.py [--csv PATH] [--outside-gib G] [--show N] [--json]
    python -m ultrascale.memory.playbook ...                     # the same

Two comparisons, per row of `benchmarks/data/playbook_bench_1b_3b.csv`:

1. `Mem Alloc (GB)` of the successful runs against the estimator's optimizer-step peak of rank 0.
   nanotron logs `torch.cuda.max_memory_allocated()` in the benchmark row, but its `log_memory`
   (called right after `train_batch_iter` during the first steps) resets the peak statistics, so
   the figure is the peak from the end of the backward through gradient sync, clipping and the
   optimizer step: parameters, gradients, optimizer state, buffers kept from step to step, and
   ZeRO-1's all-gather of the updated parameters. It never saw the activations (a 1.34B run shows
   the same 25.07 GiB at one or two sequences per micro-batch). Rank 0 is pipeline stage 0.
2. The OOM rows: the estimator calls a layout out of memory when the forward/backward peak of its
   most loaded stage, with the allocator's fragmentation (`reserved`), exceeds 80 GiB less what
   the CUDA context and NCCL hold outside the allocator (`--outside-gib`, by default the H100
   profile's `outside_allocator_bytes`, 5 GiB). Rows marked Other failed for other reasons and are
   left out.

The model shapes come from the columns; the MLP width is not a column, so it is solved from the
published parameter count, and failed rows take their model's shape from its successful ones
(`ultrascale/playbook_rows.py`). nanotron splits pipeline stages by compute cost
(`get_block_compute_costs`: a decoder layer costs 4 h^2 + 3 h f, the output head V h, the
embedding nothing; a rank takes blocks until their cumulative cost passes its share). The runs used
two versions of its boundary test (cost > share, then >=); on an exact tie, which only the 1.34B
model's power-of-two costs produce, the split is read from the run's `Local Params` column.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout
from ultrascale.memory.estimator import GIB, estimate
from ultrascale.params import layer_params
from ultrascale.planner.hardware import H100
from ultrascale.playbook_rows import parse_count, row_models, shape_key
from ultrascale.theory.implementation import NANOTRON
from ultrascale.theory.pipeline import cost_balanced_ranks

# The repository's recorded runs (benchmarks/data; give --csv elsewhere).
DEFAULT_CSV = Path(__file__).resolve().parents[3] / "benchmarks/data/playbook_bench_1b_3b.csv"
DEVICE = int(H100.memory_bytes)  # 80 GiB; the OOM calls keep `--outside-gib` of it free


def local_params(model: ModelConfig, tp: int, first_layers: int) -> float:
    """Stage 0's parameters per rank: its layers and the embedding (its tp slices)."""
    return first_layers * layer_params(model, tp)[0] + model.vocab_size * model.hidden_size / tp


def row_case(row: dict, models: dict) -> tuple[ModelConfig, Layout, list[int]]:
    """The row's model (of `models`: playbook_rows.row_models over the table), layout and
    nanotron's pipeline split."""
    model = models[shape_key(row)][1]
    tp, pp = int(row["tp"]), int(row["pp"])
    layout = Layout(
        dp=int(row["dp"]), tp=tp, pp=pp, zero=int(row["zero_stage"]),
        sequence_parallel=row["tp_mode"] == "REDUCE_SCATTER", mbs=int(row["mbs"]),
        grad_accum=int(float(row["batch_accum"])), seq_len=int(row["seq_len"]),
        pp_schedule="1f1b", dtype="bf16", master_dtype="fp32",
        # Every successful run has accumulate_grad_in_fp32 = True; failed rows leave it blank.
        grad_accum_dtype="fp32" if row["accumulate_grad_in_fp32"] in ("True", "") else "bf16",
        bucket_mb=float(row["ddp_bucket_cap_mb"] or 25.0),
    )
    split, loose = ([n for n, _ in cost_balanced_ranks(model, pp, strict)]
                    for strict in (True, False))
    recorded = parse_count(row["Local Params"])
    if split != loose and recorded is not None:
        # A tie: keep the version whose stage-0 size matches what the run recorded.
        if abs(local_params(model, tp, loose[0]) - recorded) < abs(
                local_params(model, tp, split[0]) - recorded):
            split = loose
    return model, layout, split


def evaluate(path: Path, outside: float = H100.outside_allocator_bytes,
             fragmentation: float | None = None) -> dict:
    """The figures; `outside`: bytes of the device that the OOM calls keep free (CUDA context,
    NCCL)."""
    runtime = NANOTRON if fragmentation is None else replace(NANOTRON, fragmentation=fragmentation)
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    models = row_models(rows)
    errors, details, calls, res_errors = [], [], [], []
    for row in rows:
        if row["status"] not in ("Success", "OOM"):
            continue
        model, layout, split = row_case(row, models)
        worst = estimate(model, layout, runtime=runtime, pp_layers=split,
                         device_memory=int(DEVICE - outside))
        predicted_oom = not worst.fits
        calls.append((row["status"] == "OOM", predicted_oom))
        if row["status"] == "Success":
            rank0 = estimate(model, layout, runtime=runtime, pp_layers=split, stage=0)
            pred = rank0.phases["optimizer step"] / GIB
            meas = float(row["Mem Alloc (GB)"])
            err = (pred - meas) / meas
            errors.append(abs(err))
            reserved = float(row["Mem Res (GB)"])
            # Memory that comes and goes within a step: the peak less what stays allocated.
            dyn = max(rank0.activations_peak + rank0.comm_buffers - rank0.comm_parts.get(
                "persistent all-gather buffers", 0), 1)
            res_errors.append((rank0.reserved / GIB - reserved) / reserved)
            details.append({"name": row["name"], "measured_gib": meas,
                            "predicted_gib": round(pred, 3), "rel_error": round(err, 4),
                            "reserved_gib": float(row["Mem Res (GB)"]),
                            "predicted_peak_gib": round(rank0.total / GIB, 2),
                            "dynamic_ratio": (reserved * GIB - (rank0.total - dyn)) / dyn})
    errors.sort()
    n = len(errors)
    oom_rows = [c for c in calls if c[0]]
    ok_rows = [c for c in calls if not c[0]]
    return {
        "rows_success": n, "rows_oom": len(oom_rows),
        "median_rel_error": statistics.median(errors),
        "p90_rel_error": errors[min(n - 1, int(0.9 * n))],
        "oom_calls_right": sum(1 for real, pred in calls if real == pred) / len(calls),
        "oom_rows_called_oom": sum(1 for _, p in oom_rows if p) / max(len(oom_rows), 1),
        "success_rows_called_fit": sum(1 for _, p in ok_rows if not p) / max(len(ok_rows), 1),
        "reserved_median_rel_error": statistics.median(abs(e) for e in res_errors),
        "reserved_median_signed_error": statistics.median(res_errors),
        "median_reserved_over_dynamic": statistics.median(d["dynamic_ratio"] for d in details),
        "peak_below_reserved": sum(1 for d in details
                                   if d["predicted_peak_gib"] <= d["reserved_gib"]) / n,
        "outside_gib": outside / GIB, "fragmentation": runtime.fragmentation,
        "details": details,
    }


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=(description or __doc__).split("\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--outside-gib", type=float, default=H100.outside_allocator_bytes / GIB,
                    help="GiB of the 80 kept free for the CUDA context and NCCL's buffers "
                         "(default: the H100 profile's)")
    ap.add_argument("--fragmentation", type=float, default=None,
                    help="override the runtime's allocator fragmentation (default: NANOTRON's)")
    ap.add_argument("--show", type=int, default=10, help="print the N worst memory predictions")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.csv.is_file():
        print(f"no benchmark file at {args.csv}; pass --csv PATH", file=sys.stderr)
        return 2
    if not 0 <= args.outside_gib < DEVICE / GIB:
        ap.error(f"--outside-gib {args.outside_gib:g}: give the GiB kept free, from 0 to below "
                 f"{DEVICE / GIB:.0f}")
    res = evaluate(args.csv, args.outside_gib * GIB, args.fragmentation)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"Mem Alloc, {res['rows_success']} successful runs: median |error| "
          f"{res['median_rel_error']:.2%}, 90th percentile {res['p90_rel_error']:.2%}")
    print(f"OOM calls right: {res['oom_calls_right']:.1%} of {res['rows_success'] + res['rows_oom']}"
          f" rows (OOM rows called OOM: {res['oom_rows_called_oom']:.1%}, successful rows called "
          f"fitting: {res['success_rows_called_fit']:.1%}; {args.outside_gib:g} GiB kept for the "
          f"CUDA context and NCCL, "
          f"fragmentation {res['fragmentation']:.0%})")
    print(f"Mem Res (peak reserved, rank 0) against the predicted reserved: median |error| "
          f"{res['reserved_median_rel_error']:.1%} (signed {res['reserved_median_signed_error']:+.1%});"
          f" predicted peak allocated <= measured reserved in {res['peak_below_reserved']:.1%} of "
          f"the runs; median (reserved - steady) / (peak - steady) = "
          f"{res['median_reserved_over_dynamic']:.2f}")
    worst = sorted(res["details"], key=lambda d: -abs(d["rel_error"]))[:args.show]
    for d in worst:
        print(f"  {d['name']:<70} measured {d['measured_gib']:6.2f}  predicted "
              f"{d['predicted_gib']:6.2f}  ({d['rel_error']:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
