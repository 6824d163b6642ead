"""Document masking on one process (`data.document_mask`, models/documents.py): a packed sequence
gives the loss and gradients of its documents run one by one, on the plain core and under
recomputation; context parallel's block plans keep each query inside its document and skip the
blocks whose documents do not meet (their one-process twin against masked attention); the
variable-length GPU path's layout, checked on a CPU against a reference kernel; and the data:
where documents begin in a window, the targets across a boundary, the loss tokens.

Tolerances. A packed document's attention rows differ from the document's own only by masked keys
(exactly zero probability); the weights' gradients sum the same per-token terms in another order
(one matmul over the packed tokens against one per document): a reassociated sum of n = 128
terms, off by at most n x eps of its terms' magnitude. In fp64 (eps 1.1e-16) that is ~1e-14, so
the issue's 1e-6 of each tensor's largest gradient holds with room (measured: 1e-15); in fp32
(eps 6e-8) the bound is 7.6e-6, so 1e-5 (measured: 7e-7). Both sit far below the effect of a
document reading its neighbour (the fault injected below: 1e-4 of the loss at initialisation,
where attention is near uniform, and more of the gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import make_config
from ultrascale.data.dataset import TokenDataset
from ultrascale.data.windows import IGNORE, Window, micro_batch, starts_from_begins
from ultrascale.models import ops
from ultrascale.models.documents import Documents
from ultrascale.models.llama import build_model
from ultrascale.parallel import attention_blocks as blocks
from ultrascale.parallel.context import SequenceShards
from ultrascale.parallel.recompute import apply_recompute
from ultrascale.parallel.ring_attention import block_plan

SEQ = 32
LAYOUTS = [[7, 12, 13], [32], [1, 5, 26], [16, 16]]  # each sequence's document lengths


def _packed_batch(generator: torch.Generator):
    """Two micro-batches of two packed sequences: tokens [4, SEQ + 1], begins per sequence."""
    tokens = torch.randint(0, 256, (len(LAYOUTS), SEQ + 1), generator=generator)
    begins = [np.cumsum(lengths)[:-1].astype(np.int64) for lengths in LAYOUTS]
    return tokens, begins


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _packed_loss(model, tokens, begins) -> torch.Tensor:
    inputs, targets, starts = micro_batch([Window(t.numpy(), b) for t, b in zip(tokens, begins)])
    return model(torch.from_numpy(inputs), None, torch.from_numpy(targets),
                 Documents.of(starts))


def _one_by_one_loss(model, tokens, begins) -> torch.Tensor:
    """Each document alone from position 0: its own tokens and targets, the last target of a
    document that the next one follows counting nothing (it would be the next one's first)."""
    total = torch.zeros((), dtype=torch.float64)
    for row, row_begins in zip(tokens, begins):
        edges = [0, *row_begins.tolist(), SEQ]
        for a, b in zip(edges, edges[1:]):
            targets = row[a + 1:b + 1].clone()
            if b < SEQ:
                targets[-1] = IGNORE
            total = total + model(row[None, a:b], None, targets[None])
    return total


def _assert_close_grads(got: dict, want: dict, rtol: float = 1e-6) -> None:
    for name, g in want.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got[name], g, rtol=0.0, atol=rtol * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("recompute,dtype,rtol", [
    ("none", torch.float64, 1e-6), ("none", torch.float32, 1e-5),
    ("selective", torch.float64, 1e-6), ("full", torch.float64, 1e-6)])
def test_packed_documents_give_the_loss_and_gradients_of_the_documents_one_by_one(
        recompute, dtype, rtol):
    cfg = make_config([])
    model = apply_recompute(build_model(cfg.model, 3).to(dtype), recompute)
    tokens, begins = _packed_batch(torch.Generator().manual_seed(0))
    packed = _packed_loss(model, tokens, begins)
    packed.backward()
    got = _grads(model)
    alone = _one_by_one_loss(model, tokens, begins)
    alone.backward()
    want = _grads(model)
    # The loss is summed in fp32 (ops.cross_entropy) of positive terms, pairwise: within
    # log2(128) x eps32 = 4e-7 of itself whatever the order.
    torch.testing.assert_close(packed.double(), alone.double(), rtol=1e-6, atol=0.0)
    _assert_close_grads(got, want, rtol)


def test_the_tolerance_sees_a_document_reading_its_neighbour():
    """The fault the test must catch: the same packed batch without the mask (attention crosses
    the boundaries, positions run on) moves the loss and the gradients far beyond 1e-6."""
    cfg = make_config([])
    model = build_model(cfg.model, 3).double()
    tokens, begins = _packed_batch(torch.Generator().manual_seed(0))
    inputs, targets, _ = micro_batch([Window(t.numpy(), b) for t, b in zip(tokens, begins)])
    crossing = model(torch.from_numpy(inputs), None, torch.from_numpy(targets))
    crossing.backward()
    crossing = crossing.detach()
    got = _grads(model)
    alone = _one_by_one_loss(model, tokens, begins)
    alone.backward()
    alone = alone.detach()
    want = _grads(model)
    # At initialisation attention is near uniform, so the effect is small, yet 10x the tolerance.
    assert abs(float(crossing - alone)) > 1e-5 * abs(float(alone))
    worst = max(float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items())
    assert worst > 1e-5


def _documents(seq: int, begins_per_row) -> Documents:
    return Documents.of(np.stack([starts_from_begins(seq, np.asarray(b, dtype=np.int64))
                                  for b in begins_per_row]))


@pytest.mark.parametrize("cp,balanced,window,documented", [
    (2, True, None, True), (4, True, None, True), (2, False, None, True),
    (2, True, 6, False), (4, True, 6, True), (2, False, 3, True), (4, False, 9, False)])
def test_block_plans_keep_queries_in_their_documents_and_windows(cp, balanced, window,
                                                                  documented):
    """Every cp rank's pieces, computed and merged as its ring or all-gather would (a
    one-process twin: every rank's keys at hand), with their backward: equal to attention under
    the document mask and the sliding window, for sequences with different documents, grouped
    kv heads. The pieces compute exactly the query-key pairs that attention keeps."""
    torch.manual_seed(1)
    seq, h, kv, d = 32, 4, 2, 8
    docs = _documents(seq, [[5, 13, 29], [16], [3, 4, 20, 21]])
    b = docs.shape[0]
    q = torch.randn(b, seq, h, d, requires_grad=True)
    k = torch.randn(b, seq, kv, d, requires_grad=True)
    v = torch.randn(b, seq, kv, d, requires_grad=True)
    docs = docs if documented else None
    ref = ops.attention(q, k, v, documents=docs, window=window)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    shards = SequenceShards(cp, balanced)
    qh, kh, vh, gh = (t.detach().transpose(1, 2) for t in (q, k, v, grad))
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
    work = 0
    for r in range(cp):
        mine = shards.positions(seq, r)
        plan = block_plan(shards, len(mine), r, docs, window)
        work += plan.work() * (1 if documented else b)
        out = torch.zeros(b, h, len(mine), d)
        lse = torch.full((b, h, len(mine)), float("-inf"))
        for j, pieces in enumerate(plan.blocks):
            keys = shards.positions(seq, j)
            for p in pieces:
                o, l = blocks.attention_with_lse(qh[p.b][:, :, mine[p.q]], kh[p.b][:, :, keys[p.k]],
                                                 vh[p.b][:, :, keys[p.k]], p.kind == "causal",
                                                 p.mask)
                blocks.merge_attention_(out[p.b, :, p.q], lse[p.b, :, p.q], o, l)
        torch.testing.assert_close(out.transpose(1, 2), ref.detach()[:, mine], rtol=1e-5,
                                   atol=1e-5)
        for j, pieces in enumerate(plan.blocks):
            keys = shards.positions(seq, j)
            for p in pieces:
                gq, gk, gv = blocks.attention_with_lse_backward(
                    gh[p.b][:, :, mine[p.q]], qh[p.b][:, :, mine[p.q]], kh[p.b][:, :, keys[p.k]],
                    vh[p.b][:, :, keys[p.k]], out[p.b, :, p.q], lse[p.b, :, p.q],
                    p.kind == "causal", p.mask)
                dq[p.b, :, mine[p.q]] += gq
                dk[p.b, :, keys[p.k]] += gk
                dv[p.b, :, keys[p.k]] += gv
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-5)
    assert work == int(_kept_pairs(seq, docs, window, b).sum())


