"""3D parallelism: dp 2 x tp 2 x pp 2 on 8 ranks against one process at the same global batch.

One 8-rank launch trains every configuration in turn (process start-up dominates on two cores).
Each pipeline stage is tensor parallel (with and without sequence parallel), the pipelines are
data parallel (plain, ZeRO-1, 2 and 3), and recomputation runs inside the split blocks. Parity: per-step
losses within 1e-5 relative over 10 steps and the gathered final weights within 1e-5. The bytes
sent between stages are those of the activations each tp rank holds: 1/tp of them under sequence
parallel, all of them (replicated on the tp ranks) without.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from distributed import run_ranks
from parity import assert_parity, make_config, shared, train_rank
from test_pipeline_parity import train_cases

STEPS = 10
M = 4  # micro-batches per pipeline (per data-parallel rank)

# (schedule, virtual stages, tied embeddings, sequence parallel, zero, recompute)
CASES = [
    ("1f1b", 1, True, False, 0, "none"),
    ("interleaved", 2, False, True, 1, "none"),
    ("1f1b", 1, False, True, 2, "full"),
    ("interleaved", 2, True, False, 0, "selective"),
    ("1f1b", 1, True, True, 3, "none"),
]


def _overrides(schedule: str, v: int, tied: bool, sp: bool, zero: int, recompute: str,
               ) -> list[str]:
    return [f"model.tie_embeddings={str(tied).lower()}", f"training.steps={STEPS}",
            f"training.grad_accum_steps={M}", f"training.recompute={recompute}",
            "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", f"parallel.zero={zero}",
            f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.pp_schedule={schedule}",
            f"parallel.pp_virtual_stages={v}"]


@shared
def _runs() -> dict[tuple, list[dict]]:
    dicts = [make_config(_overrides(*c)).model_dump(mode="json") for c in CASES]
    per_rank = run_ranks(8, train_cases, dicts, timeout=540.0)
    return {case: [per_rank[r][i] for r in range(8)] for i, case in enumerate(CASES)}


@lru_cache(maxsize=None)
def _reference(tied: bool) -> dict:
    """One process, no recomputation, the same 2 x M micro-batches a step."""
    cfg = make_config([f"model.tie_embeddings={str(tied).lower()}", f"training.steps={STEPS}",
                       f"training.grad_accum_steps={2 * M}"])
    return train_rank(cfg.model_dump(mode="json"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-v{c[1]}-{'tied' if c[2] else 'untied'}-"
                                             f"{'sp' if c[3] else 'nosp'}-zero{c[4]}-{c[5]}"
                                             for c in CASES])
def test_dp2_tp2_pp2_matches_one_process(case):
    schedule, v, tied, sp, zero, recompute = case
    results = _runs()[case]
    reference = _reference(tied)
    for r in results:
        assert_parity(reference, r)

    cfg = make_config(_overrides(*case))
    t, mc = cfg.training, cfg.model
    activation = t.micro_batch_size * t.seq_len * mc.hidden_size * 4 // (2 if sp else 1)
    embed_shard = mc.vocab_size * mc.hidden_size * 4 // 2  # the tied embedding, split over tp
    boundaries = 2 * v - 1  # stage boundaries of one pipeline
    sent = sum(r["sent_bytes"] for r in results)
    # 2 pipelines x 2 tp ranks, each moving one activation and one gradient per micro-batch per
    # boundary, plus the tied embedding's gradient shards swapped between first and last stage.
    per_tp_rank = 2 * M * boundaries * activation + (2 * embed_shard if tied else 0)
    assert sent == STEPS * 2 * 2 * per_tp_rank
    assert sum(r["received_bytes"] for r in results) == sent


def test_zero_bubble_with_tensor_parallel_is_accepted():
    """Its deferred weight gradients cover the tensor-parallel matmuls (parity:
    tests/test_pipeline_dualpipev.py)."""
    from ultrascale.parallel.support import check_supported

    check_supported(make_config(_overrides("zero_bubble", 1, True, True, 0, "none")))
    check_supported(make_config(_overrides("1f1b", 1, True, True, 1, "full")))


@pytest.mark.slow
def test_tp2_pp2_resumes_exactly(tmp_path):
    """Each rank checkpoints its own stage's tp shards and optimizer state; a run resumed from
    step 3 logs the uninterrupted run's losses and ends with the same weights, bit for bit."""
    import shutil

    from parity import run_layout

    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
              "training.grad_accum_steps=2", "training.steps=6", f"checkpoint.dir={tmp_path}",
              "checkpoint.every=3"]
    full = run_layout(layout)
    shutil.rmtree(tmp_path / "step_00000006")  # resume=auto then starts from step 3
    resumed = run_layout(layout + ["checkpoint.resume=auto"])
    for f, r in zip(full, resumed):
        assert r["losses"] == f["losses"][3:]
        for name, t in f["state"].items():
            assert r["state"][name].equal(t), name
