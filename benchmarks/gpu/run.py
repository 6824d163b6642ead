"""Every GPU check of the project in one command, within 30 minutes on one H100:

    python benchmarks/gpu/run.py                 # on a machine with a CUDA GPU
    python benchmarks/gpu/run.py --smoke         # the same code at tiny sizes on a CPU (Triton
                                                 # kernels under its interpreter): checks the suite

Sections (each a key of summary.json and a table of summary.md, written to --out):
- kernels: each fused Triton kernel against eager PyTorch (forward + backward time, max error of
  both against fp32), the chunked linear + cross-entropy's peak memory against the plain head's,
  and the SDPA kernel attention runs (flash / memory-efficient) against the math backend;
- speed: MFU of a 1B Llama in bf16 (target >= 50% on an H100) eager, with fused kernels and the
  chunked loss, compiled, compiled with the chunked loss; compile against eager; the FP8 speed-up
  (`precision.dtype=fp8`: tensor-wise scales on the device's scaled matmul; "not available" with
  the reason where the device lacks it);
- memory: the memory estimator against `torch.cuda.max_memory_allocated` for six layouts that fit
  one GPU.
A section or training run that would start after --budget-s seconds is skipped and marked so; the
summary is written after every section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = ("kernels", "speed", "memory")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for summary.json/.md")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU (Triton interpreted): checks the suite itself")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--budget-s", type=float, default=1800.0)
    ap.add_argument("--compile-cache", default=None,
                    help="inductor cache folder (default: a temporary one)")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"--only: unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or with --smoke to check the suite on a "
              "CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    import kernel_checks  # after TRITON_INTERPRET is set (this folder: the script's own)
    import training_checks

    start = time.perf_counter()
    summary = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "smoke": args.smoke, "environment": _environment(torch), "sections": {}}
    deadline = start + args.budget_s  # no training run starts after it
    cache = args.compile_cache or tempfile.mkdtemp(prefix="ultrascale-inductor-")
    runners = {
        "kernels": lambda: kernel_checks.run(torch.device(device), args.smoke),
        "speed": lambda: training_checks.speed_checks(args.smoke, cache, device, deadline),
        "memory": lambda: training_checks.memory_checks(args.smoke, cache, device, deadline),
    }
    markdown = ""
    for name in only:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            summary["sections"][name] = {"skipped": f"time budget spent ({elapsed:.0f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            result = runners[name]()
            summary["sections"][name] = {"result": result}
        except Exception as exc:  # a broken section is reported, the others still run
            summary["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()}
        summary["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        summary["total_seconds"] = round(time.perf_counter() - start, 1)
        # Written after every section: a run cut off by its time limit keeps what it measured.
        markdown = write(summary, Path(args.out))
        print(f"[{summary['total_seconds']} s] {name} done", flush=True)
    print(markdown)
    failed = [n for n, s in summary["sections"].items() if "error" in s]
    return 1 if failed else 0


def write(summary: dict, out: Path) -> str:
    """summary.json and summary.md in `out`; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = render(summary)
    (out / "summary.md").write_text(markdown)
    return markdown


def _environment(torch) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "cuda": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def render(summary: dict) -> str:
    env = summary["environment"]
    lines = [f"# GPU checks ({'smoke run on a CPU' if summary['smoke'] else env['device']})", "",
             f"{summary['date_utc']}; torch {env['torch']}, CUDA {env['cuda']}, triton "
             f"{env['triton']}; {summary['total_seconds']} s in all.", ""]
    for name, section in summary["sections"].items():
        lines += [f"## {name} ({section.get('seconds', 0)} s)", ""]
        if "skipped" in section or "error" in section:
            lines += [f"**{'skipped' if 'skipped' in section else 'error'}**: "
                      f"{section.get('skipped') or section.get('error')}", ""]
            continue
        lines += RENDER[name](section["result"]) + [""]
    return "\n".join(lines)


def _render_kernels(rows: list[dict]) -> list[str]:
    out = ["| kernel | dtype | eager ms | fused ms | speed-up | eager max rel. err "
           "| fused max rel. err | peak eager / fused MiB | backend |", "| --- " * 9 + "|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['kernel']} | {r['dtype']} | error: {r['error']} |" + " |" * 6)
            continue
        peak = ""
        if "eager_peak_bytes" in r:
            peak = (f"{_fmt(r['eager_peak_bytes'] / 2**20)} / "
                    f"{_fmt(r['fused_peak_bytes'] / 2**20)}")
        out.append(f"| {r['kernel']} | {r['dtype']} | {_fmt(r['eager_ms'])} | "
                   f"{_fmt(r['fused_ms'])} | {_fmt(r['speedup'])} | "
                   f"{_fmt(r['eager_max_rel_err_vs_fp32'])} | "
                   f"{_fmt(r['fused_max_rel_err_vs_fp32'])} | "
                   f"{peak} | {r.get('backend', '')} |")
    out += ["", "Errors: the largest difference from the eager kernel in fp32, over the output and "
            "the gradients, each relative to its largest value. The attention row's \"fused\" is "
            "`ops.attention` (its backend named), \"eager\" PyTorch's math backend; the "
            "document_attention row's is packed documents (varlen: the variable-length "
            "FlashAttention kernel) against the math backend under their mask."]
    return out


def _render_speed(res: dict) -> list[str]:
    out = ["| run | tokens/s | step s | MFU | final loss |", "| --- " * 5 + "|"]
    for name, r in {**res["runs"], "fp8 (compiled, chunked)": res["fp8"]}.items():
        if not r.get("available"):
            out.append(f"| {name} | not available: {r['reason'].splitlines()[0]} | | | |")
            continue
        out.append(f"| {name} | {_fmt(r['tokens_per_s'], 5)} | {_fmt(r['step_time_s'])} | "
                   f"{_fmt(r['mfu'])} | {_fmt(r['final_loss'], 4)} |")
    target = res["mfu_target"]
    best = res["best_mfu"]
    verdict = "n/a" if best is None else ("met" if best >= target else "NOT met")
    out += ["", f"Best MFU {_fmt(best)} (target {target}: {verdict}); compile / eager tokens/s "
            f"{_fmt(res['compile_speedup'])}; FP8 / bf16 (compiled, chunked) "
            f"{_fmt(res['fp8_speedup'])}."]
    return out


def _render_memory(rows: list[dict]) -> list[str]:
    out = ["| layout | estimated GiB | measured GiB | measured / estimated | allocated before, GiB |",
           "| --- " * 5 + "|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | {r['estimated_bytes'] / 2**30:.3f} | "
                       f"error: {r['error']} | | |")
            continue
        out.append(f"| {r['label']} | {r['estimated_bytes'] / 2**30:.3f} | "
                   f"{r['measured_bytes'] / 2**30:.3f} | "
                   f"{_fmt(r['ratio_measured_to_estimated'])} | "
                   f"{r.get('allocated_before_bytes', 0) / 2**30:.3f} |")
    return out


RENDER = {"kernels": _render_kernels, "speed": _render_speed, "memory": _render_memory}

if __name__ == "__main__":
    sys.exit(main())