def _kept_pairs(seq: int, docs: Documents | None, window: int | None, b: int) -> torch.Tensor:
    """[b, seq, seq] bool: the query-key pairs causal attention keeps, in the query's document
    and window."""
    i = torch.arange(seq)
    kept = (i[None, :] <= i[:, None]).expand(b, seq, seq)
    if window is not None:
        kept = kept & (i[None, :] > i[:, None] - window)
    if docs is not None:
        starts = torch.as_tensor(docs.host)
        kept = kept & (i[None, None, :] >= starts[:, :, None])
    return kept


def test_a_block_outside_every_window_is_skipped():
    """cp 2, balanced, 32 tokens, window 6: rank 0 holds positions 0..7 and 24..31, rank 1
    8..23. Rank 0's late queries see keys 19.. only: its own early keys are never computed
    against them, and of rank 1's keys only 19..23, by queries 24..28 (the piece is trimmed to
    them); rank 1's queries see none of rank 0's late keys (the future), and only 8..12 see any
    of its early ones (3..7)."""
    shards = SequenceShards(2, True)
    plan = block_plan(shards, 16, 0, window=6)
    assert [(p.kind, p.q, p.k) for p in plan.blocks[0]] == [("mask", slice(0, 8), slice(0, 8)),
                                                            ("mask", slice(8, 16), slice(8, 16))]
    (theirs,) = plan.blocks[1]
    assert (theirs.q, theirs.k) == (slice(8, 13), slice(11, 16))  # queries 24..28, keys 19..23
    (early,) = block_plan(shards, 16, 1, window=6).blocks[0]
    assert (early.q, early.k) == (slice(0, 5), slice(3, 8))  # queries 8..12, keys 3..7
    assert block_plan(shards, 16, 0, window=32) is block_plan(shards, 16, 0)  # no window


