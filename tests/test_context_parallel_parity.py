"""Context parallel on gloo ranks against one process at the same global batch, fp32, for every mode
at cp 2 and 4, balanced and not, with fewer kv heads than cp, composed with dp and ZeRO 1/2/3,
hybrid sharding, tp with sequence parallel, pp (1F1B, zero bubble), recompute and dp2 x tp2 x cp2
on 8 ranks:

- 10 training steps: per-step losses within 1e-5 relative, final weights within 1e-4 (as the
  tensor-parallel tests: cp splits every weight gradient's sum over tokens between ranks, and
  AdamW's division by sqrt(v) + eps amplifies the summation-order round-off of an element whose
  gradient is near zero: a few elements of 8192 end 1.2-1.4e-5 apart after 10 steps);
- the gradient of every weight after one forward/backward, within 1e-5 of the tensor's scale
  (measured: 4e-7);
- the bytes each mode moves per layer and micro-batch, counted by distributed/comm.py, against the
  theory.

Layouts of one world size share one spawn (`_run_cases` runs them one after the other in the same
process group): three spawns in all.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from distributed import run_ranks
from parity import TINY, assert_parity, make_config, shared, train_rank
from ultrascale.theory.context import cp_layer_transfers
from ultrascale.theory.shape import Shape, model_shape
from ultrascale.theory.terms import attention_of

# The tiny parity model (tests/parity.py): 4 layers, 4 heads, 2 kv heads of 16, seq_len 32,
# micro-batch 2. Its 2 kv heads are fewer than cp=4 (ring, all_gather; Ulysses replicates them).
BALANCE_OFF = "parallel.cp_load_balance=false"
CASES = {
    2: {
        "cp2-ring": ["parallel.cp=2"],
        "cp2-all_gather": ["parallel.cp=2", "parallel.cp_mode=all_gather"],
        "cp2-ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
        "cp2-ring-unbalanced": ["parallel.cp=2", BALANCE_OFF],
        "cp2-all_gather-unbalanced": ["parallel.cp=2", "parallel.cp_mode=all_gather",
                                      BALANCE_OFF],
        "cp2-ulysses-unbalanced": ["parallel.cp=2", "parallel.cp_mode=ulysses", BALANCE_OFF],
        "cp2-ring-selective": ["parallel.cp=2", "training.recompute=selective"],
        "cp2-all_gather-full-kv1": ["parallel.cp=2", "parallel.cp_mode=all_gather",
                                    "training.recompute=full", "model.num_kv_heads=1"],
    },
    4: {
        "cp4-ring": ["parallel.cp=4"],
        "cp4-all_gather": ["parallel.cp=4", "parallel.cp_mode=all_gather"],
        "cp4-ulysses": ["parallel.cp=4", "parallel.cp_mode=ulysses"],
        "cp4-ring-unbalanced": ["parallel.cp=4", BALANCE_OFF],
        "cp4-ulysses-unbalanced": ["parallel.cp=4", "parallel.cp_mode=ulysses", BALANCE_OFF],
        "dp2-cp2-zero1": ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1"],
        "dp2-cp2-zero3-all_gather": ["parallel.dp=2", "parallel.cp=2", "parallel.zero=3",
                                     "parallel.cp_mode=all_gather"],
        "dp2-hybrid-cp2-zero2": ["parallel.dp=2", "parallel.dp_shard=1", "parallel.cp=2",
                                 "parallel.zero=2"],
        "tp2-sp-cp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"],
        "tp2-sp-cp2-ulysses": ["parallel.tp=2", "parallel.sequence_parallel=true",
                               "parallel.cp=2", "parallel.cp_mode=ulysses",
                               "training.seq_len=64"],
        "pp2-cp2-1f1b": ["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule=1f1b",
                         "training.grad_accum_steps=4"],
        "pp2-cp2-zero_bubble": ["parallel.pp=2", "parallel.cp=2",
                                "parallel.pp_schedule=zero_bubble", "training.grad_accum_steps=4"],
    },
    8: {
        "dp2-tp2-cp2": ["parallel.dp=2", "parallel.tp=2", "parallel.cp=2",
                        "parallel.sequence_parallel=true", "parallel.zero=1"],
    },
}
# Bytes per layer and micro-batch: one step of two micro-batches, every collective recorded. The
# tiny model in every mode at cp 2 and 4 (and under the two recompute policies that rerun the
# attention core, whose forward transfers then run twice); at cp 2 `tiny-deepseek`, whose
# multi-head latent attention has queries and keys of 4 x 24 per token and values and output of
# 4 x 16, in every mode (and once without its query low-rank projection).
MODES = ["ring", "all_gather", "ulysses"]
MLA_BASE = {**TINY, "model": {"preset": "tiny-deepseek"}}
BYTES = {
    2: {**{m: (TINY, [f"parallel.cp_mode={m}"]) for m in MODES},
        "ring-selective": (TINY, ["training.recompute=selective"]),
        "ulysses-full": (TINY, ["parallel.cp_mode=ulysses", "training.recompute=full"]),
        **{f"mla-{m}": (MLA_BASE, [f"parallel.cp_mode={m}"]) for m in MODES},
        "mla-ulysses-no_q_lora": (MLA_BASE, ["parallel.cp_mode=ulysses",
                                             "model.q_lora_rank=0"])},
    4: {m: (TINY, [f"parallel.cp_mode={m}"]) for m in MODES},
}
BYTES_OVERRIDES = ["training.steps=1", "training.warmup_steps=0", "training.grad_accum_steps=2"]


def _bytes_config(cp: int, name: str):
    base, overrides = BYTES[cp][name]
    return make_config([f"parallel.cp={cp}"] + overrides + BYTES_OVERRIDES, base=base)


def _grad_rank(data: dict) -> dict:
    """One forward/backward of a fixed global batch (this dp rank's share of it); the full
    gradient of every weight this rank holds, by plain name (gathered over tp)."""
    import torch

    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = Config.model_validate(data)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    t = cfg.training
    rt = parallelize(build_model(cfg.model, t.seed), ctx, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.parallel.dp, t.grad_accum_steps,
                                                     t.micro_batch_size, t.seq_len + 1),
                           generator=torch.Generator().manual_seed(1234))
    micro = [(seq[:, :-1], seq[:, 1:]) for seq in tokens[ctx.coord("dp")]]
    rt.forward_backward(micro, 1.0 / tokens[..., 1:].numel())
    rt.finish_gradients()
    return rt.gather_full({n: p.grad for n, p in rt.named_parameters()})


def _run_cases(cases: list[tuple[str, dict]]) -> list[dict]:
    """In every rank: run each configuration ("parity": 10 steps, losses and final weights;
    "grads": one step's gradients; "bytes": the comm events of the cp view, by kind and tag)."""
    from ultrascale.distributed import comm

    out = []
    for kind, data in cases:
        if kind == "parity":
            out.append(train_rank(data))
            continue
        if kind == "grads":
            out.append(_grad_rank(data))
            continue
        comm.stats.record_events = True
        start = len(comm.stats.events)
        try:
            with comm.counting() as traffic:
                train_rank(data)
        finally:
            comm.stats.record_events = False
        out.append({"events": [(e.kind, e.tag, e.bytes) for e in comm.stats.events[start:]
                               if e.dim == "cp"],
                    "wire": {k: (c.bytes, c.wire_bytes) for (k, d), c in traffic.counters.items()
                             if d == "cp"}})
    return out


# One step's gradients of every layout, without ZeRO (which only changes where they are kept, and
# keeps them sharded; its training parity is above).
GRAD_CASES = {world: list(cases) for world, cases in CASES.items()}
GRAD_OVERRIDES = ["training.grad_accum_steps=2"]


def _grad_config(overrides: list[str]):
    return make_config([o for o in overrides if not o.startswith("parallel.zero=")]
                       + GRAD_OVERRIDES)


@shared
def _spawn(world: int) -> dict[str, list]:
    names = list(CASES[world])
    cases = [("parity", make_config(CASES[world][n]).model_dump(mode="json")) for n in names]
    names += [f"grads-{n}" for n in GRAD_CASES[world]]
    cases += [("grads", _grad_config(CASES[world][n]).model_dump(mode="json"))
              for n in GRAD_CASES[world]]
    cp = world if world in BYTES else None
    if cp:
        names += [f"bytes-{n}" for n in BYTES[cp]]
        cases += [("bytes", _bytes_config(cp, n).model_dump(mode="json")) for n in BYTES[cp]]
    per_rank = run_ranks(world, _run_cases, cases, timeout=540.0)
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


@lru_cache(maxsize=None)
def _reference(global_batch: int, seq_len: int) -> dict:
    """One process, the same global batch (micro-batches of the tiny config's size)."""
    mbs = make_config([]).training.micro_batch_size
    return train_rank(make_config([f"training.grad_accum_steps={global_batch // mbs}",
                                   f"training.seq_len={seq_len}"]).model_dump(mode="json"))


def _reference_for(overrides: list[str]) -> dict:
    cfg = make_config(overrides)
    if cfg.model.num_kv_heads != make_config([]).model.num_kv_heads:
        return train_rank(make_config([f"model.num_kv_heads={cfg.model.num_kv_heads}"]
                                      ).model_dump(mode="json"))
    return _reference(cfg.global_batch_size, cfg.training.seq_len)


PARITY = [(world, name) for world in CASES for name in CASES[world]]


@pytest.mark.slow
@pytest.mark.parametrize("world,name", PARITY, ids=[n for _, n in PARITY])
def test_context_parallel_trains_like_one_process(world, name):
    results = _spawn(world)[name]
    reference = _reference_for(CASES[world][name])
    assert len(reference["losses"]) == 10
    for r in results:
        assert_parity(reference, r, rtol=1e-5, atol=1e-4)


GRADS = [(world, name) for world in GRAD_CASES for name in GRAD_CASES[world]]


@pytest.mark.slow
@pytest.mark.parametrize("world,name", GRADS, ids=[n for _, n in GRADS])
def test_context_parallel_gradients_match_one_process(world, name):
    """Every weight's gradient after one step within 1e-5 of the tensor's scale. Pipeline ranks
    hold their stages' weights: together, every weight."""
    cfg = _grad_config(CASES[world][name])
    accum = cfg.global_batch_size // cfg.training.micro_batch_size
    ref = _grad_reference(accum, cfg.training.seq_len, cfg.model.num_kv_heads)
    got: dict = {}
    for rank in _spawn(world)[f"grads-{name}"]:
        for n, g in rank.items():
            if n in got:  # replicas (dp, cp, tp after the gather, tied copies) agree exactly
                assert torch.equal(got[n], g), n
            got[n] = g
    assert got.keys() == ref.keys()
    for n, g_ref in ref.items():
        scale = float(g_ref.abs().max())
        torch.testing.assert_close(got[n], g_ref, rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")


@lru_cache(maxsize=None)
def _grad_reference(accum: int, seq_len: int, kv_heads: int) -> dict:
    return _grad_rank(make_config([f"training.grad_accum_steps={accum}",
                                   f"training.seq_len={seq_len}",
                                   f"model.num_kv_heads={kv_heads}"]).model_dump(mode="json"))


def _theory(cfg) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, tag) -> (calls, bytes of each) in one step: the theory's transfers of one layer and
    micro-batch (theory/context.py) times the attention layers (each multi-token prediction
    module has one too) and the micro-batches."""
    m = model_shape(cfg.model)
    per_layer = cp_layer_transfers(cfg.layout(), Shape.of(m, cfg.layout()), attention_of(m))
    n = (m.num_layers + (cfg.model.mtp_layers or 0)) * cfg.training.grad_accum_steps
    return {key: (calls * n, nbytes) for key, (calls, nbytes) in per_layer.items()}


BYTE_CASES = [(cp, name) for cp in BYTES for name in BYTES[cp]]


@pytest.mark.slow
@pytest.mark.parametrize("cp,name", BYTE_CASES, ids=[f"cp{c}-{n}" for c, n in BYTE_CASES])
def test_counted_bytes_per_layer_and_micro_batch_equal_the_theory(cp, name):
    """Every transfer over the cp view, by kind and tag, calls and bytes (the payload: all-gather
    and reduce-scatter count the whole gathered buffer, of which a rank puts (cp-1)/cp on the
    wire), equal to the theory's (`theory.context.cp_layer_transfers`, which the planner's
    seconds price). Nothing else moves over cp but an MoE's balance statistics
    (tests/test_moe_context_parallel.py counts those)."""
    cfg = _bytes_config(cp, name)
    theory = _theory(cfg)
    if name.startswith("mla"):  # the widths that tell MLA apart really differ here
        m = model_shape(cfg.model)
        x, mla = Shape.of(m, cfg.layout()), attention_of(m)
        assert mla.name == "mla"
        assert (cfg.model.q_lora_rank == 0) == name.endswith("no_q_lora")
        assert mla.k_elements(x) != mla.v_elements(x)
        assert mla.q_elements(x) != mla.out_elements(x)
    for rank in _spawn(cp)[f"bytes-{name}"]:
        seen: dict[tuple[str, str], list[int]] = {}
        for kind, tag, nbytes in rank["events"]:
            if not tag.startswith("moe_"):
                seen.setdefault((kind, tag), []).append(nbytes)
        assert {key: (len(b), b[0]) for key, b in seen.items()} == theory
        assert all(len(set(b)) == 1 for b in seen.values())
        # On the wire: a shift sends its whole buffer; a collective (cp-1)/cp of it.
        attention_kinds = {kind for kind, _ in theory}
        for kind, (payload, wire) in rank["wire"].items():
            if kind not in attention_kinds:
                assert kind == "all_reduce" and cfg.model.num_experts  # the MoE's counts
                continue
            share = 1.0 if kind == "ring_shift" else (cp - 1) / cp
            assert wire == pytest.approx(share * payload), kind
