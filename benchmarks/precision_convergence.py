"""Convergence of each precision on the built-in corpus: the main job (`ultrascale train`: the
tiny preset, 2 local ranks, seeds 1234-1236) for 300 steps in fp32, bf16 and each FP8 recipe, and fp16
against fp32 on a shorter, smaller run (fp16 matmuls are slow on CPUs); the final losses against
fp32's, a table and the curves as a PNG. Every run is repeated with three seeds (weights and
batch order): a precision's difference from fp32 is the mean over the seeds of the paired
differences (same seed), set against fp32's own seed-to-seed spread.

    python benchmarks/precision_convergence.py                       # everything (CPU: ~3 hours)
    python benchmarks/precision_convergence.py --only fp32,bf16      # some runs
    python benchmarks/precision_convergence.py --seeds 1234          # one seed
    python benchmarks/precision_convergence.py --table-only          # redraw from results.json
    python benchmarks/precision_convergence.py --smoke --out /tmp/p  # check that it runs

The final loss is the mean of the last 20 steps' losses (a step's loss is one batch of 16
sequences: noisy), the last step's is shown beside it. Each run is a subprocess of `ultrascale
train`, as a user runs it, reading its metrics.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _train import (SMOKE_OVERRIDES, against, convergence_arguments, describe, load_results,
                    loss_axes, mean_of_last, running_mean, save_figure, save_results, seed_finals,
                    train_run)

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "precision"  # results.json, table.md (run folders: runs/, not kept)
PNG = HERE.parent / "docs" / "precision-curves.png"
MAIN = ["training.steps=300", "training.warmup_steps=30"]
# fp16's shorter, smaller run (its fp32 twin is run with the same keys).
SMALL = ["training.steps=150", "training.warmup_steps=15", "training.micro_batch_size=4",
         "training.seq_len=64"]
FP8 = ["precision.dtype=fp8", "precision.fp8_emulate=true"]
RUNS = {  # name -> (overrides, the fp32 run it is held against, the tolerance of the issue)
    "fp32": (MAIN + ["precision.dtype=fp32"], None, None),
    "bf16": (MAIN + ["precision.dtype=bf16"], "fp32", 0.01),
    "fp8-tensorwise": (MAIN + FP8 + ["precision.fp8_recipe=tensorwise"], "fp32", 0.03),
    "fp8-rowwise": (MAIN + FP8 + ["precision.fp8_recipe=rowwise"], "fp32", 0.03),
    "fp8-blockwise": (MAIN + FP8 + ["precision.fp8_recipe=blockwise"], "fp32", 0.03),
    "fp32-small": (SMALL + ["precision.dtype=fp32"], None, None),
    "fp16-small": (SMALL + ["precision.dtype=fp16"], "fp32-small", 0.02),
    # PyTorch's GradScaler starts at 2^16: on this run that overflows at the first gradient spike
    # (steps 14 and 15 skipped, at the peak learning rate). Shown, not held to the 2%.
    "fp16-small-init65536": (SMALL + ["precision.dtype=fp16", "precision.loss_scale_init=65536"],
                             "fp32-small", None),
}
TAIL = 20


def train(name: str, overrides: list[str], out: Path) -> dict:
    run = train_run(out / "runs" / name.replace("@", "-seed"), overrides)
    records = run["records"]
    header = next((line for line in run["stdout"].splitlines()
                   if line.startswith("precision:")), "")
    return {"overrides": overrides, "seconds": round(run["seconds"], 1),
            "precision": header.removeprefix("precision: "),
            "losses": [r["loss"] for r in records],
            "tokens_per_s": sorted(r["tokens_per_s"] for r in records)[len(records) // 2],
            "skipped_steps": records[-1].get("skipped_steps"),
            "loss_scale": records[-1].get("loss_scale")}


def final(losses: list[float]) -> float:
    return mean_of_last(losses, TAIL)


def table(results: dict) -> str:
    """One row per run: its final loss (mean over the seeds), against its fp32 run (the mean of the
    per-seed differences), fp32's seed-to-seed spread, the issue's tolerance."""
    lines = ["| run | seeds | final loss (mean of last 20; mean over seeds) | vs fp32 | fp32's "
             "seed spread (difference in spreads) | allowed | holds | skipped steps | tokens/s "
             "| wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name, by_seed in results.items():
        base, tol = RUNS[name][1], RUNS[name][2]
        finals = seed_finals(results, name, final)
        cmp = against(results, name, base, final) if base else None
        diff, spread = describe(cmp)
        holds = ""
        if cmp is not None:
            holds = ("yes" if abs(cmp["mean_diff"]) <= tol else "NO") if tol else "(shown)"
        runs = list(by_seed.values())
        skipped = [r["skipped_steps"] for r in runs if r["skipped_steps"] is not None]
        lines.append(f"| {name} | {len(finals)} | {sum(finals.values()) / len(finals):.4f} | "
                     f"{diff} | {spread} | {f'{tol:.0%}' if tol else ''} | {holds} | "
                     f"{'/'.join(map(str, skipped))} | "
                     f"{sorted(r['tokens_per_s'] for r in runs)[len(runs) // 2]:,.0f} | "
                     f"{sum(r['seconds'] for r in runs):.0f} |")
    return "\n".join(lines)


def draw(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, names, title in ((axes[0], [n for n in results if "small" not in n],
                              "the main job, 300 steps"),
                             (axes[1], [n for n in results if "small" in n],
                              "fp16 against fp32: 150 steps, 4 x 64 tokens per rank")):
        for n in names:
            losses = results[n][min(results[n])]["losses"]  # the first seed's curve
            # A 10-step running mean: the curves' differences, not the batches' noise.
            smooth = running_mean(losses)
            ax.plot(range(1, len(losses) + 1), smooth, label=n, lw=1.2)
        ax.set_title(title)
        loss_axes(ax, "step")
    fig.suptitle("ultrascale: convergence per precision (tiny preset, built-in corpus, first seed)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = convergence_arguments(__doc__.splitlines()[0], list(RUNS), OUT, PNG,
                                 smoke_runs=["fp32", "bf16"], argv=argv)
    out = Path(args.out)
    results = load_results(out)
    if not args.table_only:
        for name in args.only.split(","):
            for seed in args.seeds_of(name):
                overrides = RUNS[name][0] + [f"training.seed={seed}"] + (
                    SMOKE_OVERRIDES if args.smoke else [])
                print(f"{name}, seed {seed}: {' '.join(overrides)}", flush=True)
                run = train(f"{name}@{seed}", overrides, out)
                results.setdefault(name, {})[str(seed)] = run
                print(f"    final {final(run['losses']):.4f}, {run['seconds']:.0f} s", flush=True)
                save_results(out, results)
    results = {n: results[n] for n in RUNS if n in results}
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)
    draw(results, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
