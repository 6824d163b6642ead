"""Tensor parallel, measured: the collectives of one block (count and bytes), the activation bytes a
block saves for backward, and the overlap of the input-gradient reduction with the weight-gradient
matmuls. One set of spawned ranks runs every probe; the tests check what it returns."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from distributed import run_ranks
from parity import make_config

TP = 2
BATCH, SEQ = 2, 32


def _saved_bytes(fn, weights):
    """Run `fn`; return its result and the bytes of activations autograd kept for backward (each
    storage once; the weights, and views of them, are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in weights}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def _block_input(hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, SEQ, hidden, generator=gen)


def _probe_rank(config_dict: dict) -> dict:
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.tensor import apply_tensor_parallel
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = Config.model_validate(config_dict)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    comm.stats.record_events = True
    out = {}
    from ultrascale.models import ops
    # The rotary tables a forward makes once for every block (the plain and the split one alike).
    rope = ops.rotary_tables(torch.arange(SEQ), cfg.model.head_dim, cfg.model.rope_theta)
    x_full = _block_input(cfg.model.hidden_size)
    rank, tp = ctx.coord("tp"), ctx.size("tp")
    shard = SEQ // tp

    # Plain block, one process: the activation bytes to compare against.
    plain = build_model(cfg.model, cfg.training.seed).layers["0"]
    _, out["plain_saved"] = _saved_bytes(
        lambda: plain(x_full.clone().requires_grad_(), rope), plain.parameters())

    for sp in (False, True):
        for overlap in (False, True):
            model = build_model(cfg.model, cfg.training.seed)
            apply_tensor_parallel(model, ctx, sequence_parallel=sp, overlap=overlap)
            block = model.layers["0"]
            x = x_full[:, rank * shard:(rank + 1) * shard] if sp else x_full
            x = x.clone().requires_grad_()
            key = f"sp={sp},overlap={overlap}"

            with comm.counting() as fwd:
                y, out[key + ":saved"] = _saved_bytes(lambda: block(x, rope),
                                                      block.parameters())

            # Backward, logging launches, waits and matmuls in the order they happen.
            log = []
            real_run, real_wait = comm._run, comm.CountedWork.wait

            def logged_run(kind, dim, nbytes, wire, launch, async_op, tag):
                log.append(("launch" if async_op else "sync", kind, tag))
                return real_run(kind, dim, nbytes, wire, launch, async_op, tag)

            def logged_wait(work):
                log.append(("wait", work.kind, ""))
                return real_wait(work)

            class Matmuls(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
                        log.append(("mm", "", ""))
                    return func(*args, **(kwargs or {}))

            comm._run, comm.CountedWork.wait = logged_run, logged_wait
            try:
                with comm.counting() as bwd, Matmuls():
                    y.backward(torch.ones_like(y))
            finally:
                comm._run, comm.CountedWork.wait = real_run, real_wait
            out[key + ":log"] = log
            for phase, stats in (("fwd", fwd), ("bwd", bwd)):
                out[f"{key}:{phase}"] = [(e.kind, e.dim, e.bytes, e.tag) for e in stats.events]
    return out


@pytest.fixture(scope="module")
def probe():
    cfg = make_config([f"parallel.tp={TP}", f"training.seq_len={SEQ}",
                       f"training.micro_batch_size={BATCH}"])
    return run_ranks(TP, _probe_rank, cfg.model_dump(mode="json"))


def _count(events, tag=None):
    """{kind: (calls, bytes)} of the tp collectives with this tag (all tags if None)."""
    calls, nbytes = Counter(), Counter()
    for kind, dim, b, t in events:
        if dim == "tp" and (tag is None or t == tag):
            calls[kind] += 1
            nbytes[kind] += b
    return {k: (calls[k], nbytes[k]) for k in calls}


def _activation_bytes() -> int:
    cfg = make_config([])
    return BATCH * SEQ * cfg.model.hidden_size * 4  # fp32 [batch, seq, hidden]


def test_block_without_sp_does_two_all_reduces_each_way(probe):
    b = _activation_bytes()
    for r in probe:
        for overlap in (False, True):
            key = f"sp=False,overlap={overlap}"
            assert _count(r[key + ":fwd"]) == {"all_reduce": (2, 2 * b)}
            assert _count(r[key + ":bwd"]) == {"all_reduce": (2, 2 * b)}


def test_block_with_sp_gathers_and_scatters(probe):
    b = _activation_bytes()
    hidden = make_config([]).model.hidden_size
    for r in probe:
        for overlap in (False, True):
            key = f"sp=True,overlap={overlap}"
            # Forward: gather before q/k/v and gate/up, reduce-scatter after o_proj and down_proj.
            assert _count(r[key + ":fwd"]) == {"all_gather": (2, 2 * b),
                                               "reduce_scatter": (2, 2 * b)}
            # Backward: the conjugates ...
            assert _count(r[key + ":bwd"], "tp_bwd") == {"all_gather": (2, 2 * b),
                                                         "reduce_scatter": (2, 2 * b)}
            # ... plus the gathers of the inputs kept as sequence shards (for the weight
            # gradients), and the sums of the two norm weights' partial gradients.
            assert _count(r[key + ":bwd"], "tp_regather") == {"all_gather": (2, 2 * b)}
            assert _count(r[key + ":bwd"], "tp_param_grad") == {"all_reduce": (2, 2 * hidden * 4)}
            assert len(r[key + ":bwd"]) == 8


def test_sp_saves_one_tp_th_of_the_activations(probe):
    for r in probe:
        ratio = r["sp=True,overlap=True:saved"] / r["plain_saved"]
        assert ratio == pytest.approx(1 / TP, rel=0.03)
        # Without sequence parallel the norms and the layer inputs are replicated.
        assert r["sp=False,overlap=True:saved"] / r["plain_saved"] > 1.15 / TP


def _launch_to_wait(log):
    """For each asynchronous collective of backward: the matmuls that ran between its launch and
    its wait (waits come in launch order here)."""
    spans, open_ = [], []
    for what, kind, _ in log:
        if what == "launch":
            open_.append([kind, 0])
        elif what == "mm":
            for span in open_:
                span[1] += 1
        elif what == "wait" and open_:
            spans.append(tuple(open_.pop(0)))
    return spans


@pytest.mark.parametrize("sp", [False, True])
def test_input_gradient_reduction_overlaps_weight_gradients(probe, sp):
    reduction = "reduce_scatter" if sp else "all_reduce"
    for r in probe:
        with_overlap = [n for k, n in _launch_to_wait(r[f"sp={sp},overlap=True:log"])
                        if k == reduction]
        without = [n for k, n in _launch_to_wait(r[f"sp={sp},overlap=False:log"])
                   if k == reduction]
        # q/k/v and gate/up: the weight-gradient matmuls run while the reduction is in flight.
        assert sorted(with_overlap) == [2, 3]
        assert without == [0, 0]
