"""Context parallel on one process: which positions each cp rank keeps, the blocks its attention
computes (decided by positions alone, the masked ones skipped), the balanced causal work, and the
block math (`attention_blocks.attention_with_lse`, its backward, the log-sum-exp merge) against plain attention.
The multi-process runs are in test_context_parallel_parity.py."""

from __future__ import annotations

import pytest
import torch

from ultrascale.models import ops
from ultrascale.models.llama import CausalAttention
from ultrascale.parallel import attention_blocks as blocks
from ultrascale.parallel.context import RingAttention, SequenceShards
from ultrascale.parallel.ring_attention import block_plan, plan_blocks
from ultrascale.parallel.seams import Checkpointed, inner_of, replace_inner


def test_head_tail_shards_cover_the_sequence_once():
    shards = SequenceShards(cp=4, balanced=True)
    # 2 cp = 8 chunks of 4: rank r keeps chunks r and 7 - r.
    assert shards.positions(32, 0).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert shards.positions(32, 3).tolist() == [12, 13, 14, 15, 16, 17, 18, 19]
    plain = SequenceShards(cp=4, balanced=False)
    assert plain.positions(32, 1).tolist() == list(range(8, 16))
    for s in (shards, plain):
        every = torch.cat([s.positions(32, r) for r in range(4)])
        assert sorted(every.tolist()) == list(range(32))
    with pytest.raises(ValueError, match="does not split into 8 chunks"):
        shards.positions(36, 0)


