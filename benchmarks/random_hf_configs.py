"""Random Hugging Face decoder configs against transformers, to find what the fixed ones miss.

    python benchmarks/random_hf_configs.py --seed 1 --count 40
    python benchmarks/random_hf_configs.py --smoke          # one config (CI)

Each draw builds a tiny random model from a config (Llama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or V2: widths, heads and key/value heads, head_dim, tied
embeddings, rope scalings (linear, llama3, YaRN with and without its attention factor and
rounding), sliding windows, experts, routing, MLA ranks; nothing downloaded), saves it, imports
it into one process (`model.from_hf`) and compares our logits with transformers' (OK within
1e-4), then exports it back (`export --to-hf`) and compares transformers' logits of the export.
A config we refuse is listed with our reason (REFUSED: each must name a feature our model does
not have); a crash or a difference is FAILED or MISMATCH.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

TOLERANCE = 1e-4


def _rope(r: random.Random) -> dict:
    kind, theta = r.choice(["default", "llama3", "yarn", "yarn", "linear"]), r.choice([1e4, 5e5])
    if kind == "llama3":
        return {"rope_type": kind, "rope_theta": theta, "factor": r.choice([2.0, 8.0]),
                "low_freq_factor": 1.0, "high_freq_factor": r.choice([2.0, 4.0]),
                "original_max_position_embeddings": r.choice([8, 16, 32])}
    if kind == "yarn":
        extra = {"attention_factor": r.choice([0.9, 1.2])} if r.random() < 0.3 else {}
        extra.update({"truncate": False} if r.random() < 0.3 else {})
        return {"rope_type": kind, "rope_theta": theta, "factor": r.choice([2.0, 4.0]),
                "original_max_position_embeddings": r.choice([8, 16, 32, 1024]), **extra}
    return {"rope_type": kind, "rope_theta": theta,
            **({"factor": 2.0} if kind == "linear" else {})}


def _common(r: random.Random, heads: tuple[int, ...]) -> dict:
    h = r.choice(heads)
    return dict(hidden_size=r.choice([32, 64]), intermediate_size=r.choice([48, 96]),
                num_hidden_layers=r.choice([1, 2, 3]), num_attention_heads=h,
                num_key_value_heads=r.choice([k for k in (1, 2, 4, 8) if h % k == 0]),
                vocab_size=r.choice([97, 259]), max_position_embeddings=64, rms_norm_eps=1e-6,
                tie_word_embeddings=r.random() < 0.4, rope_parameters=_rope(r))


def draw(r: random.Random):
    """(class name, a transformers config) at random."""
    import transformers as t
    name = r.choice(["Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen2Moe", "Qwen3Moe",
                     "DeepseekV3", "DeepseekV2"])
    c = _common(r, (2, 4, 8))
    window = {"use_sliding_window": True, "sliding_window": r.choice([4, 8]),
              "max_window_layers": r.choice([0, 1])} if r.random() < 0.3 else {}
    experts = r.choice([2, 4, 8])
    routed = dict(num_experts=experts, num_experts_per_tok=r.choice([1, 2]),
                  moe_intermediate_size=16, norm_topk_prob=r.random() < 0.5)
    if name == "Llama":
        return name, t.LlamaConfig(**c, head_dim=r.choice([8, 16, 24]))
    if name == "Mistral":
        return name, t.MistralConfig(**c, sliding_window=r.choice([None, 4, 64]))
    if name in ("Qwen2", "Qwen3"):
        extra = {"head_dim": r.choice([8, 24])} if name == "Qwen3" else {}
        return name, getattr(t, f"{name}Config")(**c, **window, **extra)
    if name == "Mixtral":
        # head_dim given: transformers' YaRN reads it and MixtralConfig leaves it None.
        return name, t.MixtralConfig(**c, num_local_experts=experts,
                                     head_dim=c["hidden_size"] // c["num_attention_heads"],
                                     num_experts_per_tok=r.choice([1, 2]))
    if name == "Qwen2Moe":
        return name, t.Qwen2MoeConfig(**c, **routed, shared_expert_intermediate_size=32)
    if name == "Qwen3Moe":
        return name, t.Qwen3MoeConfig(**c, **routed, head_dim=16,
                                      mlp_only_layers=r.choice([[], [0]]))
    mla = dict(kv_lora_rank=r.choice([8, 16]), qk_rope_head_dim=r.choice([4, 8]),
               qk_nope_head_dim=8, v_head_dim=r.choice([8, 16]),
               q_lora_rank=r.choice([None, 16]), n_routed_experts=experts,
               n_shared_experts=1, first_k_dense_replace=r.choice([0, 1]),
               routed_scaling_factor=r.choice([1.0, 2.5]), moe_intermediate_size=16,
               num_experts_per_tok=2, n_group=1, topk_group=1)
    c = {k: v for k, v in c.items() if k not in ("num_key_value_heads", "rope_parameters")}
    return name, getattr(t, f"{name}Config")(**c, **mla)


def _randomize(model, seed: int) -> None:
    """Every weight random, norms around 1: a tensor put in the wrong place shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.05 * noise)


def _logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(tokens).logits


def check(name: str, cfg, folder: Path, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    from ultrascale.checkpoint.hf import export_hf, load_pretrained
    from ultrascale.config import ConfigError, build_config
    from ultrascale.models.llama import Llama

    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.save_pretrained(folder / "in")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(seed))
    want = _logits_of(folder / "in", tokens)
    try:
        ours = build_config({"model": {"from_hf": str(folder / "in")},
                             "training": {"seq_len": 16}})
    except ConfigError as exc:
        return f"REFUSED {name}: {str(exc).splitlines()[0][:200]}"
    net = Llama(ours.model)
    load_pretrained(net, folder / "in")
    with torch.no_grad():
        diff = (net(tokens) - want).abs().max().item()
    back = export_hf(ours, net.state_dict(), folder / "out")
    diff_back = (_logits_of(back, tokens) - want).abs().max().item()
    ok = max(diff, diff_back) <= TOLERANCE
    return f"{'OK' if ok else 'MISMATCH'} {name}: logits {diff:.1e}, exported {diff_back:.1e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="one config")
    args = ap.parse_args()
    r, lines = random.Random(args.seed), []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1 if args.smoke else args.count):
            name, cfg = draw(r)
            try:
                lines.append(check(name, cfg, Path(tmp) / str(i), args.seed * 1000 + i))
            except Exception as exc:  # a crash is a finding: report it, go on
                lines.append(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:200]}")
            print(lines[-1], flush=True)
    ok = sum(x.startswith("OK") for x in lines)
    refused = sum(x.startswith("REFUSED") for x in lines)
    print(f"{ok} of {len(lines)} configs OK, {refused} refused")
    return 0 if ok + refused == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
