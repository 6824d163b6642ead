"""Our optimizer step (parallel/flat.py) against `torch.optim.AdamW(fused=True)` on the same
tensors, on a CPU: a ~345M-parameter Llama (hidden 1024, 20 layers, 16 heads of 64, 8 kv heads,
ffn 4096, vocabulary 32000, tied), one process.

    python benchmarks/bench_optimizer_cpu.py                      # fp32, the timed run (~10 GB)
    python benchmarks/bench_optimizer_cpu.py --dtype bf16         # bf16 parameters, fp32 masters
    python benchmarks/bench_optimizer_cpu.py --smoke              # a 1M-parameter model, 2 repeats

Rows (medians of --repeats, ours and torch's alternated):
- step: ours `Runtime.optimizer_step` (the fused AdamW with the clip coefficient inside its
  kernel, the gradients' bookkeeping, under bf16 the refresh of the bf16 copies) against torch's
  fused AdamW stepping the same values (fp32: the parameters; bf16: the fp32 masters) and, under
  bf16, `torch._foreach_copy_` into the bf16 copies. Target: at most 1.1.
- clip + step: ours `clip_grad_norm` + `optimizer_step` against
  `torch.nn.utils.clip_grad_norm_(foreach=True)` + the fused AdamW. Ours accumulates each tensor's
  norm in fp64 (docs/precision.md); torch's CPU norm accumulates in fp32 (off by ~1e-3 on a
  16M-element tensor), so this row prices that contract on a CPU.
Each repeat hands both the same gradients first (untimed). Then `parts`: the fp64 norm alone,
ours against torch's, and torch's fused AdamW with `grad_scale` 1 against none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ultrascale.config import build_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import init_parallel
from ultrascale.models.llama import build_model
from ultrascale.parallel.apply import parallelize

MODEL = {"preset": None, "hidden_size": 1024, "num_layers": 20, "num_heads": 16,
         "num_kv_heads": 8, "ffn_hidden_size": 4096, "vocab_size": 32000,
         "tie_embeddings": True}
SMOKE = {"preset": None, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 256, "vocab_size": 1000, "tie_embeddings": True}
LR, BETAS, WD, CLIP = 1e-4, (0.9, 0.95), 0.1, 1.0


def build(smoke: bool, dtype: str):
    cfg = build_config({"model": SMOKE if smoke else MODEL,
                        "training": {"seq_len": 16, "micro_batch_size": 1, "grad_clip": CLIP},
                        "parallel": {"dp": 1}, "precision": {"dtype": dtype}, "device": "cpu"},
                       [])
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, 1234), ctx, cfg)
    rt.build_optimizer(LR, BETAS, WD)
    return rt


def torch_side(rt):
    """torch's fused AdamW over the values our optimizer steps (the same tensors), with our decay
    groups, and the bf16 copies it would refresh."""
    owner = rt.data_parallel
    stepped = [(n, p, owner.masters.get(n, p)) for n, p in owner.named]
    groups = [{"params": [v for _, p, v in stepped if p.dim() >= 2], "weight_decay": WD},
              {"params": [v for _, p, v in stepped if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=1e-8, fused=True)
    low = [(p, owner.masters[n]) for n, p, _ in stepped if n in owner.masters]
    return adam, [v for _, _, v in stepped], low


def hand_grads(rt, grads: dict) -> None:
    """Our runtime takes the gradients as if a backward had made them."""
    for n, p in rt.named_parameters():
        p.grad = grads[n].to(p.dtype)
    rt.finish_gradients()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.smoke else 7)
    rt = build(args.smoke, args.dtype)
    adam, values, low = torch_side(rt)
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in rt.named_parameters()}
    params = sum(p.numel() for _, p in rt.named_parameters())

    def theirs(clip: bool):
        for n, v in zip(grads, values):
            v.grad = grads[n]
        if clip:
            torch.nn.utils.clip_grad_norm_(values, CLIP, foreach=True)
        adam.step()
        if low:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in low], [m for _, m in low])

    rows = {"step": ([], []), "clip + step": ([], [])}
    for _ in range(repeats + 1):  # the first round warms up (allocations, first-touch pages)
        for name, (ours, torch_times) in rows.items():
            hand_grads(rt, grads)
            if name == "step":
                rt.data_parallel.scale_grads(torch.ones((), dtype=torch.float64))
                ours.append(timed(lambda: rt.optimizer_step(LR)))
            else:
                ours.append(timed(lambda: (rt.clip_grad_norm(CLIP), rt.optimizer_step(LR))))
            torch_times.append(timed(lambda: theirs(name != "step")))
    out = {"parameters": params, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "repeats": repeats, "rows": {}}
    for name, (ours, torch_times) in rows.items():
        o, t = statistics.median(ours[1:]), statistics.median(torch_times[1:])
        out["rows"][name] = {"ours_s": round(o, 4), "torch_s": round(t, 4),
                             "ratio": round(o / t, 3)}
    out["parts"] = parts(adam, [grads[n] for n in grads], values, repeats)
    print(json.dumps(out, indent=1))


def parts(adam, grads: list, values: list, repeats: int) -> dict:
    """Why the rows are what they are (medians, alternated): the fp64 norm of every gradient, ours
    (fp64 dots over pieces: parallel/flat.py) against torch's `_foreach_norm(dtype=float64)`; and
    torch's fused AdamW handed `grad_scale` 1 against none (its CPU kernel then writes every
    gradient back)."""
    from ultrascale.parallel.flat import _cpu_sq_sum

    one = torch.ones((), dtype=torch.float32)
    timings = {"norm_ours_s": [], "norm_torch_s": [], "adamw_grad_scale_s": [], "adamw_s": []}
    for v, g in zip(values, grads):
        v.grad = g
    for _ in range(repeats + 1):
        timings["norm_ours_s"].append(timed(lambda: _cpu_sq_sum(grads, [1] * len(grads))))
        timings["norm_torch_s"].append(timed(
            lambda: torch._foreach_norm(grads, 2, dtype=torch.float64)))
        for key, scale in (("adamw_grad_scale_s", one), ("adamw_s", None)):
            adam.grad_scale = scale
            timings[key].append(timed(adam.step))
    adam.grad_scale = None
    out = {k: round(statistics.median(v[1:]), 4) for k, v in timings.items()}
    out["norm_ratio"] = round(out["norm_ours_s"] / out["norm_torch_s"], 3)
    out["grad_scale_ratio"] = round(out["adamw_grad_scale_s"] / out["adamw_s"], 3)
    return out


if __name__ == "__main__":
    main()
