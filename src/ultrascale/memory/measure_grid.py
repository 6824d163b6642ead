"""The estimator against the engine's own step on fake tensors (`ultrascale memory --measure`),
over a grid of layouts: every dimension and its modes, dtypes, recompute and Muon, on llama3-8b,
llama3-70b, mixtral-8x7b, qwen3-30b-a3b and deepseek-v3.

    python benchmarks/memory_vs_measure.py --smoke     # one row on a two-layer model
    python benchmarks/memory_vs_measure.py             # the grid, into the results file
    python benchmarks/memory_vs_measure.py --table     # docs/memory.md's table from it
    python benchmarks/memory_vs_measure.py --gpu-results benchmarks/gpu/results/RUN/summary.json
                                                       # against the GPU suite's measured peaks

Each row is a model and a layout; its line in the results file
(benchmarks/data/memory_vs_measure.jsonl) holds the measured total and parts (the busiest stage
of the layout: the first and the last are measured), in `--workers` processes (1). Rows already in
`--out` are not measured again (a long run can be resumed); `--table` sets today's estimate beside
each. The measured figures are bytes, not timings: the grid can run on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from ultrascale.config import ModelConfig
from ultrascale.layout import Layout, parse_layout


@dataclass(frozen=True)
class Row:
    model: str
    layout: str  # parse_layout's text
    pp_layers: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.model} {self.layout}" + (f" pp_layers={self.pp_layers}"
                                                if self.pp_layers else "")


_8B = "llama3-8b"
_70B = "llama3-70b"
_MIX = "mixtral-8x7b"
_QWEN = "qwen3-30b-a3b"
_DSV3 = "deepseek-v3"
_S4K = "seq=4096,mbs=1"
# deepseek-v3's 61 layers split over 2 stages unevenly.
_DS_PP2 = (31, 30)

GRID = [
    # data parallel and ZeRO, dtypes, Muon (llama3-8b)
    Row(_8B, f"dp=8,zero=0,{_S4K}"),
    Row(_8B, f"dp=8,zero=1,{_S4K}"),
    Row(_8B, f"dp=8,zero=2,acc=4,{_S4K}"),
    Row(_8B, f"dp=8,zero=2,{_S4K}"),  # one micro-batch: full gradients freed as reduced
    Row(_8B, f"dp=8,zero=3,{_S4K}"),
    Row(_8B, f"dp=8,dp_shard=4,zero=3,{_S4K}"),
    Row(_8B, f"dp=2,zero=1,dtype=fp32,{_S4K}"),
    Row(_8B, f"dp=4,zero=1,dtype=fp16,{_S4K}"),
    Row(_8B, f"dp=4,tp=2,zero=1,dtype=fp8,sp=true,{_S4K}"),
    Row(_8B, f"dp=8,zero=1,optimizer=muon,{_S4K}"),
    Row(_8B, f"dp=8,zero=3,optimizer=muon,{_S4K}"),
    Row(_8B, "dp=4,zero=2,seq=2048,mbs=2,acc=2"),
    # recompute
    Row(_8B, f"dp=8,zero=1,recompute=selective,{_S4K}"),
    Row(_8B, "dp=8,zero=1,recompute=full,seq=8192,mbs=1"),
    # tensor parallel, with and without sequence parallel
    Row(_8B, f"tp=2,dp=4,zero=1,{_S4K}"),
    Row(_8B, f"tp=4,dp=2,zero=1,sp=true,{_S4K}"),
    Row(_8B, f"tp=8,sp=true,recompute=selective,{_S4K}"),
    # context parallel, its three modes
    Row(_8B, "cp=2,dp=4,zero=1,seq=8192,mbs=1"),
    Row(_8B, "cp=4,dp=2,zero=1,cp_mode=all_gather,seq=16384,mbs=1"),
    Row(_8B, "cp=2,dp=4,zero=1,cp_mode=ulysses,seq=8192,mbs=1"),
    Row(_8B, "cp=4,tp=2,sp=true,seq=16384,mbs=1"),
    # pipeline parallel, its four schedules
    Row(_8B, f"pp=2,dp=4,zero=1,acc=8,pp_schedule=1f1b,{_S4K}"),
    Row(_8B, f"pp=4,dp=2,acc=8,pp_schedule=afab,{_S4K}"),
    Row(_8B, f"pp=2,dp=4,acc=8,pp_schedule=interleaved,vpp=2,{_S4K}"),
    Row(_8B, f"pp=4,dp=2,acc=8,pp_schedule=zero_bubble,{_S4K}"),
    Row(_8B, f"pp=2,tp=2,dp=2,zero=1,sp=true,acc=4,pp_schedule=1f1b,{_S4K}"),
    Row(_8B, f"pp=2,dp=4,zero=1,acc=8,pp_schedule=dualpipev,vpp=2,{_S4K}"),
    # ZeRO-3 under pp, gathered once a step or for every micro-batch
    Row(_8B, f"pp=2,dp=4,zero=3,acc=4,pp_schedule=1f1b,zero3_gather=step,{_S4K}"),
    Row(_8B, f"pp=2,dp=4,zero=3,acc=4,pp_schedule=1f1b,zero3_gather=micro_batch,{_S4K}"),
    # every forward before the first backward: the whole gradients meet one micro-batch fewer
    Row(_8B, f"pp=2,tp=2,dp=8,zero=3,sp=true,acc=8,pp_schedule=afab,{_S4K}"),
    # llama3-70b: the usual 3D layouts
    Row(_70B, "tp=8,pp=4,dp=8,zero=1,sp=true,acc=8,seq=8192,mbs=1,pp_schedule=1f1b"),
    Row(_70B, "tp=8,pp=4,dp=8,zero=1,sp=true,acc=8,seq=8192,mbs=1,pp_schedule=interleaved,vpp=2"),
    Row(_70B, "pp=8,dp=8,zero=1,acc=16,seq=4096,mbs=1,pp_schedule=zero_bubble"),
    Row(_70B, "tp=4,pp=8,dp=4,zero=1,acc=8,seq=4096,mbs=1,pp_schedule=afab,recompute=full"),
    Row(_70B, "tp=8,dp=16,zero=3,sp=true,seq=8192,mbs=1,recompute=selective"),
    Row(_70B, "tp=8,cp=2,dp=4,zero=1,sp=true,seq=16384,mbs=1"),
    Row(_70B, "tp=8,pp=4,dp=8,zero=1,sp=true,acc=8,seq=4096,mbs=1,optimizer=muon"),
    Row(_70B, "tp=8,pp=4,dp=8,zero=1,sp=true,acc=8,seq=4096,mbs=1,dtype=fp8"),
    # mixtral-8x7b: experts over ep
    Row(_MIX, f"dp=8,ep=8,zero=1,{_S4K}"),
    Row(_MIX, f"dp=8,ep=4,zero=3,{_S4K}"),
    Row(_MIX, f"dp=16,dp_shard=8,ep=4,zero=1,{_S4K}"),  # HSDP with ep inside its shard groups
    Row(_MIX, f"dp=8,ep=8,zero=1,recompute=selective,{_S4K}"),
    Row(_MIX, "dp=8,ep=8,zero=1,recompute=full,seq=8192,mbs=1"),
    Row(_MIX, f"pp=2,dp=8,ep=8,zero=1,acc=4,pp_schedule=1f1b,{_S4K}"),
    Row(_MIX, "cp=2,dp=4,ep=4,zero=1,seq=8192,mbs=1"),
    Row(_MIX, f"pp=2,dp=8,ep=8,zero=1,acc=4,pp_schedule=dualpipev,vpp=2,{_S4K}"),
    Row(_MIX, f"dp=8,ep=8,zero=1,optimizer=muon,{_S4K}"),
    Row(_MIX, f"dp=16,ep=8,zero=0,optimizer=muon,{_S4K}"),  # results copied to every replica
    Row(_MIX, f"tp=2,dp=4,ep=4,zero=1,sp=true,{_S4K}"),
    # qwen3-30b-a3b: many small experts
    Row(_QWEN, f"dp=8,ep=8,zero=1,{_S4K}"),
    Row(_QWEN, f"dp=16,ep=16,zero=3,{_S4K}"),
    Row(_QWEN, f"dp=8,ep=8,zero=1,recompute=selective,{_S4K}"),
    Row(_QWEN, f"pp=2,dp=8,ep=8,zero=1,acc=4,pp_schedule=zero_bubble,{_S4K}"),
    Row(_QWEN, "cp=2,dp=8,ep=8,zero=1,seq=8192,mbs=1"),
    Row(_QWEN, f"dp=8,ep=8,zero=2,acc=2,optimizer=muon,{_S4K}"),
    Row(_QWEN, f"dp=8,ep=8,zero=2,tp=2,{_S4K}"),
    Row(_QWEN, f"dp=8,ep=8,zero=1,dtype=fp32,{_S4K}"),
    # deepseek-v3 (main's preset: standard attention; MLA lands with the deepseek branch)
    Row(_DSV3, f"dp=64,ep=64,zero=1,{_S4K}"),
    Row(_DSV3, f"dp=64,ep=64,zero=3,{_S4K}"),
    Row(_DSV3, f"dp=64,ep=64,zero=1,recompute=full,{_S4K}"),
    Row(_DSV3, f"dp=32,ep=32,zero=1,recompute=selective,{_S4K}"),
    Row(_DSV3, f"pp=2,dp=32,ep=32,zero=1,acc=4,pp_schedule=1f1b,{_S4K}", _DS_PP2),
    Row(_DSV3, "cp=2,dp=32,ep=32,zero=1,seq=8192,mbs=1"),
    Row(_DSV3, f"dp=64,ep=64,zero=1,optimizer=muon,{_S4K}"),
]
# The CI test's sample: a few rows on two-layer (four for the pipeline) versions of the models.
SMOKE = [Row(_8B, f"dp=8,zero=1,{_S4K}"), Row(_MIX, f"dp=8,ep=8,zero=1,{_S4K}")]


def model_of(row: Row, num_layers: int | None = None) -> ModelConfig:
    """The row's model (with `num_layers` layers, for the smoke runs; MoE models keep their
    first dense layers' share)."""
    base = ModelConfig(preset=row.model)
    if num_layers is None:
        return base
    changes = {"num_layers": num_layers}
    if base.num_experts and base.first_k_dense:
        changes["first_k_dense"] = 1
    return ModelConfig(**{**base.keys(), **changes})


