"""The attention core on values of their own head width (multi-head latent attention's: DeepSeek-V3
has 192-wide queries and keys, 128-wide values): `ops.attention` against the core on values
zero-padded to one width, what it keeps for backward, the kernel rule on CUDA (from PyTorch's
constraints, no GPU needed), and the theory's FLOPs and bytes (theory/mla.py).

Tolerances. Values narrower than q/k (DeepSeek's case, tiny-deepseek's): the unpadded core runs
the same fused CPU kernel on the same padded operands, with the same scale, in forward and in
backward (the padded output columns are exact zeros), so it equals the padded core bit for bit:
bound 0. Values wider than q/k: q and k are padded and the scale given, where the padded core
scales q instead, so the scores round differently; both are compared with a float64 reference
at fp32's forward bound for one attention row, (2 d S + s' + 4) eps max|v| (the scores' dot
products of d terms, S the largest sum of |q_i k_i| x scale; the softmax moves an output by at
most twice its scores' error times max|v|; the sum over s' keys; the normalisation), and the same
bound scaled by the reference gradient's largest element for the gradients. A core that kept
the padded width's softmax scale 1/sqrt(width) is off by 1e-2 or more, far above it (checked).
"""

from __future__ import annotations

import math

import pytest
import torch

from ultrascale.models import ops

EPS = torch.finfo(torch.float32).eps
B, S, H, DQK = 2, 12, 4, 24


def _operands(v_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, d, generator=g).requires_grad_() for d in (DQK, DQK, v_dim)]


