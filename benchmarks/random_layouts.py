"""Random layouts against what they must match, to find what the hand-picked tests miss.

    python benchmarks/random_layouts.py train --seed 2 --count 25 --max-world 4
    python benchmarks/random_layouts.py resume --seed 31 --count 20 --max-world 8
    python benchmarks/random_layouts.py measure --seed 7 --count 40
    python benchmarks/random_layouts.py train --smoke        # one layout (CI)

`train`: a random layout of `ultrascale train` (dp, tp, pp, cp, ep, ZeRO, hybrid sharding, each
schedule and cp mode, recompute, the chunked loss, Muon, document masks, a sliding window over
every layer or some; uneven pipeline splits, ZeRO-3's gathering, cp unbalanced, overlap off,
small buckets; tiny, tiny-moe or tiny-deepseek; fp32, 4 steps of 8 x 64 tokens) against
one process at the same global batch: the largest relative loss difference and the first step's
gradient norm's, each within 2e-5 (the fp32 parity bound of tests/parity.py with room for 4 steps
of Adam), or MISMATCH. A layout the config refuses is skipped; one that crashes after launch is
reported as FAILED.
`resume`: a random layout trains 4 steps and saves at step 2; another random layout of the same
model, optimizer and data resumes that checkpoint: its steps 3 and 4 within the same bound of the
first's.
`measure`: a random layout of `ultrascale memory --measure` (the engine's step on fake tensors;
the tiny presets, or llama3-8b, mixtral-8x7b, deepseek-v3 or qwen3-30b-a3b cut to 4 or 8 layers;
the chunked loss or not) against the estimate, FAR beyond 10% (the grid's worst target,
docs/memory.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = {"training.steps": 4, "logging.every": 1, "precision.dtype": "fp32",
        "training.seq_len": 64, "training.global_batch_size": 8, "logging.progress": "false",
        "logging.sample_tokens": 0, "checkpoint.every": 0, "training.warmup_steps": 1}
TOLERANCE = 2e-5


def _dims(rng: random.Random, max_world: int, sizes=(1, 1, 2, 2, 4)) -> dict[str, int]:
    while True:
        dims = {d: rng.choice(sizes) for d in ("dp", "tp", "pp", "cp")}
        world = dims["dp"] * dims["tp"] * dims["pp"] * dims["cp"]
        if 2 <= world <= max_world:
            return dims


def train_layout(rng: random.Random, max_world: int, model: str | None = None) -> dict:
    """A random `ultrascale train` layout (config keys -> values)."""
    model = model or rng.choice(["tiny", "tiny-moe", "tiny-deepseek"])
    dims = _dims(rng, max_world)
    c = {"model.preset": model, **{f"parallel.{d}": v for d, v in dims.items()},
         "parallel.zero": rng.choice([0, 1, 2, 3]),
         "training.micro_batch_size": rng.choice([1, 2, 4]),
         "training.recompute": rng.choice(["none", "selective", "full"] + (
             ["norms_and_mla_up"] if model == "tiny-deepseek" else []))}
    if model != "tiny" and rng.random() < 0.6:
        c["parallel.ep"] = rng.choice([2, 4])
    if dims["dp"] >= 4 and rng.random() < 0.5:
        c["parallel.dp_shard"] = rng.choice([2, dims["dp"] // 2])
    if dims["tp"] > 1:
        c["parallel.sequence_parallel"] = rng.choice(["true", "false"])
    if dims["pp"] > 1:
        c["parallel.pp_schedule"] = rng.choice(["afab", "1f1b", "interleaved", "zero_bubble",
                                                "dualpipev"])
        if c["parallel.pp_schedule"] == "interleaved":
            c["parallel.pp_virtual_stages"] = 2
    if dims["cp"] > 1:
        c["parallel.cp_mode"] = rng.choice(["ring", "all_gather", "ulysses"])
    _engine_knobs(rng, c, dims)
    for key, p in (("training.chunked_loss", 0.25), ("data.document_mask", 0.3)):
        if rng.random() < p:
            c[key] = "true"
    if rng.random() < 0.25:
        c["training.optimizer"] = "muon"
    if rng.random() < 0.2:
        c["model.sliding_window"] = 16  # of 64 tokens
        if rng.random() < 0.5:
            c["model.sliding_window_layers"] = "[1,3]"  # of 4: full attention on 0 and 2
    return c


def _engine_knobs(rng: random.Random, c: dict, dims: dict[str, int]) -> None:
    """The knobs that change how the engine runs a layout, not its sums: an uneven pipeline
    split (4 layers), ZeRO-3's gathering, cp's chunks unbalanced, overlap off, small buckets."""
    chunks = 2 if c.get("parallel.pp_schedule") == "dualpipev" else 1
    stages = dims["pp"] * c.get("parallel.pp_virtual_stages", chunks)
    if stages == 2 and rng.random() < 0.3:
        c["parallel.pp_layers"] = rng.choice(["[1,3]", "[3,1]"])
    if c["parallel.zero"] == 3 and rng.random() < 0.5:
        c["parallel.zero3_gather"] = rng.choice(["step", "micro_batch"])
    if dims["cp"] > 1 and rng.random() < 0.25:
        c["parallel.cp_load_balance"] = "false"
    if rng.random() < 0.15:
        c["parallel.overlap"] = "false"
    if rng.random() < 0.2:
        c["parallel.bucket_mb"] = 0.05  # buckets of a few tensors of the tiny models


def _train(c: dict, out: Path, dry: bool = False) -> subprocess.CompletedProcess:
    shutil.rmtree(out, ignore_errors=True)
    sets = [a for k, v in {**BASE, **c, "logging.run_dir": out}.items()
            for a in ("--set", f"{k}={v}")]
    return subprocess.run(["ultrascale", "train", *sets] + (["--dry-run"] if dry else []),
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _why(proc: subprocess.CompletedProcess, out: Path) -> str:
    """The launcher's last line and the first failing rank's last error line (the run folder
    goes with the script's temporary folder)."""
    said = (proc.stderr or proc.stdout).strip().splitlines()[-1]
    for log in sorted((out / "rank_logs").glob("rank_*.log")):
        errors = [line for line in log.read_text(errors="replace").splitlines()
                  if "Error" in line or "error:" in line]
        if errors:
            return f"{said} | {log.name}: {errors[-1].strip()}"
    return said


def _steps(out: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def run_train(rng: random.Random, count: int, max_world: int, root: Path) -> list[str]:
    references: dict[tuple, list] = {}
    lines, tries = [], 0
    while len(lines) < count and tries < 50 * count:
        tries += 1
        c = train_layout(rng, max_world)
        if _train(c, root / "dry", dry=True).returncode:
            continue  # refused by the config, with its reason: not this script's subject
        kept = ("model.preset", "training.optimizer", "data.document_mask",
                "model.sliding_window", "model.sliding_window_layers")
        key = tuple(c.get(k) for k in kept)
        if key not in references:
            one = {k: v for k, v in c.items() if k in kept}
            proc = _train({**one, "parallel.dp": 1, "training.micro_batch_size": 8}, root / "ref")
            if proc.returncode:
                raise SystemExit(f"one process failed: {proc.stderr[-2000:]}")
            references[key] = _steps(root / "ref")
        lines.append(_compare(c, references[key], root))
        print(lines[-1], flush=True)
    return lines


def _compare(c: dict, ref: list, root: Path) -> str:
    where = " ".join(f"{k.split('.')[-1]}={v}" for k, v in c.items())
    proc = _train(c, root / "run")
    if proc.returncode:
        return f"FAILED :: {where} :: {_why(proc, root / 'run')}"
    got = _steps(root / "run")
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, ref))
    norm = abs(got[0][1] - ref[0][1]) / ref[0][1]
    ok = loss <= TOLERANCE and norm <= TOLERANCE and len(got) == len(ref)
    return f"{'OK' if ok else 'MISMATCH'} loss {loss:.1e} grad norm {norm:.1e} :: {where}"


