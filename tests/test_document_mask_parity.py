"""Document masking and the loss over the global batch's loss tokens on gloo ranks, against one
process at the same global batch, fp32, in one spawn of two ranks:

- packed short documents (`data.document_mask: true`, many boundaries per sequence) under cp2 in
  each mode (ring, all-gather, Ulysses), tp2 with sequence parallel, pp2 (1F1B), dp2, and dp2
  with compiled blocks (graphs counted, so that it is not eager in disguise): 3
  training steps, per-step losses and gradient norms within 1e-5 relative, and the first step's
  gradients within 1e-5 of each tensor's largest (cp, tp and pp split each weight gradient's sum
  over tokens between ranks: measured 4e-7). Final weights are not compared: AdamW moves an
  element whose gradient is round-off (near zero, its sign a coin toss) by up to lr either way,
  so they say nothing the gradients do not say better;
- chat data (uneven loss tokens per micro-batch) at dp2 x grad_accum 4 against one process at
  grad_accum 8: the loss and the first step's gradients within 1e-6. Each micro-batch's gradient
  is computed alike in both; only the order in which the 8 are added differs (4 + 4 and a sum
  over the ranks), a reassociated sum of 8 terms: a few eps32 (6e-8) of the largest, measured
  1.5e-7, while the micro-batches' loss tokens differ by more than 10% (normalising each by its
  own would move the gradients by as much).

(One process and recomputation: tests/test_document_mask.py.)
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

import pytest
import torch

import chat_data
from distributed import run_ranks
from parity import make_config, train_rank
from test_context_parallel_parity import BYTES_OVERRIDES, _theory

STEPS = ["training.steps=3", "training.warmup_steps=1"]
MASKED = ["data.document_mask=true"]
CASES = {
    "cp2-ring": ["parallel.cp=2"],
    "cp2-all_gather": ["parallel.cp=2", "parallel.cp_mode=all_gather"],
    "cp2-ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "training.grad_accum_steps=4"],
    "dp2": ["parallel.dp=2"],
    # Regional compilation: the masked core traced into each block's graph (documents are an
    # input of the compiled block, the mask built inside it).
    "dp2-compile": ["parallel.dp=2", "training.compile=true"],
}
CHAT_LAYOUT = ["parallel.dp=2", "training.grad_accum_steps=4"]
BYTE_MODES = ["ring", "all_gather"]


def short_documents(path, count: int = 600, seed: int = 0):
    """JSON lines of 1-9 words each: a 32-token sequence packs several documents."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            words = " ".join(rng.choice(chat_data.WORDS) for _ in range(rng.randint(1, 9)))
            f.write(json.dumps({"text": words}) + "\n")
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("docmask")
    return {"text": [f"data.source={short_documents(root / 'docs.jsonl')}"] + MASKED,
            "chat": ["data.format=chat", f"data.tokenizer={chat_data.tokenizer_folder(root / 'tok')}",
                     f"data.source={chat_data.conversations_file(root / 'chat.jsonl', 160)}",
                     "data.overlong=drop", "training.seq_len=64"]}


def first_step(data: dict) -> dict:
    """One forward/backward of the run's first global batch as the trainer takes it (this dp
    rank's micro-batches, the loss scale 1 / the global batch's loss tokens): the loss, the loss
    tokens of each micro-batch, and every gradient this rank holds, by plain name."""
    from ultrascale.config import Config
    from ultrascale.data.dataset import load_splits
    from ultrascale.data.sampler import GlobalBatchSampler
    from ultrascale.data.windows import IGNORE, micro_batch
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.documents import Documents
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = Config.model_validate(data)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    t = cfg.training
    dataset, _, _ = load_splits(cfg.data, t.seq_len, cfg.model.vocab_size)
    sampler = GlobalBatchSampler(len(dataset), t.seed)
    rt = parallelize(build_model(cfg.model, t.seed), ctx, cfg)
    micro, counts = [], []
    for idx in sampler.rank_micro_batches(0, cfg.global_batch_size, cfg.parallel.dp,
                                          ctx.coord("dp"), t.micro_batch_size):
        inputs, targets, starts = micro_batch([dataset.window(i) for i in idx])
        counts.append(int((targets != IGNORE).sum()))
        micro.append((torch.from_numpy(inputs), torch.from_numpy(targets),
                      None if starts is None else Documents.of(starts)))
    loss_tokens = dataset.loss_tokens(sampler.indices(0, cfg.global_batch_size))
    loss = rt.global_loss(rt.forward_backward(micro, 1.0 / loss_tokens)) / loss_tokens
    rt.finish_gradients()
    grads = rt.gather_full({n: p.grad for n, p in rt.named_parameters()})
    return {"loss": loss, "counts": counts, "loss_tokens": loss_tokens, "grads": grads}


def _counted(data: dict) -> dict:
    """The transfers over the cp view of a run, (kind, tag) -> sizes."""
    from ultrascale.distributed import comm

    comm.stats.record_events = True
    start = len(comm.stats.events)
    try:
        train_rank(data)
    finally:
        comm.stats.record_events = False
    seen: dict = {}
    for e in comm.stats.events[start:]:
        if e.dim == "cp":
            seen.setdefault((e.kind, e.tag), []).append(e.bytes)
    return {"events": seen}


