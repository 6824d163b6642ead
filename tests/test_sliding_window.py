"""Attention over a sliding window shorter than the sequence (`model.sliding_window`): its
definition against transformers' Mistral is tests/test_hf.py's; here the layouts that run it
against one process at the same global batch, fp32, in one spawn of two ranks: tp2 with sequence
parallel, pp2 (1F1B), cp2 with Ulysses (each rank attends over whole sequences for its heads),
Ulysses with packed documents (a query sees its document's keys inside the window), ring cp
(balanced: blocks outside every window skipped, the rest cut to it) and all-gather cp with packed
documents, unbalanced; and multi-head latent attention (tiny-deepseek) under tp2 with sequence
parallel and ring cp; and a window over some layers only (`model.sliding_window_layers`) under pp2
and ring cp. The block plans' own check, piece by piece against attention under the
window and documents: tests/test_document_mask.py. 3 steps:
per-step losses and gradient norms within 1e-5 relative, the first step's gradients within 1e-5
of each tensor's largest (the bounds and their reasons: tests/test_document_mask_parity.py). The
window is 16 of 64 tokens, so three quarters of the queries lose keys to it; the run without the
window differs from it by far more than these bounds (checked)."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from distributed import run_ranks
from parity import make_config, train_rank
from test_document_mask_parity import (MASKED, STEPS, _assert_grads, _assert_trains_alike,
                                       _gathered, _run_cases, first_step, short_documents)

WINDOW = ["model.sliding_window=16", "training.seq_len=64"]
MLA = "model.preset=tiny-deepseek"  # multi-head latent attention (and its experts)
SOME = "model.sliding_window_layers=[1,3]"  # of 4: full attention on layers 0 and 2
CASES = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "training.grad_accum_steps=4"],
    "cp2-ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "cp2-ulysses-documents": ["parallel.cp=2", "parallel.cp_mode=ulysses", "documents"],
    "cp2-ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp2-all-gather-unbalanced-documents": ["parallel.cp=2", "parallel.cp_mode=all_gather",
                                            "parallel.cp_load_balance=false", "documents"],
    "mla-tp2-sp": [MLA, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "mla-cp2-ring": [MLA, "parallel.cp=2", "parallel.cp_mode=ring"],
    "some-layers-pp2": [SOME, "parallel.pp=2", "parallel.pp_schedule=1f1b",
                        "training.grad_accum_steps=4"],
    "some-layers-cp2-ring": [SOME, "parallel.cp=2", "parallel.cp_mode=ring"],
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = short_documents(tmp_path_factory.mktemp("window") / "docs.jsonl")
    return (f"data.source={path}",) + tuple(MASKED)


def _overrides(layout: list[str], documents: tuple) -> list[str]:
    extra = list(documents) if "documents" in layout else []
    return WINDOW + extra + [x for x in layout if x != "documents"]


@lru_cache(maxsize=None)
def _spawn(documents: tuple) -> dict[str, list]:
    names, cases = [], []
    for name, layout in CASES.items():
        over = _overrides(layout, documents)
        names += [name, f"grads-{name}"]
        cases += [("train", make_config(over + STEPS).model_dump(mode="json")),
                  ("grads", make_config(over).model_dump(mode="json"))]
    per_rank = run_ranks(2, _run_cases, cases, timeout=900.0)
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


@lru_cache(maxsize=None)
def _one_process(overrides: tuple, accum: int, kind: str) -> dict:
    one = make_config(list(overrides) + [f"training.grad_accum_steps={accum}"]
                      + (STEPS if kind == "train" else []))
    return (train_rank if kind == "train" else first_step)(one.model_dump(mode="json"))


def _reference(layout: list[str], documents: tuple, kind: str) -> dict:
    over = [x for x in _overrides(layout, documents) if not x.startswith("parallel.")
            and not x.startswith("training.grad_accum")]
    cfg = make_config(_overrides(layout, documents))
    return _one_process(tuple(over), cfg.global_batch_size // cfg.training.micro_batch_size, kind)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_sliding_window_trains_like_one_process(name, documents):
    runs = _spawn(documents)
    _assert_trains_alike(_reference(CASES[name], documents, "train"), runs[name])
    _assert_grads(_gathered(runs[f"grads-{name}"]),
                  _reference(CASES[name], documents, "grads")["grads"], 1e-5)


@pytest.mark.parametrize("model", [(), (MLA,), (SOME,)], ids=["gqa", "mla", "some-layers"])
def test_the_window_changes_the_run(model):
    """Without the window the same run's losses move by more than 1e-3 relative: the bounds
    above would see a layout that dropped it."""
    windowed = _one_process(tuple(WINDOW) + model, 2, "train")["losses"]
    full = _one_process(("training.seq_len=64",) + tuple(m for m in model if m != SOME), 2,
                        "train")["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(windowed[1:], full[1:])) > 1e-3
    assert torch.tensor(windowed).isfinite().all()


def test_the_cost_model_counts_the_windows_keys():
    """The attention core's FLOPs count the keys each query sees (theory/attention.py): half the
    sequence without a window; with a window of w the sum over queries of min(i + 1, w), counted
    here query by query; the planner's predicted attention time falls with it."""
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware
    from ultrascale.theory.attention import visible_keys

    seq, window = 4096, 1024
    assert visible_keys(seq, None) == visible_keys(seq, seq) == seq / 2
    assert visible_keys(seq, window) == pytest.approx(
        sum(min(i + 1, window) for i in range(seq)) / seq)
    base = make_config(["model.preset=llama3-8b", f"training.seq_len={seq}", "parallel.dp=8"])
    windowed = make_config(["model.preset=llama3-8b", f"training.seq_len={seq}",
                            "parallel.dp=8", f"model.sliding_window={window}"])
    hw = get_hardware("h100")
    full = predict(base.model, base.layout(), hw).breakdown["attention"]
    slid = predict(windowed.model, windowed.layout(), hw).breakdown["attention"]
    assert slid == pytest.approx(full * visible_keys(seq, window) / (seq / 2), rel=1e-6)
    # Over half the layers: the average of the two.
    half = make_config(["model.preset=llama3-8b", f"training.seq_len={seq}", "parallel.dp=8",
                        f"model.sliding_window={window}",
                        "model.sliding_window_layers=[" + ",".join(
                            str(i) for i in range(0, base.model.num_layers, 2)) + "]"])
    some = predict(half.model, half.layout(), hw).breakdown["attention"]
    assert some == pytest.approx((full + slid) / 2, rel=1e-6)