def run_resume(rng: random.Random, count: int, max_world: int, root: Path) -> list[str]:
    """Layout A trains 4 steps and saves at step 2; layout B (the same model, optimizer and data,
    another mesh, ZeRO stage, schedule, recompute) resumes A's step-2 checkpoint: B's steps 3 and
    4 must be A's, within the train check's bound."""
    lines, tries = [], 0
    while len(lines) < count and tries < 50 * count:
        tries += 1
        a = train_layout(rng, max_world)
        b = {k: v for k, v in train_layout(rng, max_world, a["model.preset"]).items()
             if k in LAYOUT_ONLY}
        b = {**{k: v for k, v in a.items() if k in SAME_DATA}, **b}
        if any(_train(c, root / "dry", dry=True).returncode for c in (a, b)):
            continue
        lines.append(_compare_resumed(a, b, root))
        print(lines[-1], flush=True)
    return lines


# What a resumed run must keep (the model, optimizer and data: the sums) and what it may change.
SAME_DATA = ["model.preset", "training.optimizer", "data.document_mask", "model.sliding_window",
             "model.sliding_window_layers"]
LAYOUT_ONLY = [f"parallel.{k}" for k in ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard",
                                         "sequence_parallel", "pp_schedule", "pp_virtual_stages",
                                         "cp_mode", "pp_layers", "zero3_gather",
                                         "cp_load_balance", "overlap", "bucket_mb")] + [
    "training.micro_batch_size", "training.recompute", "training.chunked_loss"]


