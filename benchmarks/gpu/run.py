"""Every GPU measurement of the project in one command, against a deadline:

    python benchmarks/gpu/run.py --out $OUT                  # on a CUDA machine (default 440 s)
    python benchmarks/gpu/run.py --out $OUT --resume         # again: only the stages not done
    python benchmarks/gpu/run.py --smoke --out /tmp/smoke    # every stage on the CPU, tiny sizes

Each stage is a subprocess (so no stage inherits another's GPU memory) given a time it is
expected to need; a stage that would not finish before the deadline (`--budget-s`, counted from
the start) is skipped and says so, one that overruns its time is stopped and says so, and
`summary.json` / `summary.md` are written after every stage (`--smoke`, which times nothing,
runs two at a time on the CPU's two cores). `--resume` keeps the stages an
earlier call in the same folder finished and runs the rest, with the same inductor cache
(`--compile-cache`, kept on the machine between calls), so a 15-minute lease holds the start of
the machine and two calls (440 s, then 310 s at once on the warm machine: benchmarks/gpu/README.md).
Stages, as the summary lists them (a call runs them in RUN_ORDER, what the targets read first):

    env            GPU, versions, bf16 GEMM TFLOP/s, copy GB/s, clocks (micro.py)
    ours           our 1B step: compiled blocks and loss, fused optimizer path (training_checks.py)
    peer_hf        transformers' Llama 1B, autocast, fused AdamW, compile (peer_hf.py)
    fp8_bf16       two Llama 3 70B layers at 8192 tokens in bf16 ...
    fp8_rowwise    ... FP8 row-wise and ...
    optimizer      the optimizer path alone: per_tensor, fused, torch's reference (micro.py)
    loss_attention the loss eager / compiled / chunked; the SDPA probe (micro.py)
    baseline       our 1B step with training.optimizer_impl=per_tensor
    sync_check     host syncs on unlogged steps (torch.cuda.set_sync_debug_mode)
    fp8_tensorwise ... FP8 tensor-wise
    profile        the steady step's kernels (profile_step.py)
    plan           `ultrascale plan`'s step time for the 1B layout against `ours`
    memory         the estimator against max_memory_allocated, six one-GPU layouts
    torchtitan     torchtitan 0.3's 1B flavour, guarded (peer_torchtitan.py; --wheels)
    kernels        the Triton kernels against eager (kernel_checks.py)

summary.json holds {"device", "headline": {"ours_tokens_per_s", "peer_tokens_per_s", "peer",
"ratio", "mfu"}, "fp8": {"shape", "speedup", ...}, "targets", "stages"}; the peer is torchtitan
where it ran, else the Hugging Face step. Preparing the device (wheels the image lacks, the
torchtitan wheels): benchmarks/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TC, MICRO = "training_checks.py", "micro.py"
# name -> (seconds it is expected to take: the 2026-11-29 H200 lease's timings, rounded up, each
# with a process's start, the model's CPU initialisation and a cold compile; the command after
# `python benchmarks/gpu/`, DIR: the output folder; torchtitan's a guess: it never ran). 840 s.
STAGES = {
    "env": (10, [MICRO, "env"]),
    "ours": (50, [TC, "speed", "--variant", "ours"]),
    "peer_hf": (75, ["peer_hf.py"]),
    "fp8_bf16": (60, [TC, "speed", "--variant", "fp8_bf16"]),
    "fp8_rowwise": (85, [TC, "speed", "--variant", "fp8_rowwise"]),
    "optimizer": (15, [MICRO, "optimizer"]),
    "loss_attention": (30, [MICRO, "loss_attention"]),
    "baseline": (45, [TC, "speed", "--variant", "baseline"]),
    "sync_check": (50, [TC, "speed", "--variant", "ours", "--sync-check"]),
    "fp8_tensorwise": (85, [TC, "speed", "--variant", "fp8_tensorwise"]),
    "profile": (45, ["profile_step.py", "--out", "DIR"]),
    "plan": (10, None),
    "memory": (140, [TC, "memory"]),
    "torchtitan": (120, ["peer_torchtitan.py", "--log", "DIR/torchtitan.log"]),
    "kernels": (20, ["-c", "KERNELS"]),
}
# The order a call runs them in: what issue 42's targets read first (the headline, FP8 row-wise,
# the plan and the memory checks), so that a call cut short by its deadline has measured those.
RUN_ORDER = ("env", "ours", "peer_hf", "fp8_bf16", "fp8_rowwise", "plan", "memory", "sync_check",
             "profile", "optimizer", "loss_attention", "baseline", "fp8_tensorwise", "kernels",
             "torchtitan")
assert sorted(RUN_ORDER) == sorted(STAGES)
KERNELS = ("import json, sys, torch, kernel_checks; json.dump(kernel_checks.run(torch.device("
           "'cpu' if '--smoke' in sys.argv else 'cuda'), '--smoke' in sys.argv), "
           "open(sys.argv[sys.argv.index('--json') + 1], 'w'))")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for summary.json/.md and the stages' "
                    "files (default: benchmarks/gpu/results/<date>-<card>; --smoke: the temporary "
                    "folder's ultrascale-gpu-smoke)")
    ap.add_argument("--smoke", action="store_true", help="every stage on the CPU, tiny sizes")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="deadline from the start (default 440 s; none under --smoke)")
    ap.add_argument("--only", default=None, help="comma-separated stages (default: all)")
    ap.add_argument("--resume", action="store_true", help="keep the stages done in --out")
    ap.add_argument("--wheels", default=None, help="torchtitan's wheels (README.md)")
    ap.add_argument("--compile-cache", default="/tmp/ultrascale-inductor")
    args = ap.parse_args(argv)
    names = list(RUN_ORDER) if args.only is None else [s for s in args.only.split(",") if s]
    unknown = set(names) - set(STAGES)
    if unknown:
        ap.error(f"--only: unknown stages {sorted(unknown)}; choose from {list(STAGES)}")
    if not args.smoke and not _cuda():
        print("no CUDA device: run on a GPU machine, or with --smoke to check the suite on a "
              "CPU", file=sys.stderr)
        return 2
    missing = _missing_packages()
    if missing:
        print(f"missing Python packages {missing}: carry their wheels (benchmarks/gpu/README.md)",
              file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else _default_out(args.smoke)
    out.mkdir(parents=True, exist_ok=True)
    summary = _load(out) if args.resume else {}
    if args.budget_s is None:
        args.budget_s = 1e9 if args.smoke else 440.0
    summary.update(date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   smoke=args.smoke, budget_s=args.budget_s)
    summary.setdefault("stages", {})
    run_stages(names, summary, out, args)
    failed = [n for n, s in summary["stages"].items() if "error" in s]
    return 1 if failed else 0


def run_stages(names: list[str], summary: dict, out: Path, args) -> None:
    start = time.perf_counter()
    deadline = start + args.budget_s
    todo = [n for n in names if "result" not in summary["stages"].get(n, {})]  # --resume keeps
    # On a GPU one stage at a time: each is timed alone. Under --smoke nothing is timed, and two
    # stages at a time keep a CPU's two cores busy; `plan` reads `ours`' figure, so it waits.
    workers = 2 if args.smoke else 1
    last = [n for n in todo if n == "plan"] if workers > 1 else []
    lock = threading.Lock()

    def one(name: str) -> None:
        stage = _timed_stage(name, summary, out, args, deadline)
        with lock:
            summary["stages"][name] = stage
            # the stages in the order they are listed, whichever finished first
            summary["stages"] = {n: summary["stages"][n] for n in STAGES
                                 if n in summary["stages"]}
            summary["total_seconds"] = round(time.perf_counter() - start, 1)
            report.write(summary, out)  # after every stage: a cut-off call keeps what it measured
            print(f"[{summary['total_seconds']} s] {name}: {_state(stage)}", flush=True)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, [n for n in todo if n not in last]))
    for name in last:
        one(name)


def _timed_stage(name: str, summary: dict, out: Path, args, deadline: float) -> dict:
    """The stage's result, or why it was skipped: one that would not finish before the deadline
    is not started."""
    need = STAGES[name][0]
    left = deadline - time.perf_counter()
    if need > left:
        return {"skipped": f"would not finish before the deadline (needs ~{need} s, "
                           f"{left:.0f} s left)"}
    t0 = time.perf_counter()
    # a stage may overrun its time twofold; under --smoke (a shared CPU) it has 15 minutes
    limit = 900.0 if args.smoke else min(2 * need, left)
    stage = run_stage(name, summary, out, args, limit)
    stage["seconds"] = round(time.perf_counter() - t0, 1)
    return stage


def run_stage(name: str, summary: dict, out: Path, args, timeout: float) -> dict:
    if name == "plan":
        return report.plan_stage(summary, args.smoke, _env(args))
    json_out = out / f".{name}.json"
    cmd = [a.replace("DIR", str(out)).replace("KERNELS", KERNELS) for a in STAGES[name][1]]
    cmd = [sys.executable] + cmd + ["--json", str(json_out)] + (["--smoke"] if args.smoke else [])
    if name == "torchtitan":
        cmd += ["--timeout", str(max(timeout - 30, 30))] + (
            ["--wheels", str(Path(args.wheels).resolve())] if args.wheels else [])  # cwd: HERE
    try:
        proc = subprocess.run(cmd, cwd=HERE, env=_env(args), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _log(out, name, f"{exc.stdout or ''}{exc.stderr or ''}")
        return {"error": f"stopped after {timeout:.0f} s (it was given {STAGES[name][0]} s)"}
    _log(out, name, proc.stdout + proc.stderr)
    if proc.returncode != 0 or not json_out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:400]}"}
    result = json.loads(json_out.read_text())
    json_out.unlink()
    return {"result": result}


def _env(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=args.compile_cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"  # Triton kernels under the interpreter on a CPU
    return env


_LOG_LOCK = threading.Lock()


def _log(out: Path, name: str, text) -> None:
    """The last 60 lines of each stage's output, in one file."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    with _LOG_LOCK, open(out / "stages.log", "a") as f:  # --smoke: two stages at a time
        f.write(f"==== {name} ====\n" + "\n".join(text.splitlines()[-60:]) + "\n")


def _state(stage: dict) -> str:
    return next(k for k in ("result", "skipped", "error") if k in stage) if stage else "?"


def _cuda() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


def _missing_packages() -> list[str]:
    code = ("import importlib.util as u; print(','.join(m for m in ('torch', 'pydantic', 'yaml', "
            "'numpy', 'rich', 'transformers', 'tokenizers') if u.find_spec(m) is None))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    return [m for m in probe.stdout.strip().split(",") if m]


def _default_out(smoke: bool) -> Path:
    """benchmarks/gpu/results/<date>-<card> for a GPU run; a smoke run's figures are no result:
    they go to the temporary folder, out of the repository."""
    if smoke:
        return Path(tempfile.gettempdir()) / "ultrascale-gpu-smoke"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    card = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
        capture_output=True, text=True, timeout=120).stdout.strip()
    slug = "".join(c if c.isalnum() else "-" for c in card.lower().replace("nvidia ", ""))
    return HERE / "results" / f"{date}-{slug.strip('-')}"


def _load(out: Path) -> dict:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


if __name__ == "__main__":
    sys.exit(main())