def _work(shards: SequenceShards, seq_len: int) -> list[int]:
    return [block_plan(shards, seq_len // shards.cp, r).work() for r in range(shards.cp)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_causal_work_of_the_busiest_rank_is_within_5_percent_of_the_mean(cp):
    """The query-key pairs each rank's attention computes (its plan, all blocks), which add up to
    the causal triangle: head-tail balanced, the busiest rank is within 5% of the mean (here they
    are equal); one contiguous chunk each, the last rank does about 2 - 1/cp times the mean."""
    seq_len = 64 * cp
    triangle = seq_len * (seq_len + 1) // 2
    balanced = _work(SequenceShards(cp, True), seq_len)
    assert sum(balanced) == triangle
    assert max(balanced) <= 1.05 * (sum(balanced) / cp)
    plain = _work(SequenceShards(cp, False), seq_len)
    assert sum(plain) == triangle
    assert max(plain) / (sum(plain) / cp) > 2 - 1 / cp - 0.05


def test_blocks_are_decided_by_positions_and_masked_ones_are_skipped():
    shards = SequenceShards(cp=4, balanced=True)
    plan = block_plan(shards, 8, 1)  # rank 1 holds chunks 1 and 6 (positions 4..7, 24..27)
    kinds = [[(p.kind, p.q, p.k) for p in pieces] for pieces in plan.blocks]
    # Own block: causal by index, which is causal by position (positions increase).
    assert kinds[1] == [("causal", slice(0, 8), slice(0, 8))]
    # Rank 0's keys (chunks 0, 7): all our queries see chunk 0, none sees chunk 7.
    assert kinds[0] == [("full", slice(0, 8), slice(0, 4))]
    # Ranks 2, 3 (chunks 2/5, 3/4): only our late chunk sees them, wholly.
    assert kinds[2] == kinds[3] == [("full", slice(4, 8), slice(0, 8))]
    # Unbalanced, a later rank's keys are skipped outright.
    late = block_plan(SequenceShards(cp=4, balanced=False), 8, 0)
    assert late.blocks[1] == late.blocks[2] == late.blocks[3] == ()
    # Keys before the queries are wholly visible, keys at their positions causal (a mask where
    # they cover only part of the diagonal), keys after them skipped.
    pieces = plan_blocks(torch.arange(5, 10), torch.arange(0, 7))
    assert [(p.kind, p.k) for p in pieces] == [("full", slice(0, 5)), ("mask", slice(5, 7))]
    assert pieces[1].mask.tolist() == [[True, False], [True, True], [True, True], [True, True],
                                       [True, True]]
    pieces = plan_blocks(torch.tensor([3, 5, 9]), torch.tensor([4, 5, 6, 9]))
    assert [(p.kind, p.q, p.k) for p in pieces] == [
        ("full", slice(1, 2), slice(0, 1)), ("causal", slice(1, 2), slice(1, 2)),
        ("full", slice(2, 3), slice(0, 3)), ("causal", slice(2, 3), slice(3, 4))]


def _heads_first(*tensors):
    """[b, s, h, d] -> [b, h, s, d], the blocks' layout (views)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _blockwise(q, k, v, q_pos, k_pos):
    """Attention of queries at q_pos over keys at k_pos piece by piece (a one-process twin of a
    ring step), merged, and its backward with the merged output and lse; heads first."""
    pieces = plan_blocks(q_pos, k_pos)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for p in pieces:
        o, l = blocks.attention_with_lse(q[:, :, p.q], k[:, :, p.k], v[:, :, p.k],
                                      p.kind == "causal", p.mask)
        blocks.merge_attention_(out[:, :, p.q], lse[:, :, p.q], o, l)
    return pieces, out, lse


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_blockwise_attention_with_its_backward_equals_attention_by_position(kv_heads):
    """Queries and keys in a shuffled order of chunks (the ring's view of a rank's chunks against
    another's): the merged pieces equal masked attention by position, forward and backward, with
    grouped kv heads too."""
    torch.manual_seed(0)
    b, h, d = 2, 4, 8
    q_pos = torch.cat([torch.arange(8, 12), torch.arange(24, 28), torch.arange(0, 3)])
    k_pos = torch.cat([torch.arange(20, 28), torch.arange(0, 10)])
    q = torch.randn(b, len(q_pos), h, d, requires_grad=True)
    k = torch.randn(b, len(k_pos), kv_heads, d, requires_grad=True)
    v = torch.randn(b, len(k_pos), kv_heads, d, requires_grad=True)
    mask = q_pos[:, None] >= k_pos[None, :]
    ref = ops.attention(q, k, v, mask=mask)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    with torch.no_grad():
        qh, kh, vh, gh = _heads_first(q, k, v, grad)
        pieces, out, lse = _blockwise(qh, kh, vh, q_pos, k_pos)
        assert {p.kind for p in pieces} == {"full", "causal", "mask"}
        torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-5, atol=1e-5)
        dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for p in pieces:
            gq, gk, gv = blocks.attention_with_lse_backward(
                gh[:, :, p.q], qh[:, :, p.q], kh[:, :, p.k], vh[:, :, p.k], out[:, :, p.q],
                lse[:, :, p.q], p.kind == "causal", p.mask)
            dq[:, :, p.q] += gq
            dk[:, :, p.k] += gk
            dv[:, :, p.k] += gv
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-5)


def test_the_fused_kernel_and_the_math_reference_agree():
    """On a CPU, full and causal blocks run PyTorch's fused flash kernel; masked ones the math
    reference. Both give the same output, lse and gradients."""
    torch.manual_seed(1)
    q, k, v = _heads_first(torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8),
                           torch.randn(2, 6, 2, 8))
    for causal in (False, True):
        mask = torch.ones(6, 6, dtype=torch.bool)
        mask = mask.tril() if causal else mask
        fused = blocks.attention_with_lse(q, k, v, causal)
        math = blocks.attention_with_lse(q, k, v, mask=mask)
        for a, b in zip(fused, math):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(q)
        for a, b in zip(blocks.attention_with_lse_backward(g, q, k, v, *fused, causal=causal),
                        blocks.attention_with_lse_backward(g, q, k, v, *math, mask=mask)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_gpus_blocks_take_flash_attention_with_its_lse():
    """On CUDA in half precision full and causal blocks run FlashAttention-2 with its log-sum-exp
    (models/flash_blocks.py), grouped kv heads as they are; fp32, two head widths and a causal
    block off its diagonal take the math reference. Checked on fake CUDA tensors (the kernels'
    shapes and signatures; their numbers are the GPU suite's `cp_block_attention` row)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ultrascale.models import flash_blocks

    calls = []
    real = (flash_blocks.forward, flash_blocks.backward)

    def counted(fn):
        def wrapper(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return wrapper

    flash_blocks.forward, flash_blocks.backward = counted(real[0]), counted(real[1])
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            def block(sq, sk, d=64, dv=64, dtype=torch.bfloat16, kv=2):
                return (torch.empty(2, 8, sq, d, device="cuda", dtype=dtype),
                        torch.empty(2, kv, sk, d, device="cuda", dtype=dtype),
                        torch.empty(2, kv, sk, dv, device="cuda", dtype=dtype))

            for causal, (q, k, v) in ((True, block(16, 16)), (False, block(16, 48))):
                out, lse = ops.flash_attention_with_lse(q, k, v, causal)
                assert out.shape == q.shape and out.dtype == q.dtype
                assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
                merged = torch.empty(q.shape, device="cuda", dtype=torch.float32)
                dq, dk, dv = blocks.attention_with_lse_backward(merged, q, k, v, merged, lse,
                                                                causal)
                assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
            for causal, (q, k, v) in ((False, block(16, 16, dtype=torch.float32)),
                                      (False, block(16, 16, d=192, dv=128)),
                                      (True, block(16, 32))):
                assert ops.flash_attention_with_lse(q, k, v, causal) is None
    finally:
        flash_blocks.forward, flash_blocks.backward = real
    assert calls.count("forward") == 5 and calls.count("backward") == 2


def test_the_merge_is_stable_for_large_scores():
    """Blocks whose scores are in the thousands merge without overflow: the weights are
    exp(lse_part - lse_union) <= 1."""
    torch.manual_seed(2)
    q = torch.randn(1, 4, 2, 8) * 40
    k, v = torch.randn(1, 8, 2, 8) * 40, torch.randn(1, 8, 2, 8)
    q, k, v = _heads_first(q, k, v)
    ref, ref_lse = blocks.attention_with_lse(q, k, v)
    out, lse = torch.zeros(q.shape), torch.full((1, 2, 4), float("-inf"))
    for ks in (slice(0, 3), slice(3, 8)):
        blocks.merge_attention_(out, lse, *blocks.attention_with_lse(q, k[:, :, ks], v[:, :, ks]))
    assert ref_lse.abs().max() > 500 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-4)


def test_the_core_is_swapped_behind_a_recompute_checkpoint():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Checkpointed(CausalAttention())

    holder = Holder()
    ring = RingAttention(SequenceShards(2), 0)
    replace_inner(holder, "inner", ring)
    assert isinstance(holder.inner, Checkpointed) and inner_of(holder.inner) is ring


def test_positions_other_than_the_ranks_share_are_refused():
    ring = RingAttention(SequenceShards(2), 1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="positions other than its rank's share"):
        ring(q, q, q, torch.arange(8))


def test_a_masked_pieces_mask_goes_to_a_device_once():
    """`_mask_on` (ring_attention.py): a plan is made once, so its masks go to the device once,
    not at every layer (the meta device stands in for a GPU); the copy goes with the mask."""
    import gc

    from ultrascale.parallel import ring_attention

    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    piece = ring_attention.Piece(slice(0, 3), slice(0, 3), "mask", mask)
    assert ring_attention._mask_on(piece, mask.device) is mask
    meta = torch.device("meta")
    first = ring_attention._mask_on(piece, meta)
    assert first.device == meta and ring_attention._mask_on(piece, meta) is first
    key = id(mask)
    del piece, mask, first
    gc.collect()
    assert key not in ring_attention._ON_DEVICE
