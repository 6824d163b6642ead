"""Saved activations of a DeepSeek-V3-shaped model under each recompute policy, measured.

One process, fp32, one micro-batch forward and backward: the peak bytes autograd keeps for
backward (memory/measure.py `SavedActivationMeter`, each saved storage counted once while it
lives), for `training.recompute` none, selective, full and norms_and_mla_up (DeepSeek-V3's: the
RMSNorms' and MLA's up-projections' outputs recomputed). The model is `tiny-deepseek` widened by
the flags (MLA and experts kept in proportion); a measurement, not a timing, so it runs anywhere:

    python benchmarks/deepseek_recompute_memory.py                      # hidden 256, 8 heads
    python benchmarks/deepseek_recompute_memory.py --hidden 512 --heads 16 --seq 512 --json out.json

Prints, per policy, the peak and its ratio to none's: the figures the estimator's MLA theory
answers to (docs/deepseek.md).
"""

from __future__ import annotations

import argparse
import json

import torch

from ultrascale.config import build_config
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.memory.measure import SavedActivationMeter
from ultrascale.models.llama import build_model
from ultrascale.parallel.apply import parallelize

POLICIES = ("none", "selective", "full", "norms_and_mla_up")


def model_keys(hidden: int, heads: int) -> dict:
    """tiny-deepseek's proportions at `hidden` (per head: 16 + 8 query-key, 16 value dims at
    hidden 64 x 4 heads scaled with the width)."""
    scale = hidden // 64
    return {"preset": "tiny-deepseek", "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": heads, "ffn_hidden_size": 2 * hidden, "q_lora_rank": 32 * scale,
            "kv_lora_rank": 16 * scale, "qk_rope_head_dim": 8 * scale // (heads // 4),
            "qk_nope_head_dim": 16 * scale // (heads // 4),
            "v_head_dim": 16 * scale // (heads // 4), "moe_ffn_hidden_size": hidden // 2}


def saved_bytes(recompute: str, model: dict, seq: int, batch: int) -> int:
    cfg = build_config({"model": model, "parallel": {"dp": 1}, "device": "cpu",
                        "precision": {"dtype": "fp32"},
                        "training": {"seq_len": seq, "micro_batch_size": batch,
                                     "recompute": recompute}})
    ctx = ParallelContext.without_mesh("cpu")
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    with SavedActivationMeter(rt.module) as meter:
        rt.forward_backward([(tokens[:, :-1], tokens[:, 1:])], 1.0 / (batch * seq))
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    model = model_keys(args.hidden, args.heads)
    figures = {p: saved_bytes(p, model, args.seq, args.batch) for p in POLICIES}
    print(f"tiny-deepseek at hidden {args.hidden}, {args.heads} heads, {args.batch} x {args.seq} "
          "tokens, fp32, one process")
    print(f"{'recompute':<18} {'saved MiB':>10} {'of none':>8}")
    for policy, nbytes in figures.items():
        print(f"{policy:<18} {nbytes / 2**20:>10.2f} {nbytes / figures['none']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "seq": args.seq, "batch": args.batch,
                       "saved_bytes": figures}, f, indent=2)


if __name__ == "__main__":
    main()