def _compare_resumed(a: dict, b: dict, root: Path) -> str:
    def words(c: dict, keys: list[str]) -> str:
        return " ".join(f"{k.split('.')[-1]}={v}" for k, v in c.items() if k in keys)
    where = f"{words(a, SAME_DATA)} | {words(a, LAYOUT_ONLY)} -> {words(b, LAYOUT_ONLY)}"
    proc = _train({**a, "checkpoint.every": 2}, root / "a")
    if proc.returncode:
        return f"FAILED (A) :: {where} :: {_why(proc, root / 'a')}"
    saved = root / "a" / "checkpoints" / f"step_{2:08d}"
    proc = _train({**b, "checkpoint.resume": saved}, root / "b")
    if proc.returncode:
        return f"FAILED (B) :: {where} :: {_why(proc, root / 'b')}"
    want, got = _steps(root / "a")[2:], _steps(root / "b")
    got = got[-len(want):] if want else got
    loss = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(got, want))
    ok = loss <= TOLERANCE and len(got) == len(want) == 2
    return f"{'OK' if ok else 'MISMATCH'} resumed loss {loss:.1e} :: {where}"


def measure_layout(rng: random.Random, tiny_only: bool) -> list[str]:
    """A random `ultrascale memory` layout (flags); the big models with 4 or 8 layers."""
    model = rng.choice(["tiny", "tiny-moe", "tiny-deepseek"] + ([] if tiny_only else [
        "llama3-8b", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"]))
    big = not model.startswith("tiny")
    d = _dims(rng, 256, (1, 1, 2, 4)) if not big else {
        "dp": rng.choice([8, 16, 32]), "tp": rng.choice([1, 1, 2, 4]),
        "pp": rng.choice([1, 1, 2, 4]), "cp": rng.choice([1, 1, 2])}
    a = ["--preset", model] + [x for k, v in d.items() for x in (f"--{k}", str(v))]
    if model not in ("tiny", "llama3-8b") and rng.random() < 0.7:
        a += ["--ep", str(rng.choice([2, 4, 8]))]
    a += ["--zero", str(rng.choice([0, 1, 2, 3]))]
    if d["pp"] > 1:
        schedule = rng.choice(["afab", "1f1b", "interleaved", "zero_bubble", "dualpipev"])
        a += ["--pp-schedule", schedule, "--grad-accum", str(rng.choice([4, 8]))]
        a += ["--pp-virtual-stages", "2"] if schedule == "interleaved" else []
    if d["cp"] > 1:
        a += ["--cp-mode", rng.choice(["ring", "all_gather", "ulysses"])]
    a += ["--recompute", rng.choice(["none", "selective", "full"])]
    a += ["--chunked-loss"] if rng.random() < 0.3 else []
    a += ["--seq-len", str(4096 if big else rng.choice([256, 1024])), "--mbs",
          str(rng.choice([1, 2]))]
    a += ["--num-layers", "4" if d["pp"] <= 2 else "8"] if big else []
    return a


def run_measure(rng: random.Random, count: int, tiny_only: bool) -> list[str]:
    lines, tries = [], 0
    while len(lines) < count and tries < 50 * count:
        tries += 1
        a = measure_layout(rng, tiny_only)
        if subprocess.run(["ultrascale", "memory", *a], capture_output=True).returncode:
            continue
        proc = subprocess.run(["ultrascale", "memory", *a, "--measure", "--json"],
                              capture_output=True, text=True)
        if proc.returncode:
            lines.append(f"FAILED :: {' '.join(a)} :: {proc.stderr.strip().splitlines()[-1]}")
        else:
            r = json.loads(proc.stdout)
            err = (r["total"] - r["measured"]["total"]) / r["measured"]["total"]
            lines.append(f"{'OK ' if abs(err) <= 0.10 else 'FAR'} {err:+.3f} "
                         f"({r['measured']['phase']}) :: {' '.join(a)}")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=["train", "resume", "measure"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=20, help="layouts run (refused ones not counted)")
    ap.add_argument("--max-world", type=int, default=4, help="train: most ranks a layout takes")
    ap.add_argument("--smoke", action="store_true", help="one small layout")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.check == "train":
            lines = run_train(rng, 1 if args.smoke else args.count,
                              2 if args.smoke else args.max_world, Path(tmp))
        elif args.check == "resume":
            lines = run_resume(rng, 1 if args.smoke else args.count,
                               2 if args.smoke else args.max_world, Path(tmp))
        else:
            lines = run_measure(rng, 1 if args.smoke else args.count, args.smoke)
    good = sum(line.startswith("OK") for line in lines)
    print(f"{good} of {len(lines)} layouts OK (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