def layout_of(row: Row) -> Layout:
    return parse_layout(row.layout, Layout())


def estimate_of(row: Row, num_layers: int | None = None):
    from ultrascale.memory.estimator import estimate

    pp_layers = None if num_layers is not None else row.pp_layers
    return estimate(model_of(row, num_layers), layout_of(row), pp_layers=pp_layers)


def measure_row(row: Row, num_layers: int | None = None, kernels: str = "cuda",
                workers: int | None = 1) -> dict:
    """The row's measurement (the busiest stage's total and parts, every stage), bytes; the
    stages in `workers` processes at once."""
    from ultrascale.memory.measured import config_for, measure

    model, layout = model_of(row, num_layers), layout_of(row)
    pp_layers = None if num_layers is not None else row.pp_layers
    t0 = time.perf_counter()
    got = measure(config_for(model, layout, pp_layers), kernels, workers=workers)
    return {"row": row.key, "model": row.model, "layout": row.layout,
            "num_layers": model.num_layers, "measured": got.as_dict(),
            "seconds": round(time.perf_counter() - t0, 1)}


def with_estimate(result: dict) -> dict:
    """A measured row with today's estimate beside it (the estimator may have changed since the
    row was measured; the engine's step has not)."""
    row = next(r for r in GRID + SMOKE if r.key == result["row"])
    small = result["num_layers"] if result["num_layers"] != model_of(row).num_layers else None
    est = estimate_of(row, small)
    return {**result, "estimate": est.to_dict(),
            "error": est.total / result["measured"]["total"] - 1}


