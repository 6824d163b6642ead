"""Shared pieces of the parity tests: a tiny config, a rank function that trains and reports, and
the comparison against one process.

Parity means: same seed, same global batch -> same per-step losses (1e-5 relative) and same final
weights, whatever the layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from distributed import run_ranks
from ultrascale.config import build_config

# A model small enough that 8 ranks on two cores finish 10 steps in seconds, with shapes that
# divide by 2 and 4 (heads, kv heads, ffn, layers) so every layout applies.
TINY = {
    "model": {"preset": None, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256,
              "tie_embeddings": True},
    "training": {"steps": 10, "seq_len": 32, "micro_batch_size": 2, "grad_accum_steps": 1,
                 "lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0},
    "parallel": {"dp": 1},
    "logging": {"progress": False, "sample_tokens": 0},
    "device": "cpu",
    "precision": {"dtype": "fp32"},
}


def make_config(overrides: list[str] = (), base: dict = TINY):
    return build_config(base, list(overrides))


def train_rank(config_dict: dict) -> dict:
    """Runs in each rank: train, return losses and (on every rank) the full final weights."""
    from ultrascale.config import Config
    from ultrascale.train.trainer import train

    cfg = Config.model_validate(config_dict)
    result = train(cfg, return_state=True, generate_sample=False)
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "state": result.final_state}


def run_layout(overrides: list[str]) -> list[dict]:
    cfg = make_config(overrides)
    data = cfg.model_dump(mode="json")
    if cfg.parallel.world_size == 1:
        return [train_rank(data)]
    return run_ranks(cfg.parallel.world_size, train_rank, data)


def assert_parity(reference: dict, result: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=0.0)
    assert reference["state"].keys() == result["state"].keys()
    for name, ref in reference["state"].items():
        torch.testing.assert_close(result["state"][name], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def assert_resumes_exactly(layout: list[str], checkpoints: Path) -> list[dict]:
    """Train `layout` for 6 steps saving every 3 into `checkpoints`, then resume from step 3 in
    the same layout: the resumed run's losses and final weights equal the uninterrupted run's
    bit for bit. Returns the uninterrupted run's results."""
    layout = layout + ["training.steps=6", f"checkpoint.dir={checkpoints}", "checkpoint.every=3"]
    full = run_layout(layout)
    assert (checkpoints / "step_00000003").is_dir()
    # The run ended at step 6 and wrote it; remove it so resume=auto starts from step 3.
    shutil.rmtree(checkpoints / "step_00000006")
    resumed = run_layout(layout + ["checkpoint.resume=auto"])
    for f, r in zip(full, resumed):
        assert r["losses"] == f["losses"][3:]
        for name, t in f["state"].items():
            assert r["state"][name].equal(t), name
    return full
