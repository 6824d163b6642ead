"""Tiny random Hugging Face models built from a config (nothing downloaded), saved with
save_pretrained, and the rank function that imports one into a layout and returns its logits.

The shapes exercise what differs between the architectures: Llama with Llama 3.1's rope scaling,
tied embeddings and a vocabulary tp does not divide (padding); Qwen2's q/k/v biases; Qwen3's q/k
norms with a head_dim that is not hidden/heads and one kv head (so tp keeps the kv weights whole);
Mistral's sliding window (wider than the sequence). The mixtures of experts (`moe_configs`), four
experts each so that ep2 splits them: Mixtral top-2 and top-1 (its router renormalises even one
weight), Qwen3-MoE with its first layer dense and norm_topk_prob on, Qwen2-MoE with its gated shared
expert (two experts wide) and norm_topk_prob off. Every weight is random, norms and biases too, so
that a tensor put in the wrong place shows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ultrascale.parallel.tensor import TensorParallelPlan

SEQ = 16
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=259, max_position_embeddings=64,
              rms_norm_eps=1e-6)


def configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=rope),
        "qwen2": Qwen2Config(**COMMON),
        "qwen3": Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=24),
        "mistral": MistralConfig(**COMMON, sliding_window=32),
    }


def moe_configs():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "mixtral": MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "mixtral-top1": MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=1),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, **moe, num_experts=4, head_dim=24,
                                    norm_topk_prob=True, mlp_only_layers=[0]),
        "qwen2_moe": Qwen2MoeConfig(**COMMON, **moe, num_experts=4, norm_topk_prob=False,
                                    shared_expert_intermediate_size=64),
    }


def randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_((0.1 if name.endswith("bias") else 0.05) * noise)


def save_models(root: Path, chosen: dict | None = None) -> dict[str, Path]:
    """Each architecture's tiny random model (of `configs()`, or `chosen`) saved under
    root/<name>; returns the folders."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate((chosen or configs()).items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        randomize(model, i)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


def ours(folder: Path, tokens: torch.Tensor):
    """The model imported from `folder` into one process: (its config, its logits on `tokens`)."""
    from ultrascale.checkpoint.hf import load_pretrained
    from ultrascale.config import build_config
    from ultrascale.models.llama import Llama

    cfg = build_config({"model": {"from_hf": str(folder)}, "training": {"seq_len": 16}})
    model = Llama(cfg.model)
    assert load_pretrained(model, folder) == len(model.state_dict())
    with torch.no_grad():
        return cfg, model(tokens)


def tokens(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (batch, SEQ),
                         generator=torch.Generator().manual_seed(seed))


def layout_config(folder: Path, overrides: dict | None = None) -> dict:
    from ultrascale.config import build_config

    data = {"model": {"from_hf": str(folder)},
            "training": {"seq_len": SEQ, "micro_batch_size": 2, "steps": 5, "lr": 1e-3,
                         "warmup_steps": 0},
            "parallel": {"dp": 1, **(overrides or {})},
            "logging": {"progress": False, "sample_tokens": 0},
            "device": "cpu", "precision": {"dtype": "fp32"}}
    return build_config(data).model_dump(mode="json")


class CaptureLogits(torch.nn.Module):
    """A criterion that records the logits the head makes (this rank's vocabulary columns under
    tp), then computes the loss as the one it wraps: test instrumentation through the model's
    own `criterion` seam."""

    def __init__(self, inner, seen: list):
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, hidden, weight, targets):
        from ultrascale.models import ops
        self.seen.append(ops.linear(hidden, weight).detach().clone())
        return self.inner(hidden, weight, targets)


def import_and_logits(configs_by_name: dict[str, dict], inputs: torch.Tensor) -> dict:
    """In each rank: import every model into the layout, run a forward-only pass through the
    layout's runtime (the pipeline's evaluate, tensor-parallel collectives, ZeRO-3 gathers), and
    return this rank's logits with where they sit, and the gathered weights."""
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    out = {}
    for name, data in configs_by_name.items():
        cfg = Config.model_validate(data)
        ctx = init_parallel(cfg)
        comm.set_context(ctx)
        comm.stats.reset()
        rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg,
                         pretrained=cfg.model.from_hf)
        setup = comm.stats.summary()  # the import reads files: it sends nothing between ranks
        rt.build_optimizer(1e-3, (0.9, 0.95), 0.0)
        seen: list = []
        if rt.module.norm is not None:  # the last pipeline stage holds the head
            rt.module.criterion = CaptureLogits(rt.module.criterion, seen)
        comm.stats.reset()
        rt.evaluate([(inputs, torch.zeros_like(inputs))])
        sent, received = comm.stats.total("send", "pp"), comm.stats.total("recv", "pp")
        plan = next((p for p in rt.parts if isinstance(p, TensorParallelPlan)), None)
        vocab = plan.vocab if plan is not None else None
        out[name] = {"logits": seen[0] if seen else None, "tp": ctx.coord("tp"),
                     "valid": vocab.valid if vocab else None, "state": rt.full_state_dict(),
                     "pp_sent": sent, "pp_received": received, "setup_comm": setup}
    return out


def assemble(results: list[dict], name: str) -> list[torch.Tensor]:
    """The full logits of each rank group holding the head: the tp ranks' vocabulary columns
    side by side (padding dropped)."""
    holders = [r[name] for r in results if r[name]["logits"] is not None]
    groups: dict[int, list] = {}
    for i, r in enumerate(holders):  # consecutive tp ranks of one (dp, pp) place
        groups.setdefault(i - r["tp"], []).append(r)
    out = []
    for members in groups.values():
        members.sort(key=lambda r: r["tp"])
        if members[0]["valid"] is None:
            out.append(members[0]["logits"])
        else:
            out.append(torch.cat([r["logits"][..., :r["valid"]] for r in members], dim=-1))
    return out