def test_a_block_whose_documents_do_not_meet_is_skipped():
    """cp 2, balanced: rank 0 holds positions 0..7 and 24..31, rank 1 8..23. With documents
    beginning at 8 and 24 no query of rank 0 sees a key of rank 1 (and the reverse): neither
    computes the other's block; every piece is full or causal (no mask)."""
    shards = SequenceShards(2, True)
    docs = _documents(32, [[8, 24]])
    for r in range(2):
        plan = block_plan(shards, 16, r, docs)
        assert plan.blocks[1 - r] == ()
        assert {p.kind for p in plan.blocks[r]} <= {"full", "causal"}
    assert block_plan(shards, 16, 0, docs) is block_plan(shards, 16, 0, docs)  # made once
    # Without boundaries rank 0's late chunk sees all of rank 1's keys.
    assert block_plan(shards, 16, 0).blocks[1] != ()


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa):
    """The variable-length kernel's contract, on a CPU: causal attention of each sequence of the
    flattened tokens [T, heads, d] (cu offsets) on its own, a query seeing at most
    window_size[0] keys before it (-1: all)."""
    left, right = window_size
    assert right == 0 and cu_q is cu_k
    pieces = []
    for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
        i = torch.arange(b - a)
        seen = (i[None, :] <= i[:, None]) & ((left < 0) | (i[:, None] - i[None, :] <= left))
        pieces.append(ops.attention(q[None, a:b], k[None, a:b], v[None, a:b], mask=seen,
                                    causal=False)[0])
        assert b - a <= max_q
    return torch.cat(pieces)


def test_the_varlen_path_lays_the_batch_out_as_the_kernel_wants():
    """On CUDA in half precision documents take PyTorch's variable-length FlashAttention: the
    batch flattened, each document one of its sequences (`Documents.cu_seqlens`). Its layout,
    run here with a reference kernel of the same contract, equals masked attention."""
    torch.manual_seed(2)
    docs = _documents(16, [[3, 9], [], [15]])
    assert docs.cu_seqlens.tolist() == [0, 3, 9, 16, 32, 47, 48] and docs.max_len == 16
    q = torch.randn(3, 16, 4, 8)
    k, v = torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    got = ops._varlen_attention(q, k, v, docs, kernel=_reference_varlen)
    torch.testing.assert_close(got, ops.attention(q, k, v, documents=docs), rtol=1e-5, atol=1e-5)
    # A sliding window (model.sliding_window): the kernel's window_size, with documents or with
    # each sequence whole, equals the masked path's.
    for documents in (docs, None):
        got = ops._varlen_attention(q, k, v, documents, kernel=_reference_varlen, window=5)
        want = ops.attention(q, k, v, documents=documents, window=5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (want - ops.attention(q, k, v, documents=documents)).abs().max() > 1e-2
    # torch 2.11's kernel takes no enable_gqa: the kv heads are repeated for it, same output.
    def without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, window_size):
        assert k.shape[1] == v.shape[1] == q.shape[1]
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size, False)

    got = ops._varlen_attention(q, k, v, docs, kernel=without_gqa, window=5)
    torch.testing.assert_close(got, ops.attention(q, k, v, documents=docs, window=5),
                               rtol=1e-5, atol=1e-5)
    has_varlen = ops._VARLEN is not None
    assert ops.varlen_applies("cuda", torch.bfloat16, 64) == has_varlen
    assert not ops.varlen_applies("cuda", torch.float32, 64)  # fp32: the masked kernel
    assert not ops.varlen_applies("cpu", torch.bfloat16, 64)


