"""DeepSeek-V3 on its published layout: the planner's tokens/s per GPU and the memory estimate on
H800s, against DeepSeek's published throughput.

The layout is configs/deepseek-v3.yaml's (2,048 H800s, pp16 x ep64, ZeRO-1 over dp128, no tp,
4,096-token sequences, 15,360 a step, FP8 block-wise, recompute norms_and_mla_up): DualPipeV
(DeepSeek trains with DualPipe; 32 chunks, rank r holding chunks r and 31 - r, the embedding, the
MTP module and the head on rank 0) with the config's split of the layers (the planner's balanced
one: `ultrascale plan --pp-layers balanced`), then for comparison DualPipeV with the engine's
default split and 1F1B with its balanced split. Each is costed on its busiest pipeline rank.
DeepSeek's figure: 180K H800 GPU-hours per trillion tokens (DeepSeek-V3 technical report),
1e12 / (180e3 x 3600) = 1,543 tokens/s per GPU. Nothing is fitted to it: every term comes from
the model and the h800 profile (planner/hardware.py). A prediction, not a timing, so it runs
anywhere in a second:

    python benchmarks/deepseek_v3_planner.py
"""

from __future__ import annotations

import yaml

from ultrascale.config import build_config
from ultrascale.memory.estimator import estimate
from ultrascale.planner.cost import predict
from ultrascale.planner.hardware import get_hardware
from ultrascale.rules import layers_per_stage
from ultrascale.theory.dualpipev import paired_forwards
from ultrascale.theory.pipeline import rank_layers

PUBLISHED = 1e12 / (180e3 * 3600)  # tokens/s per GPU: 180K GPU-hours per trillion tokens
CONFIG = "configs/deepseek-v3.yaml"
# (schedule, the layers' split: the config's, the engine's default, or the planner's balance)
RUNS = (("dualpipev", "config"), ("dualpipev", "engine"), ("1f1b", "balanced"))
NAMED = {"config": "the config's split (balanced)", "engine": "the engine's default split",
         "balanced": "the planner's balanced split"}


def config(schedule: str | None = None):
    """The config, its schedule changed to `schedule` (the engine's split of the layers then)."""
    with open(CONFIG) as f:
        data = yaml.safe_load(f)
    data.pop("data", None)  # the corpus and tokenizer are not needed to plan
    par = data["parallel"]
    if schedule is not None and schedule != par["pp_schedule"]:
        par["pp_schedule"] = schedule
        par["pp_virtual_stages"] = 2 if schedule == "dualpipev" else 1
        par.pop("pp_layers")
    if "pp_layers" not in par:
        layers = build_config({"model": data["model"]}).model.num_layers
        par["pp_layers"] = layers_per_stage(layers, par["pp"] * par["pp_virtual_stages"])
    return build_config(data)


def main() -> None:
    hw = get_hardware("h800")
    print(f"DeepSeek-V3 on {CONFIG}'s layout, h800 profile; published {PUBLISHED:,.0f} "
          "tokens/s per GPU")
    lay = config().layout()
    print(f"published step: {lay.global_batch_tokens / (lay.world_size * PUBLISHED):.1f} s")
    for schedule, split in RUNS:
        cfg = config(schedule)
        lay = cfg.layout()
        if split == "engine":
            cfg.parallel.pp_layers = layers_per_stage(cfg.model.num_layers,
                                                      lay.pp * lay.pp_virtual_stages)
        pred = predict(cfg.model, lay, hw,
                       pp_layers="balanced" if split == "balanced" else cfg.parallel.pp_layers)
        ranks = rank_layers(cfg.model, lay, pred.pp_layers)
        est = estimate(cfg.model, lay, device_memory=int(hw.usable_memory_bytes),
                       pp_layers=ranks)
        gap = pred.tokens_per_s_per_device / PUBLISHED - 1
        print(f"\n{schedule}, {NAMED[split]} (layers per rank {ranks}): "
              f"{pred.tokens_per_s_per_device:,.0f} tokens/s per GPU ({gap:+.0%} of published), "
              f"step {pred.step_time_s:.1f} s, MFU {pred.mfu:.1%}; memory "
              f"{est.total / 2**30:.1f} GiB at the peak ({est.reserved / 2**30:.1f} reserved), "
              f"{'fits' if est.fits else 'does NOT fit'} in 80 GB")
        _details(cfg, pred, est)


def _details(cfg, pred, est) -> None:
    if cfg.parallel.pp_schedule == "dualpipev":  # theory/dualpipev.py: pairs hide all-to-alls
        pp, m = cfg.parallel.pp, cfg.training.grad_accum_steps
        rank = pred.costed_rank
        print(f"  costed rank {rank}: {paired_forwards(pp, m, rank)} of its {2 * m} chunk "
              "forwards paired with a backward (their expert all-to-alls under the pair's "
              "compute)")
    else:
        print(f"  costed rank {pred.costed_rank}")
    for part, seconds in sorted(pred.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<14} {seconds:8.2f} s  {seconds / pred.step_time_s:6.1%}")
    top = sorted(est.activation_parts.items(), key=lambda kv: -kv[1])[:4]
    print("  activations: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in top))
    less = {k: v for k, v in est.activation_parts.items() if v < 0}  # the FP8 cache's saving
    if less:
        print("  less: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in less.items()))


if __name__ == "__main__":
    main()
