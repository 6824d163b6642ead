"""Resharding: 6 steps in layout A, save, resume in layout B for 6 more; B's per-step losses and
final weights are within 1e-5 of 12 uninterrupted steps in A (fp32, CPU, the same global batch of
4 sequences). Every run of one world size shares one spawn (start-up dominates on two cores): the
A runs save at step 6 and go on to 12, which gives both the checkpoint and the reference."""

from __future__ import annotations

import json
import math

import pytest

from distributed import run_ranks
from parity import make_config, train_rank
from test_pipeline_parity import train_cases
from ultrascale.checkpoint.index import coverage_problems

STEPS, SAVE = 12, 6
EIGHT_LAYERS = ["model.num_layers=8", "model.hidden_size=32", "model.ffn_hidden_size=64"]
# Experts balanced by the aux-free bias: a buffer, saved beside the parameters.
EXPERTS = ["model.num_experts=4", "model.experts_top_k=2", "model.router=sigmoid",
           "model.balance=aux_free", "model.bias_update_rate=0.01"]

# name: (layout A, layout B); each keeps 4 sequences a step.
CASES = {
    "dp2->dp4": (["parallel.dp=2"], ["parallel.dp=4", "training.micro_batch_size=1"]),
    "dp2-zero1->tp2": (["parallel.dp=2", "parallel.zero=1", "parallel.bucket_mb=0.02"],
                       ["parallel.tp=2", "training.micro_batch_size=4"]),
    "dp2xtp2xpp2->dp1": (["parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                          "training.micro_batch_size=1", "training.grad_accum_steps=2"],
                         ["training.grad_accum_steps=2"]),
    "pp2->pp4-interleaved": (
        EIGHT_LAYERS + ["parallel.pp=2", "training.micro_batch_size=1",
                        "training.grad_accum_steps=4"],
        EIGHT_LAYERS + ["parallel.pp=4", "parallel.pp_schedule=interleaved",
                        "parallel.pp_virtual_stages=2", "training.micro_batch_size=1",
                        "training.grad_accum_steps=4"]),
    "dp4-zero3->dp2-zero1": (["parallel.dp=4", "parallel.zero=3", "training.micro_batch_size=1"],
                             ["parallel.dp=2", "parallel.zero=1"]),
    "ep2-moe->dp1": (EXPERTS + ["parallel.dp=2", "parallel.ep=2"],
                     EXPERTS + ["training.micro_batch_size=4"]),
}

# Who writes what of A's checkpoint: replicas write once (rank 0), ZeRO ranks each their shard.
SHARES = {"dp2->dp4": [1.0, 0.0], "dp2-zero1->tp2": [0.5, 0.5],
          "dp4-zero3->dp2-zero1": [0.25] * 4}


def _config(overrides: list[str], folder, resume: str = "none") -> dict:
    return make_config(overrides + [f"training.steps={STEPS}", f"checkpoint.dir={folder}",
                                    f"checkpoint.every={SAVE}", f"checkpoint.resume={resume}"]
                       ).model_dump(mode="json")


def _a(name: str, root) -> dict:
    return _config(CASES[name][0], root / name / "a")


def _b(name: str, root) -> dict:
    return _config(CASES[name][1], root / name / "b",
                   resume=str(root / name / "a" / f"step_{SAVE:08d}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """name -> (rank 0's report of the A run, of the B run, the case's folder); the runs go in
    the order the checkpoints need."""
    root = tmp_path_factory.mktemp("reshard")
    a, b = {}, {}
    two = run_ranks(2, train_cases, [_a("dp2->dp4", root), _a("dp2-zero1->tp2", root),
                                     _b("dp2-zero1->tp2", root), _a("pp2->pp4-interleaved", root),
                                     _a("ep2-moe->dp1", root)], timeout=540.0)[0]
    (a["dp2->dp4"], a["dp2-zero1->tp2"], b["dp2-zero1->tp2"], a["pp2->pp4-interleaved"],
     a["ep2-moe->dp1"]) = two
    four = run_ranks(4, train_cases, [_b("dp2->dp4", root), _b("pp2->pp4-interleaved", root),
                                      _a("dp4-zero3->dp2-zero1", root)], timeout=540.0)[0]
    b["dp2->dp4"], b["pp2->pp4-interleaved"], a["dp4-zero3->dp2-zero1"] = four
    (b["dp4-zero3->dp2-zero1"],) = run_ranks(2, train_cases, [_b("dp4-zero3->dp2-zero1", root)])[0]
    (a["dp2xtp2xpp2->dp1"],) = run_ranks(8, train_cases, [_a("dp2xtp2xpp2->dp1", root)],
                                          timeout=540.0)[0]
    b["dp2xtp2xpp2->dp1"] = train_rank(_b("dp2xtp2xpp2->dp1", root))
    b["ep2-moe->dp1"] = train_rank(_b("ep2-moe->dp1", root))
    return {name: (a[name], b[name], root / name) for name in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_resume_in_another_layout_continues_exactly(runs, name):
    import torch

    a, b, folder = runs[name]
    assert len(a["losses"]) == STEPS and len(b["losses"]) == STEPS - SAVE
    torch.testing.assert_close(torch.tensor(b["losses"], dtype=torch.float64),
                               torch.tensor(a["losses"][SAVE:], dtype=torch.float64),
                               rtol=1e-5, atol=0.0)
    assert a["state"].keys() == b["state"].keys()
    for key, ref in a["state"].items():
        torch.testing.assert_close(b["state"][key], ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=key: f"{k}: {m}")
    # Layout-free: the checkpoint B read was written by A's ranks, B's own by B's.
    for run, step, layout in (("a", SAVE, CASES[name][0]), ("b", STEPS, CASES[name][1])):
        meta = json.loads((folder / run / f"step_{step:08d}" / "meta.json").read_text())
        cfg = make_config(layout)
        assert meta["world_size"] == cfg.parallel.world_size
        # Every tensor's value and Adam moments tiled exactly once, whoever wrote them: the
        # pieces hold 3 x 4 bytes per parameter, plus one step count per parameter; a buffer (the
        # experts' bias: one value per expert and layer) its value only.
        assert coverage_problems(meta) == []
        buffers = {n: e for n, e in meta["tensors"].items() if "exp_avg" not in e["states"]}
        assert set(buffers) == ({f"layers.{i}.mlp.gate.expert_bias" for i in range(4)}
                                if cfg.model.num_experts else set())
        elements = {"param": -sum(math.prod(e["shape"]) for e in buffers.values())}
        for entry in meta["tensors"].values():
            for state, pieces in entry["states"].items():
                elements[state] = elements.get(state, 0) + sum(
                    math.prod(p["shape"]) for p in pieces)
        n = cfg.model.num_params()
        assert elements == {"param": n, "exp_avg": n, "exp_avg_sq": n,
                            "step": len(meta["tensors"]) - len(buffers)}
        if run == "a" and name in SHARES:
            per_file = dict.fromkeys(meta["files"], 0)
            for entry in meta["tensors"].values():
                for pieces in entry["states"].values():
                    for p in pieces:
                        per_file[p["file"]] += math.prod(p["shape"])
            shares = [per_file[f] / sum(per_file.values()) for f in sorted(per_file)]
            assert shares == pytest.approx(SHARES[name], abs=0.01)
