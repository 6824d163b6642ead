"""run.py's summary: the headline (ours against the peer), the FP8 shape check, the targets of issue
42, the `plan` stage (the planner's step time against ours), and summary.json / summary.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FP8_SHAPE = ("2 layers of Llama 3 70B (hidden 8192, ffn 28672, 64 heads, 8 kv heads), vocabulary "
             "32768, seq 8192, micro-batch 1, compiled; fp8_filter=auto")


def result(summary: dict, stage: str) -> dict | None:
    r = summary["stages"].get(stage, {}).get("result")
    return r if isinstance(r, dict) and r.get("available", True) else None


def headline(summary: dict) -> dict:
    ours = result(summary, "ours") or {}
    peer = result(summary, "torchtitan") or result(summary, "peer_hf") or {}
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"] if ours and peer else None
    return {"ours_tokens_per_s": ours.get("tokens_per_s"),
            "peer_tokens_per_s": peer.get("tokens_per_s"),
            "peer": peer.get("peer"), "ratio": ratio, "mfu": ours.get("mfu"),
            "peer_mfu": peer.get("mfu"), "attention": ours.get("attention")}


def fp8(summary: dict) -> dict:
    runs = {v: result(summary, f"fp8_{v}") for v in ("bf16", "rowwise", "tensorwise")}
    out = {"shape": FP8_SHAPE}
    for name, r in runs.items():
        out[f"{name}_tokens_per_s"] = r["tokens_per_s"] if r else None
        out[f"{name}_mfu_vs_bf16_peak"] = r["mfu"] if r else None
    base = runs["bf16"]
    for name in ("rowwise", "tensorwise"):
        key = "speedup" if name == "rowwise" else "speedup_tensorwise"
        out[key] = runs[name]["tokens_per_s"] / base["tokens_per_s"] if base and runs[name] \
            else None
    return out


def targets(summary: dict) -> dict:
    """Issue 42's GPU acceptance, each met, not met or n/a (with what it was)."""
    head, f8 = summary["headline"], summary["fp8"]
    device = summary.get("device") or ""
    floor = 0.50 if "H200" in device else 0.47
    rows = summary["stages"].get("memory", {}).get("result") or []
    ratios = [r["ratio_measured_to_estimated"] for r in rows if "ratio_measured_to_estimated" in r]
    worst = max(abs(r - 1) for r in ratios) if rows and len(ratios) == len(rows) else None
    plan = result(summary, "plan") or {}
    checks = {"ours / peer >= 1.05": (head["ratio"], lambda x: x >= 1.05),
              f"MFU >= {floor}": (head["mfu"], lambda x: x >= floor),
              "FP8 row-wise >= 1.2x bf16": (f8["speedup"], lambda x: x >= 1.2),
              "memory estimate within 10% (all six)": (worst, lambda x: x <= 0.10),
              "plan within 15% of the step": (plan.get("relative_error"), lambda x: x <= 0.15)}
    return {name: {"value": value, "met": None if value is None else bool(ok(value))}
            for name, (value, ok) in checks.items()}


def plan_stage(summary: dict, smoke: bool, env: dict) -> dict:
    """`ultrascale plan` for the 1B layout the `ours` stage ran, against its measured step."""
    ours = result(summary, "ours")
    if ours is None:
        return {"skipped": "no `ours` figure to compare with"}
    device = summary.get("device") or ""
    gpu = "h200" if "H200" in device else "h100"
    cmd = [sys.executable, "-m", "ultrascale.cli", "plan", "--preset", "llama3-1b", "--gpus", "1",
           "--gpu", gpu, "--global-batch-tokens", "8192", "--seq-len", "2048", "--layout",
           "dp=1,mbs=4,acc=1", "--dtype", "bf16", "--json", "--config-out", "-"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return {"error": f"ultrascale plan exited {proc.returncode}: {proc.stderr[-300:]}"}
    plan = json.loads(proc.stdout)
    measured = ours["step_time_s"]
    return {"result": {"gpu_profile": gpu, "predicted_step_s": plan["step_time_s"],
                       "measured_step_s": measured, "breakdown_s": plan.get("breakdown_s"),
                       "relative_error": abs(plan["step_time_s"] - measured) / measured,
                       "note": "smoke: a CPU step against a GPU prediction" if smoke else None}}


def write(summary: dict, out: Path) -> None:
    env = result(summary, "env") or {}
    summary["device"] = env.get("device")
    summary["headline"] = headline(summary)
    summary["fp8"] = fp8(summary)
    summary["targets"] = targets(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(render(summary))


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.4g}"
    return str(x)


def render(summary: dict) -> str:
    head = summary["headline"]
    lines = [f"# GPU suite ({'smoke run on a CPU' if summary['smoke'] else summary['device']})",
             "", f"{summary['date_utc']}; {summary.get('total_seconds')} s of "
             f"{summary['budget_s']:.0f} (the deadline).", "", "| headline | |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in head.items()]
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {k} | {_fmt(t['value'])} | {_fmt(t['met'])} |"
              for k, t in summary["targets"].items()]
    lines += ["", "| FP8 | |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in summary["fp8"].items()]
    for name, stage in summary["stages"].items():
        lines += ["", f"## {name} ({stage.get('seconds', 0)} s)", ""]
        if "result" not in stage:
            lines.append(f"**{'skipped' if 'skipped' in stage else 'error'}**: "
                         f"{stage.get('skipped') or stage.get('error')}")
            continue
        lines += ["```", json.dumps(stage["result"], indent=1)[:3000], "```"]
    return "\n".join(lines) + "\n"
