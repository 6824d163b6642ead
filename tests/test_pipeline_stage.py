"""The pipeline stage split and the executor on one process (no transfers): fast unit tests."""

from __future__ import annotations

import pytest
import torch

from ultrascale.config import build_config
from ultrascale.models.llama import build_model
from ultrascale.parallel.pipeline.executor import PipelineExecutor, message_of, p2p_bytes_per_step
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models.llama import Linear
from ultrascale.models.ops import cross_entropy
from ultrascale.parallel.pipeline.stage import (
    DeferredMatmul, WeightGradStore, defer_weight_grads, split_layers, split_pipeline,
)
from ultrascale.parallel.runtime import prepare

MODEL = {"preset": None, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "vocab_size": 64}


def _model(tied: bool = True, layers: int = 4):
    cfg = build_config({"model": {**MODEL, "tie_embeddings": tied, "num_layers": layers},
                        "device": "cpu"}, [])
    return build_model(cfg.model, seed=7)


def _batches(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL["vocab_size"], (m, 2, 9), generator=g)
    return [prepare(d[:, :-1], d[:, 1:]) for d in data]


def _deferred(lin: Linear, store: WeightGradStore) -> Linear:
    """`lin` itself, its matmul swapped for the deferring one (names and parameters unchanged)."""
    lin.matmul = DeferredMatmul(lin.matmul, store)
    return lin


def test_split_layers_balances_and_follows_pp_layers():
    assert split_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # Uneven: the first stages, which also embed, take the smaller shares.
    assert [len(r) for r in split_layers(7, 3)] == [2, 2, 3]
    assert split_layers(5, 2, 1, [1, 4]) == [range(0, 1), range(1, 5)]
    with pytest.raises(ValueError, match="must list 2 positive layer counts"):
        split_layers(5, 2, 1, [5, 0])


@pytest.mark.parametrize("tied", [True, False])
def test_split_keeps_plain_names_and_only_own_pieces(tied):
    full = _model(tied, layers=8)
    names = set(full.state_dict())
    held = []
    for rank in range(2):
        ctx = ParallelContext.without_mesh("cpu")
        model, chunks = split_pipeline(_model(tied, layers=8), rank, pp=2, v=2, ctx=ctx)
        held.append(set(model.state_dict()))
        assert [c.stage for c in chunks] == [rank, rank + 2]
        assert [c.layer_ids for c in chunks] == [[2 * rank, 2 * rank + 1],
                                                 [2 * rank + 4, 2 * rank + 5]]
        if tied:  # both ends hold the embedding: the first to embed, the last as its head
            assert ctx.placement("embed.weight").copies == 2
    first, last = held
    assert first | last == names
    assert first & last == ({"embed.weight"} if tied else set())
    assert ("output.weight" in last) == (not tied) and "norm.weight" in last
    assert "norm.weight" not in first