def _run_cases(cases: list[tuple[str, dict]]) -> list[dict]:
    """In every rank: each case, with the graphs dynamo compiled meanwhile."""
    from torch._dynamo.utils import counters

    run = {"train": train_rank, "grads": first_step, "bytes": _counted}
    out = []
    for kind, data in cases:
        graphs = counters["stats"]["unique_graphs"]
        out.append(run[kind](data))
        out[-1]["graphs"] = counters["stats"]["unique_graphs"] - graphs
    return out


@lru_cache(maxsize=None)
def _spawn(text: tuple, chat: tuple) -> dict[str, list]:
    names, cases = [], []
    for name, layout in CASES.items():
        names += [name, f"grads-{name}"]
        cases += [("train", make_config(list(text) + layout + STEPS).model_dump(mode="json")),
                  ("grads", make_config(list(text) + layout).model_dump(mode="json"))]
    for mode in BYTE_MODES:
        names.append(f"bytes-{mode}")
        layout = ["parallel.cp=2", f"parallel.cp_mode={mode}"] + BYTES_OVERRIDES
        cases.append(("bytes", make_config(list(text) + layout).model_dump(mode="json")))
    names += ["chat-train", "chat-grads"]
    cases += [("train", make_config(list(chat) + CHAT_LAYOUT + STEPS).model_dump(mode="json")),
              ("grads", make_config(list(chat) + CHAT_LAYOUT).model_dump(mode="json"))]
    per_rank = run_ranks(2, _run_cases, cases, timeout=900.0)
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


def _one_process(overrides: list[str], layout: list[str], kind: str) -> dict:
    """One process at the layout's global batch: its micro-batches in gradient accumulation."""
    cfg = make_config(overrides + layout)
    return _one_process_at(tuple(overrides), cfg.global_batch_size // cfg.training.micro_batch_size,
                           kind)


@lru_cache(maxsize=None)
def _one_process_at(overrides: tuple, accum: int, kind: str) -> dict:
    one = make_config(list(overrides) + [f"training.grad_accum_steps={accum}"]
                      + (STEPS if kind == "train" else []))
    return (train_rank if kind == "train" else first_step)(one.model_dump(mode="json"))


def _gathered(ranks: list[dict]) -> dict[str, torch.Tensor]:
    got = {}
    for r in ranks:
        for n, g in r["grads"].items():
            if n in got:  # replicas (dp, cp, tp after the gather, tied copies) agree exactly
                assert torch.equal(got[n], g), n
            got[n] = g
    return got


def _assert_trains_alike(ref: dict, ranks: list[dict]) -> None:
    for r in ranks:
        for key in ("losses", "grad_norms"):
            torch.testing.assert_close(torch.tensor(r[key], dtype=torch.float64),
                                       torch.tensor(ref[key], dtype=torch.float64), rtol=1e-5,
                                       atol=0.0, msg=lambda m, k=key: f"{k}: {m}")


def _assert_grads(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=0.0, atol=rtol * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_packed_documents_train_like_one_process(name, sources):
    runs = _spawn(tuple(sources["text"]), tuple(sources["chat"]))
    _assert_trains_alike(_one_process(sources["text"], CASES[name], "train"), runs[name])
    compiled = "training.compile=true" in CASES[name]
    assert all((r["graphs"] > 0) == compiled for r in runs[name])
    want = _one_process(sources["text"], CASES[name], "grads")
    assert want["loss_tokens"] < make_config(sources["text"] + CASES[name]).global_batch_size * 32
    _assert_grads(_gathered(runs[f"grads-{name}"]), want["grads"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", BYTE_MODES)
def test_documents_move_the_bytes_of_plain_context_parallel(mode, sources):
    """The documents travel with the batch to every rank (no transfer); a block whose documents
    do not meet is skipped in compute, while K/V still go round: per layer and micro-batch the
    bytes of context parallel without documents (the theory of
    test_context_parallel_parity.py)."""
    runs = _spawn(tuple(sources["text"]), tuple(sources["chat"]))
    theory = _theory(make_config(list(sources["text"]) + ["parallel.cp=2",
                                                           f"parallel.cp_mode={mode}"]
                                 + BYTES_OVERRIDES))
    for rank in runs[f"bytes-{mode}"]:
        seen = rank["events"]
        assert {key: (len(b), b[0]) for key, b in seen.items()} == theory
        assert all(len(set(b)) == 1 for b in seen.values())


@pytest.mark.slow
def test_chat_dp2_accum4_gives_one_process_loss_and_gradients_with_uneven_loss_tokens(sources):
    runs = _spawn(tuple(sources["text"]), tuple(sources["chat"]))
    want = _one_process(sources["chat"], CHAT_LAYOUT, "grads")
    ranks = runs["chat-grads"]
    counts = [c for r in ranks for c in r["counts"]]
    assert counts == want["counts"] and max(counts) > 1.1 * min(counts)  # uneven, the same ones
    assert sum(counts) == want["loss_tokens"] == ranks[0]["loss_tokens"]
    for r in ranks:
        assert abs(r["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"])
    _assert_grads(_gathered(ranks), want["grads"], 1e-6)
    _assert_trains_alike(_one_process(sources["chat"], CHAT_LAYOUT, "train"), runs["chat-train"])