def _run(core, q, k, v, grad):
    out = core(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


def _padded_core(q, k, v):
    """The core as it ran before: one width for q, k and v, the output cut back."""
    qp, kp, vp, v_dim = ops.one_width(q, k, v)
    return ops.attention(qp, kp, vp)[..., :v_dim]


def _reference(q, k, v, grad, scale=None, window=None):
    """Causal attention in float64 (math), and its gradients; with a sliding `window`, query i
    sees keys i - window < j <= i."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * (scale or DQK ** -0.5)
    seen = torch.ones(S, S, dtype=torch.bool).tril()
    if window is not None:
        seen = seen.triu(1 - window)
    scores = scores.masked_fill(~seen, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
    return (out.detach(), *torch.autograd.grad(out, (qd, kd, vd), grad.double()))


def _forward_bound(q, k, v) -> float:
    sums = torch.einsum("bqhd,bkhd->bhqk", q.detach().abs(), k.detach().abs()) * DQK ** -0.5
    d = max(q.shape[-1], v.shape[-1])
    return (2 * d * float(sums.max()) + S + 4) * EPS * float(v.detach().abs().max())


def test_values_narrower_than_queries_equal_the_padded_core_exactly():
    q, k, v = _operands(16)
    grad = torch.randn(B, S, H, 16, generator=torch.Generator().manual_seed(1))
    mine, padded = _run(ops.attention, q, k, v, grad), _run(_padded_core, q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), mine, padded):
        assert a.shape == b.shape and torch.equal(a, b), name
    # With the documents' explicit mask, the same numbers.
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    assert torch.equal(ops.attention(q, k, v, mask=mask, causal=False).detach(), mine[0])


def test_values_wider_than_queries_within_fp32s_bound_and_a_wrong_scale_is_caught():
    q, k, v = _operands(40)
    grad = torch.randn(B, S, H, 40, generator=torch.Generator().manual_seed(1))
    ref = _reference(q, k, v, grad)
    bound = _forward_bound(q, k, v)
    for core in (ops.attention, _padded_core):
        got = _run(core, q, k, v, grad)
        for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
            scale = 1.0 if name == "out" else max(1.0, float(r.abs().max()))
            err = float((a.double() - r).abs().max())
            assert err <= bound * scale, f"{core.__name__} {name}: {err:.1e} > {bound:.1e}"
    # The fault: the padded width's default scale kept.
    wrong = _reference(q, k, v, grad, scale=40 ** -0.5)[0]
    assert float((wrong - ref[0]).abs().max()) > 100 * bound


@pytest.mark.parametrize("v_dim", [16, 40])
def test_a_sliding_window_over_values_of_their_own_width(v_dim):
    """Multi-head latent attention over a sliding window (`model.sliding_window`): the core, and
    ring and all-gather cp's blocks on one rank (their plans cut to the window), against the
    float64 reference under the window, within the forward bound (twice it for the blocks, which
    merge pieces); the core without the window misses it by far more."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext
    from ultrascale.parallel.context import MODES, SequenceShards

    comm.set_context(ParallelContext.without_mesh("cpu"))
    q, k, v = _operands(v_dim)
    grad = torch.randn(B, S, H, v_dim, generator=torch.Generator().manual_seed(1))
    window = 5
    ref = _reference(q, k, v, grad, window=window)
    bound = _forward_bound(q, k, v)
    cores = {"core": lambda q, k, v: ops.attention(q, k, v, window=window)}
    for mode in ("ring", "all_gather"):
        core = MODES[mode](SequenceShards(1, True), 0)
        core.window = window
        cores[mode] = lambda q, k, v, core=core: core(q, k, v, torch.arange(S))
    for name, core in cores.items():
        for part, a, r in zip(("out", "dq", "dk", "dv"), _run(core, q, k, v, grad), ref):
            scale = 1.0 if part == "out" else max(1.0, float(r.abs().max()))
            err = float((a.double() - r).abs().max())
            assert err <= 2 * bound * scale, f"{name} {part}: {err:.1e} > {2 * bound:.1e}"
    unwindowed = ops.attention(q, k, v).detach().double()
    assert float((unwindowed - ref[0]).abs().max()) > 100 * bound


def _saved_bytes(fn) -> dict[str, int]:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(kept.values()), out


def test_what_the_core_keeps_is_at_each_tensors_own_width():
    """q, k (24 wide), v and the output (16 wide), the fp32 log-sum-exp: nothing padded; and the
    output is what the output projection reads (one tensor: its flattened heads are a view)."""
    q, k, v = (t.detach().contiguous().requires_grad_() for t in _operands(16))
    kept, out = _saved_bytes(lambda: ops.attention(q, k, v))
    expected = 4 * B * S * H * (2 * DQK + 16 + 16) + 4 * B * H * S
    assert kept == expected
    flat = out.flatten(2)
    assert out.is_contiguous() and flat._is_view() and flat.data_ptr() == out.data_ptr()
    padded, _ = _saved_bytes(lambda: _padded_core(q, k, v))
    assert padded - kept == 4 * B * S * H * 2 * (DQK - 16)  # v and the output at 24


def test_cuda_kernels_for_two_widths_follow_torchs_constraints():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert ops.sdpa_backend("cuda", bf16, 192, False, 128) == "efficient"
    assert ops.sdpa_backend("cuda", bf16, 192, False, 192) == "flash"
    assert not ops.varlen_applies("cuda", bf16, 192, 128)
    assert not ops.takes_value_width("flash", bf16, 192, 128)
    assert ops.takes_value_width("efficient", bf16, 192, 128)
    assert ops.takes_value_width("cudnn", bf16, 192, 128)
    assert not ops.takes_value_width("efficient", bf16, 192, 132)  # alignment 8 in bf16
    assert ops.takes_value_width("efficient", fp32, 192, 132)  # 4 in fp32
    from ultrascale.parallel.attention_backend import candidates
    assert candidates(False, bf16, 192, 128) == ["cudnn", "efficient"]
    assert "flash" in candidates(False, bf16, 192, 192)


def test_theory_counts_scores_at_the_query_key_width_and_values_at_their_own():
    from ultrascale.layout import Layout
    from ultrascale.planner.hardware import get_hardware
    from ultrascale.config import build_config
    from ultrascale.theory.mla import MLA, core_widths
    from ultrascale.theory.shape import Shape, model_shape

    m = model_shape(build_config({"model": {"preset": "deepseek-v3"}, "device": "cuda"}).model)
    hw, mla = get_hardware("h100"), MLA()
    plain = Shape.of(m, Layout(dtype="bf16", mbs=1, seq_len=4096))
    ring = Shape.of(m, Layout(dtype="bf16", mbs=1, seq_len=4096, cp=2))
    assert core_widths(m) == (192, 128)
    scores_and_values = 2 * 4096 * 4096 * 0.5 * 128 * (192 + 128)
    assert mla.core_time(hw, plain) * hw.attention_rate("bf16") == pytest.approx(
        scores_and_values)
    # With a sliding window a query sees its keys only (theory/attention.py's `visible_keys`).
    from ultrascale.theory.attention import visible_keys
    windowed = model_shape(build_config({"model": {"preset": "deepseek-v3", "sliding_window": 1024},
                                         "device": "cuda"}).model)
    slid = Shape.of(windowed, Layout(dtype="bf16", mbs=1, seq_len=4096))
    assert mla.core_time(hw, slid) == pytest.approx(
        mla.core_time(hw, plain) * visible_keys(4096, 1024) / 2048)
    assert mla.core_backward_time(hw, plain) / mla.core_time(hw, plain) == pytest.approx(
        (3 * 192 + 2 * 128) / (192 + 128))
    from ultrascale.theory.implementation import ULTRASCALE
    parts = mla.saved(plain, "none", ULTRASCALE.rules)
    assert parts["attention core"] == 4096 * 128 * 128 * 2 + 128 * 4096 * 4
    assert "output projection input" not in parts  # the core's output itself
    ring_parts = mla.saved(ring, "none", ULTRASCALE.rules)  # half the tokens, nothing padded
    assert ring_parts["attention core"] * 2 == parts["attention core"]
    assert "output projection input" not in ring_parts
    assert mla.saved(plain, "selective", ULTRASCALE.rules)["output projection input"] == \
        4096 * 128 * 128 * 2  # the core's output not kept: the projection keeps its input
    assert math.isclose(parts["q, k, v"], 4096 * 128 * (2 * 192 + 128) * 2)


@pytest.mark.parametrize("v_dim", [16, 40])
def test_context_parallel_cores_take_values_of_their_own_width(v_dim):
    """Ring and all-gather pack the values beside the keys, their CPU blocks pad them for the
    fused kernel alone (`ops.flash_attention_with_lse`), Ulysses goes through `ops.attention`: on
    one cp rank each keeps what the plain core keeps (ring and all-gather: q, K and V packed, the
    output, its log-sum-exp, each at its own width) and equals the plain core, bit for bit with narrower values (the same kernel on
    the same operands), within twice the forward bound with wider ones (each is within it of the
    exact result). Multi-rank parity: tests/test_deepseek.py (cp2, each mode)."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext
    from ultrascale.parallel.context import MODES, SequenceShards

    comm.set_context(ParallelContext.without_mesh("cpu"))
    q, k, v = _operands(v_dim)
    grad = torch.randn(B, S, H, v_dim, generator=torch.Generator().manual_seed(1))
    plain = _run(ops.attention, q, k, v, grad)
    bound = 0.0 if v_dim < DQK else _forward_bound(q, k, v)
    for mode, cls in MODES.items():
        core = cls(SequenceShards(1, True), 0)
        got = _run(lambda q, k, v: core(q, k, v, torch.arange(S)), q, k, v, grad)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, plain):
            scale = 1.0 if name == "out" else max(1.0, float(b.abs().max()))
            assert a.shape == b.shape
            assert float((a - b).abs().max()) <= 2 * bound * scale, f"{mode} {name}"
        if mode != "ulysses":  # what they keep: as the plain core, nothing padded (K, V packed)
            fresh = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
            kept, _ = _saved_bytes(lambda: core(*fresh, torch.arange(S)))
            assert kept == 4 * B * S * H * (2 * DQK + 2 * v_dim) + 4 * B * H * S, mode