def test_chunks_chained_equal_the_plain_forward():
    full = _model(tied=True)
    tokens = _batches(1)[0].tokens
    expected = full(tokens)
    x, positions = tokens, torch.arange(tokens.shape[1])
    for rank in range(2):
        _, chunks = split_pipeline(_model(tied=True), rank, pp=2)
        x = chunks[0](x, positions)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_deferred_linear_matches_autograd_and_waits_for_w():
    torch.manual_seed(0)
    lin = Linear(6, 5)
    ref = Linear(6, 5)
    ref.weight.data.copy_(lin.weight.data)
    store = WeightGradStore()
    deferred = _deferred(lin, store)
    assert deferred.weight is lin.weight
    x = torch.randn(3, 4, 6, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    with store.capturing("mb0"):
        deferred(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert lin.weight.grad is None and len(store) == 1  # I ran, W not yet
    store.flush("mb0")
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    assert len(store) == 0
    # Outside an I pass the weight gradient is computed at once, as an ordinary backward would;
    # likewise when the input needs no gradient (then there is no I pass to split from).
    for inputs in (x, x.detach()):
        before = lin.weight.grad.clone()
        deferred(inputs).sum().backward()
        torch.testing.assert_close(lin.weight.grad - before, torch.ones(12, 5).t() @ x.detach()
                                   .reshape(12, 6))
        assert len(store) == 0


def test_weight_grad_hooks_fire_in_w_not_in_i():
    # Data parallel launches its reduction from post-accumulate hooks: they must see the
    # gradient, so they may fire only once W has produced it.
    lin = Linear(4, 3)
    store = WeightGradStore()
    deferred = _deferred(lin, store)
    seen = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(2, 4, requires_grad=True)
    with store.capturing("k"):
        deferred(x).sum().backward()
    assert seen == [] and x.grad is not None
    store.flush("k")
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.ones(2, 3).t() @ x.detach())


def test_deferred_linear_under_bf16_autocast():
    torch.manual_seed(0)
    lin, ref = Linear(16, 8), Linear(16, 8)
    ref.weight.data.copy_(lin.weight.data)
    store = WeightGradStore()
    deferred = _deferred(lin, store)
    x = torch.randn(4, 16)
    for module in (ref, deferred):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(xi)
        assert y.dtype == torch.bfloat16
        with store.capturing(0):
            y.float().pow(2).sum().backward()
        store.flush(0)
        module.x_grad = xi.grad
    assert lin.weight.grad.dtype == torch.float32 and deferred.x_grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(deferred.x_grad, ref.x_grad, rtol=2e-2, atol=1e-2)


def _plain_grads(m: int):
    model = _model(tied=True)
    batches = _batches(m)
    total = 0.0
    for mb in batches:
        loss = cross_entropy(model(mb.tokens), mb.targets)
        (loss * 0.01).backward()
        total += float(loss.detach())
    return total, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", ["afab", "1f1b", "zero_bubble"])
def test_executor_on_one_rank_gives_the_plain_gradients(schedule):
    m = 3
    ref_loss, ref_grads = _plain_grads(m)
    model, chunks = split_pipeline(_model(tied=True), 0, pp=1)
    store = None
    if schedule == "zero_bubble":
        store = WeightGradStore()
        assert defer_weight_grads(model, store) == 7 * 4  # q k v o gate up down, per layer
    ex = PipelineExecutor(chunks, schedule, 1, 0, [0], 32, torch.float32, weight_store=store)
    flushed = []
    if store is not None:  # record what each W pass computes
        flush = store.flush
        store.flush = lambda key: (flushed.append((key, len(store._pending[key]))), flush(key))
    loss = ex.run(_batches(m), 0.01)
    if store is not None:
        assert sorted(flushed) == [((mb, 0), 28) for mb in range(m)]
    assert float(loss) == pytest.approx(ref_loss, rel=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


@pytest.mark.parametrize("overlap", [False, True])
def test_dualpipev_on_one_rank_gives_the_plain_gradients(overlap):
    """The whole V on one rank: both chunks hand their activations and gradients over in memory,
    paired forwards and backwards run together (with `overlap`, in two threads taking turns; a
    dense model has no all-to-all, so the backward runs once the forward is done), split
    backwards defer the linears' weight gradients to W."""
    m = 4
    ref_loss, ref_grads = _plain_grads(m)
    model, chunks = split_pipeline(_model(tied=True), 0, pp=1, v=2, placement="v")
    assert [(c.stage, c.is_first, c.is_last) for c in chunks] == [(0, True, False),
                                                                 (1, False, True)]
    store = WeightGradStore()
    defer_weight_grads(model, store)
    ex = PipelineExecutor(chunks, "dualpipev", 1, 0, [0], 32, torch.float32, weight_store=store,
                          overlap_pairs=overlap)
    program = ex.plan(m)[0]
    assert all(a.is_compute for a in program)  # nothing crosses ranks
    # m - 1 steady rounds of two pairs, less the first on this (the last) rank: run apart.
    assert sum(a.paired for a in program) == 2 * (m - 1) - 1
    loss = ex.run(_batches(m), 0.01)
    assert ex.handovers == 0
    assert float(loss) == pytest.approx(ref_loss, rel=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


def test_executor_refuses_zero_bubble_without_a_store():
    _, chunks = split_pipeline(_model(), 0, pp=1)
    with pytest.raises(ValueError, match="needs a WeightGradStore"):
        PipelineExecutor(chunks, "zero_bubble", 1, 0, [0], 32, torch.float32)


@pytest.mark.parametrize("pp,v,m", [(2, 1, 3), (4, 1, 4), (4, 2, 8)])
def test_p2p_bytes_per_step_counts_every_boundary_twice(pp, v, m):
    per_rank = [p2p_bytes_per_step(pp, v, m, r, activation_bytes=10) for r in range(pp)]
    assert sum(per_rank) == 2 * m * (pp * v - 1) * 10
    if v == 1:  # the two ends send one way only
        assert per_rank[0] == per_rank[-1] == m * 10


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_p2p_bytes_per_step_under_the_v_skip_the_turn(pp, m):
    """dualpipev: 2pp stages, 2pp - 1 boundaries, of which the last rank's turn (stage pp-1 to
    pp) stays in memory; the two end ranks send along one neighbour, the others along two."""
    per_rank = [p2p_bytes_per_step(pp, 2, m, r, activation_bytes=10, placement="v")
                for r in range(pp)]
    assert sum(per_rank) == 2 * m * (2 * pp - 2) * 10
    assert per_rank[0] == per_rank[-1] == 2 * m * 10
    assert per_rank[1:-1] == [4 * m * 10] * (pp - 2)


def _sends_held(schedule: str, pp: int, m: int, v: int) -> list[int]:
    """Per rank, the most sends a step holds at once, walking its program as the executor does:
    a send is held from its posting until this rank takes a message its plan says the peer sent
    after consuming it (`PipelineExecutor._releases`)."""
    peaks = []
    for rank in range(pp):
        ex = PipelineExecutor([None] * v, schedule, pp, rank, list(range(pp)), 8, torch.float32,
                              weight_store=WeightGradStore())
        program, _, releases = ex.plan(m)
        held, peak = set(), 0
        for a in program:
            if a.kind.startswith("SEND"):
                held.add(message_of(rank, a, pp, ex.placement))
                peak = max(peak, len(held))
            elif a.kind.startswith("RECV"):  # taken by the compute right after it
                held -= set(releases.get(message_of(rank, a, pp, ex.placement), ()))
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule,pp,v", [("afab", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
                                           ("zero_bubble", 4, 1), ("interleaved", 2, 2),
                                           ("interleaved", 4, 2), ("dualpipev", 2, 2),
                                           ("dualpipev", 4, 2)])
def test_sends_are_let_go_once_the_peer_has_them(schedule, pp, v):
    """A stage holds its sent activations and gradients about as long as its micro-batches are in
    flight, not to the end of the step: the peak does not grow with the micro-batches (except
    under AFAB, whose forwards all run before any backward)."""
    few, many = _sends_held(schedule, pp, 2 * pp, v), _sends_held(schedule, pp, 8 * pp, v)
    if schedule == "afab":
        assert max(many) > max(few)
        return
    assert few == many
    assert max(many) <= 2 * pp * v
    if (schedule, pp) == ("1f1b", 4):  # the figures in the closing note
        assert many == [4, 4, 3, 2]


@pytest.mark.parametrize("sp", [False, True])
def test_column_parallel_defers_its_weight_gradients_to_w(sp):
    """Tensor parallel's fused column matmuls (q/k/v, gate/up) under zero bubble: in I only the
    input gradient; in W each weight's, into a parameter or through the graph that made the weight
    (a replicated kv projection's rows), equal to plain autograd's. One rank, tp = 1: the
    collectives are copies, the bookkeeping is the same."""
    from contextlib import nullcontext

    from ultrascale.distributed import comm
    from ultrascale.models.llama import LinearMatmul
    from ultrascale.parallel.tensor_layers import column_parallel

    comm.set_context(ParallelContext.without_mesh("cpu"))
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(6, 8)) for _ in range(2)]
    x0 = torch.randn(2, 5, 8)

    def run(matmul, store=None):
        for w in weights:
            w.grad = None
        x = x0.clone().requires_grad_()
        rows = weights[1] * 1.0  # a weight made by a graph, as copy_to_tp(w)[rows] is
        outs = column_parallel(x, [weights[0], rows[2:5]], sp, True, matmul)
        loss = sum((o * (i + 1)).pow(2).sum() for i, o in enumerate(outs))
        with store.capturing("mb") if store is not None else nullcontext():
            loss.backward()
        return x

    x_ref = run(LinearMatmul())
    ref = [w.grad.clone() for w in weights]
    store = WeightGradStore()
    x = run(DeferredMatmul(LinearMatmul(), store), store)
    torch.testing.assert_close(x.grad, x_ref.grad)
    # I ran, W not yet: no gradient reached the weights, not even zeros through the rows' graph.
    assert all(w.grad is None for w in weights) and len(store) == 1
    store.flush("mb")
    for w, g in zip(weights, ref):
        torch.testing.assert_close(w.grad, g)
    assert len(store) == 0
    run(DeferredMatmul(LinearMatmul(), store))  # a full backward (B): the weights' now
    for w, g in zip(weights, ref):
        torch.testing.assert_close(w.grad, g)