def uncovered(model: ModelConfig) -> str | None:
    """Why the estimator cannot describe `model` yet (its rows are measured and shown, not counted
    in the summary), or None."""
    from ultrascale.theory.terms import attention_of

    if model.attention == "mla" and attention_of(model).name == "gqa":
        return "multi-head latent attention and multi-token prediction have no theory terms yet"
    return None


def summary(results: list[dict]) -> dict:
    """Median and worst |error| over the rows the estimator describes (`uncovered`)."""
    counted = [r for r in results if not uncovered(ModelConfig(preset=r["model"]))]
    errors = [abs(r["error"]) for r in counted]
    return {"rows": len(counted), "left_out": len(results) - len(counted),
            "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "worst_row": max(counted, key=lambda r: abs(r["error"]))["row"],
            "slowest_measure_s": max(r["seconds"] for r in results)}


def table(results: list[dict]) -> str:
    """docs/memory.md's table: estimate against measurement, GiB, per row."""
    lines = ["| model | layout | estimate GiB | measured GiB | error | stage | phase | measure s |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        e, m = r["estimate"], r["measured"]
        left = " (not counted)" if uncovered(ModelConfig(preset=r["model"])) else ""
        lines.append(f"| {r['model']}{left} | `{r['layout']}` | {e['total'] / 2**30:.2f} | "
                     f"{m['total'] / 2**30:.2f} | {100 * r['error']:+.1f}% | {m['stage']} | "
                     f"{m['phase']} | {r['seconds']:.0f} |")
    s = summary(results)
    lines.append("")
    lines.append(f"{s['rows']} rows: median |error| {100 * s['median_abs_error']:.1f}%, worst "
                 f"{100 * s['worst_abs_error']:.1f}% ({s['worst_row']}); slowest --measure "
                 f"{s['slowest_measure_s']:.0f} s.")
    if s["left_out"]:
        why = sorted({uncovered(ModelConfig(preset=r["model"])) for r in results} - {None})
        lines.append(f"{s['left_out']} rows not counted: {'; '.join(why)}.")
    return "\n".join(lines)


# The GPU suite's one-GPU memory layouts (benchmarks/gpu/training_checks.py, MEMORY_LAYOUTS, on
# its ONE_B: Llama 3.2 1B in bf16 at 2048 tokens, Triton kernels off), as layouts.
GPU_SUITE_MODEL = "llama3-1b"
GPU_SUITE_LAYOUTS = {
    "mbs1": "dtype=bf16,seq=2048,mbs=1", "mbs2": "dtype=bf16,seq=2048,mbs=2",
    "mbs2-selective": "dtype=bf16,seq=2048,mbs=2,recompute=selective",
    "mbs4-full": "dtype=bf16,seq=2048,mbs=4,recompute=full",
    "seq2x-selective": "dtype=bf16,seq=4096,mbs=1,recompute=selective",
    "mbs2-acc2": "dtype=bf16,seq=2048,mbs=2,acc=2",
}


def against_gpu(summary_path: Path, workers: int = 1) -> list[dict]:
    """`--measure` against `torch.cuda.max_memory_allocated` of each one-GPU layout of a GPU
    suite run (its summary.json's memory section)."""
    summary = json.loads(summary_path.read_text())
    # run.py's stages; the 2026-11-27 summaries' sections
    parts = summary.get("stages") or summary["sections"]
    runs = parts["memory"]["result"]
    out = []
    for run in runs:
        if "measured_bytes" not in run or run["layout"] not in GPU_SUITE_LAYOUTS:
            continue
        row = Row(GPU_SUITE_MODEL, GPU_SUITE_LAYOUTS[run["layout"]])
        got = measure_row(row, workers=workers)
        out.append({"layout": run["layout"], "cuda_max_allocated": run["measured_bytes"],
                    "measured": got["measured"]["total"], "seconds": got["seconds"],
                    "error": got["measured"]["total"] / run["measured_bytes"] - 1})
        print(f"{run['layout']}: max_memory_allocated {run['measured_bytes'] / 2**30:.3f} GiB, "
              f"--measure {got['measured']['total'] / 2**30:.3f} GiB "
              f"({100 * out[-1]['error']:+.2f}%)", flush=True)
    return out


def main(argv: list[str] | None = None, description: str = __doc__) -> int:
    p = argparse.ArgumentParser(description=description.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="one row on a two-layer model (the "
                   "script runs; tests/test_memory_grid.py measures both of SMOKE's rows)")
    p.add_argument("--rows", default="", help="only rows whose key contains this text")
    p.add_argument("--out", default="benchmarks/data/memory_vs_measure.jsonl")
    p.add_argument("--table", action="store_true", help="print the table of --out and stop")
    p.add_argument("--workers", type=int, default=1, help="processes measuring stages at once")
    p.add_argument("--gpu-results", metavar="SUMMARY.json",
                   help="instead: --measure against a GPU suite run's measured one-GPU peaks")
    args = p.parse_args(argv)
    if args.gpu_results:
        against_gpu(Path(args.gpu_results), args.workers)
        return 0
    out = Path(args.out)
    if args.table:
        results = [with_estimate(json.loads(line)) for line in out.read_text().splitlines()]
        print(table(results))
        return 0
    rows = SMOKE[:1] if args.smoke else [r for r in GRID if args.rows in r.key]
    done = {json.loads(line)["row"] for line in out.read_text().splitlines()} \
        if out.exists() and not args.smoke else set()
    results = []
    for row in rows:
        if row.key in done:
            continue
        result = with_estimate(measure_row(row, num_layers=2 if args.smoke else None,
                                                 workers=args.workers))
        results.append(result)
        print(f"{row.key}: estimate {result['estimate']['total'] / 2**30:.2f} GiB, measured "
              f"{result['measured']['total'] / 2**30:.2f} GiB ({100 * result['error']:+.1f}%), "
              f"{result['seconds']} s", flush=True)
        if not args.smoke:
            with out.open("a") as f:
                f.write(json.dumps({k: v for k, v in result.items()
                                    if k not in ("estimate", "error")}) + "\n")
    if results:
        print(json.dumps(summary(results)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
