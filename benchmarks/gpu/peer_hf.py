"""The Hugging Face reference step, the peer our 1B step is held against on the same GPU in the same
run (benchmarks/gpu/run.py): transformers' `LlamaForCausalLM` of Llama 3.2 1B's shape (hidden
2048, 16 layers, 32 heads, 8 kv heads, ffn 8192, vocabulary 128256, tied, rope theta 5e5, SDPA
attention), fp32 parameters under `torch.autocast(bf16)`, `torch.compile(model)` (its loss, given
`labels`, inside the compiled forward), `AdamW(fused=True)` with our decay groups (matrices
decayed, norms not), `clip_grad_norm_(1.0, foreach=True)`; random tokens, 4 x 2048 a step.

Timed as ours is (training_checks.py): windows of W steps with one device sync at each window's
end; the first step and the first window dropped, the median of the rest; MFU by our formula
(`ModelConfig.flops_per_token`, the same shape) against the bf16 peak.

    python benchmarks/gpu/peer_hf.py --json OUT [--smoke]   # --smoke: tiny, CPU, not compiled
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WINDOW, WINDOWS = 5, 3


def build(smoke: bool, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8) \
        if not smoke else dict(vocab_size=300, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    cfg = LlamaConfig(**shape, rope_theta=500000.0, tie_word_embeddings=True,
                      max_position_embeddings=4096, rms_norm_eps=1e-5,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device)  # fp32 parameters: autocast computes in bf16
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)
    return model, adam, shape


def flops_per_token(shape: dict, seq: int) -> float:
    """Our formula for this shape (ultrascale's ModelConfig), so the two MFUs compare."""
    from ultrascale.config import build_config

    cfg = build_config({"model": {"preset": None, "hidden_size": shape["hidden_size"],
                                  "num_layers": shape["num_hidden_layers"],
                                  "num_heads": shape["num_attention_heads"],
                                  "num_kv_heads": shape["num_key_value_heads"],
                                  "ffn_hidden_size": shape["intermediate_size"],
                                  "vocab_size": shape["vocab_size"], "tie_embeddings": True}}, [])
    return cfg.model.flops_per_token(seq)


def run(smoke: bool) -> dict:
    device = torch.device("cpu" if smoke else "cuda")
    batch, seq = (2, 16) if smoke else (4, 2048)
    model, adam, shape = build(smoke, device)
    forward = model if smoke else torch.compile(model)
    g = torch.Generator(device=device).manual_seed(0)

    def step():
        tokens = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        adam.step()
        adam.zero_grad(set_to_none=True)
        return loss

    window = 2 if smoke else WINDOW
    step()  # step 1: compilation
    rates = []
    for _ in range(WINDOWS):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(window):
            loss = step()
        _sync(device)
        rates.append(batch * seq * window / (time.perf_counter() - t0))
    tps = statistics.median(rates[1:])
    peak = _bf16_peak()
    fpt = flops_per_token(shape, seq)
    return {"available": True, "peer": "hf", "tokens_per_s": tps, "windows_tokens_per_s": rates,
            "mfu": tps * fpt / peak if peak else None, "flops_per_token": fpt,
            "final_loss": float(loss.detach()),
            "parameters": sum(p.numel() for p in model.parameters()),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if not smoke else None,
            "transformers": __import__("transformers").__version__}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _bf16_peak() -> float | None:
    from ultrascale.devices import device_peak_flops

    return device_peak_flops(torch.cuda.get_device_name(), "bf16") \
        if torch.cuda.is_available() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    Path(args.json).write_text(json.dumps(run(args.smoke), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