def test_rotary_positions_restart_at_each_document():
    docs = _documents(8, [[3], [1, 2]])
    assert docs.rotary_positions(torch.arange(8)).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4],
                                                               [0, 0, 0, 1, 2, 3, 4, 5]]
    assert docs.rotary_positions(torch.tensor([6, 7, 0, 1])).tolist() == [[3, 4, 0, 1],
                                                                         [4, 5, 0, 0]]
    with pytest.raises(ValueError, match="non-decreasing"):
        Documents.of(np.array([[0, 0, 2, 1]]))


def test_windows_targets_and_loss_tokens_follow_the_documents():
    """A stream of documents at offsets 0, 5, 9, 20, 24 cut into windows of 8 (9 tokens: the
    last is only a target): a window holds the documents beginning inside it, the target before
    each boundary counts nothing, and `loss_tokens` counts exactly the targets that do."""
    tokens = np.arange(1, 42, dtype=np.uint16)  # token = offset + 1
    ds = TokenDataset(tokens, 8, 256, doc_starts=np.array([0, 5, 9, 20, 24]))
    assert ds.window(0).begins.tolist() == [5]  # offsets 0..8
    assert ds.window(1).begins.tolist() == [1]  # offsets 8..16: 9
    assert ds.window(2).begins.tolist() == [4, 8]  # offsets 16..24: 20, and 24 (a target only)
    inputs, targets, starts = micro_batch([ds.window(0), ds.window(1), ds.window(2)])
    assert targets[0].tolist() == [2, 3, 4, 5, IGNORE, 7, 8, 9]
    assert targets[2].tolist() == [18, 19, 20, IGNORE, 22, 23, 24, IGNORE]
    assert starts.tolist() == [[0, 0, 0, 0, 0, 5, 5, 5], [0, 1, 1, 1, 1, 1, 1, 1],
                               [0, 0, 0, 0, 4, 4, 4, 4]]
    for idx in ([0], [0, 1], [1, 2, 3], [4]):
        _, t, _ = micro_batch([ds.window(i) for i in idx])
        assert ds.loss_tokens(idx) == int((t != IGNORE).sum())
    plain = TokenDataset(tokens, 8, 256)  # no document masking: every target, no documents
    inputs, targets, starts = micro_batch([plain.window(0)])
    assert starts is None and (targets != IGNORE).all() and plain.loss_tokens([0, 1]) == 16


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek"])
def test_every_layer_keeps_the_one_mask_of_the_micro_batch(preset, monkeypatch):
    """Every layer's attention takes (and keeps for its backward) the micro-batch's one additive
    mask: packed documents add to the saved activations one [b, 1, S, S] mask in the kernel's
    dtype and its boolean source, not one per layer (each layer converted its own before: 4 MiB
    per layer here, on MLA's padded-values path too)."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext
    from ultrascale.memory.measure import SavedActivationMeter
    from ultrascale.models import documents as documents_module
    from ultrascale.parallel.apply import parallelize

    b, s = 2, 512
    starts = torch.zeros(b, s, dtype=torch.long)
    starts[:, s // 2:] = s // 2

    def saved(docs: bool) -> int:
        cfg = make_config([f"model.preset={preset}", "parallel.dp=1", f"training.seq_len={s}",
                           f"training.micro_batch_size={b}", f"data.document_mask={docs}"])
        comm.set_context(ParallelContext.without_mesh("cpu"))
        rt = parallelize(build_model(cfg.model, cfg.training.seed),
                         ParallelContext.without_mesh("cpu"), cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1),
                               generator=torch.Generator().manual_seed(0))
        mb = (tokens[:, :-1], tokens[:, 1:]) + ((Documents.of(starts),) if docs else ())
        with SavedActivationMeter(rt.module) as meter:
            rt.forward_backward([mb], 1.0 / (b * s))
        return meter.peak_bytes

    # fp32: the CPU computes attention in fp32. Beside it the documents' rotary tables, one per
    # sequence ([b, s, rotary width]): 1.5-3% of the mask here.
    one_mask = b * s * s * 4
    plain = saved(False)
    assert one_mask <= saved(True) - plain <= 1.05 * one_mask
    # The fault: a mask made anew for every call.
    monkeypatch.setattr(Documents, "additive_mask",
                        lambda self, dtype, window=None: documents_module._additive_mask(
                            self, dtype, window))
    layers = make_config([f"model.preset={preset}"]).model.num_layers
    assert saved(True) - plain >= layers * one_mask
