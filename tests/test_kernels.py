"""Fused kernels against their PyTorch references (models/ops.py), forward and backward.

The Triton kernels run under Triton's interpreter on this CPU (TRITON_INTERPRET=1, fp32: the
interpreter mishandles bf16), at shapes that are not multiples of their block sizes. The chunked
linear + cross-entropy is held against the plain head (loss and gradients within the round-off
bounds of the sums they reorder) and measured:
its peak memory is below the plain head's at 4096 tokens, for the tiny preset and for a 128k
vocabulary. Then the kernels inside the model (swapped by parallel/kernels.py) and their
refusals.
"""

from __future__ import annotations

import os

import pytest
import torch

from parity import GRAD_RTOL
from ultrascale.memory.measure import LiveTensorMeter
from ultrascale.models import ops
from ultrascale.parallel.kernels import rms_norm_triton, rotary_triton, swiglu_triton


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """conftest.py turns Triton's interpreter on for the session (before torch imports triton)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"


def _fwd_bwd(fn, *inputs: torch.Tensor, seed: int = 0):
    """Output and input gradients of fn(*inputs) under a fixed random output gradient."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad)
    return out.detach(), [x.grad for x in leaves if x.grad is not None]


def _assert_kernel_matches(reference, fused, *inputs, tol: float = 1e-5) -> None:
    ref_out, ref_grads = _fwd_bwd(reference, *inputs)
    out, grads = _fwd_bwd(fused, *inputs)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol * max(1.0, float(r.abs().max())))


@pytest.mark.parametrize("shape", [(3, 5, 100), (2, 7, 64), (1, 1, 1), (4, 300)])
def test_rms_norm_kernel(shape):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    _assert_kernel_matches(lambda a, b: ops.rms_norm(a, b, 1e-5),
                           lambda a, b: rms_norm_triton(a, b, 1e-5), x, w)


@pytest.mark.parametrize("shape", [(3, 5, 100), (2, 3000), (1,)])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row_weight"])
def test_swiglu_kernel(shape, weighted):
    """With a weight per row (the routing weights of a mixture of experts), its gradient too:
    row sums of up to 3000 products, reassociated by the kernel's blocks (fp32: a random-walk
    error of about sqrt(3000) x 2^-24 = 3e-6 of the sum of |terms|, within the 1e-5 x max|grad|
    allowed)."""
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(shape, generator=g), torch.randn(shape, generator=g)]
    if weighted:
        inputs.append(torch.rand(shape[:-1], generator=g))
    _assert_kernel_matches(ops.swiglu, swiglu_triton, *inputs)


@pytest.mark.parametrize("b,s,h,d,first,packed", [(2, 7, 3, 10, 3, False), (1, 5, 2, 64, 0, False),
                                                  (3, 1, 1, 2, 9, False), (2, 7, 3, 10, 0, True)])
def test_rotary_kernel(b, s, h, d, first, packed):
    """`packed`: documents packed into the sequences, whose positions restart at each (tables
    per sequence, [b, s, d])."""
    from ultrascale.models.documents import Documents

    documents = Documents.of(torch.tensor([[0, 0, 2, 2, 2, 5, 5], [0] * 7])) if packed else None
    rope = ops.rotary_tables(torch.arange(first, first + s), d, 10000.0, documents=documents)
    assert rope.cos.dim() == (3 if packed else 2)
    x = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(3))
    _assert_kernel_matches(lambda t: ops.rotary(t, rope), lambda t: rotary_triton(t, rope), x)


@pytest.mark.parametrize("rows,cols,valid", [(5, 300, 300), (3, 5000, 4999), (4, 33, 17)])
def test_cross_entropy_row_passes(rows, cols, valid):
    """The Triton row passes on a prefix of the columns (a vocabulary slice before its padding),
    with targets inside and outside the slice."""
    from ultrascale.kernels import cross_entropy

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, cols, generator=g) * 3
    targets = torch.randint(-1, valid, (rows,), generator=g)
    ref_max, ref_sum = ops.row_stats(logits[:, :valid].clone())
    mx, sm = cross_entropy.row_stats(logits[:, :valid])
    torch.testing.assert_close(mx, ref_max)
    torch.testing.assert_close(sm, ref_sum, rtol=1e-6, atol=0)
    lse = ref_max + ref_sum.log()
    expected = ops.softmax_grad_(logits[:, :valid].clone(), lse, targets)
    got = logits.clone()
    cross_entropy.softmax_grad_(got[:, :valid], lse, targets)
    torch.testing.assert_close(got[:, :valid], expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[:, valid:], logits[:, valid:])  # the padding is not touched


U = 2.0 ** -24  # fp32's unit round-off


def head_bounds(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, upstream: float):
    """Bounds of |chunked - plain| for the summed cross-entropy of the head h @ w.T and its
    gradients, from how each is computed in fp32 (Higham: a sum of n terms, in any order, is within
    (n - 1) u of the sum of their magnitudes; two orders within twice that):
    - the logits: sums of `hidden` products, |dz| <= 2 hidden u |h|_1 max|w| per token;
    - each row's log-sum-exp: a sum of `vocab` positive terms, |d lse| <= (2 vocab + 4) u (exp and
      log each round once) plus the logits' own;
    - the softmax gradient d = upstream (p - onehot), |d| <= m = |upstream| (p + onehot), off by
      at most c m with c = |d lse| + |dz| + 2u per token;
    - grad w = d.T @ h sums over the tokens, grad h = d @ w over the vocabulary: within
      (2 n u + c) of the magnitudes' product (for grad h, m @ |w| is bounded by |upstream| times
      the vocabulary's largest |w| plus the target's: p sums to 1);
    - the loss: each token's lse - z, summed over the tokens.
    Returns (loss bound, grad h bound, grad w bound); evaluated in fp32 256 tokens at a time (a
    128k vocabulary's logits in float64 would not fit), which moves a bound by ~1e-6 of itself."""
    h2, w2 = h.float().reshape(-1, h.shape[-1]), w.float()
    tokens, hidden, vocab = h2.shape[0], h2.shape[1], w2.shape[0]
    targets = t.reshape(-1)
    grad_w = torch.zeros_like(w2)
    grad_h = torch.empty_like(h2)
    loss = 0.0
    for lo in range(0, tokens, 256):
        hc, tc = h2[lo:lo + 256], targets[lo:lo + 256]
        rows = torch.arange(len(tc))
        z = hc @ w2.t()
        dz = 2 * hidden * U * hc.abs().sum(-1) * w2.abs().max()
        c = (2 * vocab + 4) * U + 2 * dz + 2 * U
        m = torch.softmax(z, dim=-1).mul_(abs(upstream))
        m[rows, tc] += abs(upstream)
        grad_w += ((2 * tokens * U + c)[:, None] * m).t() @ hc.abs()
        # m @ |w| <= |upstream| (max over the vocabulary of |w| + |w[target]|): p sums to 1.
        reach = abs(upstream) * (w2.abs().max(dim=0).values + w2[tc].abs())
        grad_h[lo:lo + 256] = (2 * vocab * U + c)[:, None] * reach
        per_token = torch.logsumexp(z, dim=-1) - z[rows, tc]
        loss += float(c.sum() + 2 * tokens * U * per_token.abs().sum())
    return loss, grad_h.view(h.shape).double(), grad_w.double()


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound, what: str) -> None:
    err = (got.double() - ref.double()).abs()
    ratio = float((err / bound).max()) if torch.is_tensor(bound) else float(err.max() / bound)
    print(f"{what}: {ratio:.1e} of its round-off bound")  # pytest -s: the measured margins
    assert ratio <= 1.0, f"{what}: {ratio:.2f} of its round-off bound"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("tokens,hidden,vocab,chunk", [(37, 16, 300, 10), (64, 8, 5000, 48)])
def test_linear_cross_entropy_matches_plain_head(impl, tokens, hidden, vocab, chunk):
    """Loss and gradients within the round-off bounds of `head_bounds` (the plain head and the
    chunked one sum the same terms in other orders): the measured differences are at most 6e-3 of
    those bounds under every kernel path; a chunk left out or counted twice is 100% of its tokens'
    gradients."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    t = torch.randint(0, vocab, (2, tokens), generator=g)
    # Targets that count nothing, drawn apart (the other targets stay those the tolerance knew).
    t[torch.rand(t.shape, generator=torch.Generator().manual_seed(6)) < 0.3] = ops.IGNORE
    ref_out, ref_grads = _fwd_bwd(lambda a, b: ops.cross_entropy(ops.linear(a, b), t), h, w)
    out, grads = _fwd_bwd(lambda a, b: ops.linear_cross_entropy(a, b, t, impl=impl,
                                                                chunk_tokens=chunk), h, w)
    upstream = float(torch.randn((), generator=torch.Generator().manual_seed(0)))  # _fwd_bwd's
    loss_bound, h_bound, w_bound = head_bounds(h, w, t, upstream)
    assert_within(out, ref_out, loss_bound, "loss")
    assert_within(grads[0], ref_grads[0], h_bound, "grad hidden")
    assert_within(grads[1], ref_grads[1], w_bound, "grad weight")


def _measured_head(loss_fn, h, w, t):
    """Mean-token loss, gradients and the peak bytes of tensors alive during forward + backward."""
    a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
    with LiveTensorMeter() as meter:
        loss = loss_fn(a, b, t) / t.numel()
        loss.backward()
    return loss.detach(), a.grad, b.grad, meter.peak_bytes


@pytest.mark.parametrize("vocab", [256, pytest.param(32000, marks=pytest.mark.slow)],
                         ids=["tiny", "vocab32k"])
def test_chunked_loss_same_result_lower_peak_at_4096_tokens(vocab):
    """The tiny preset's head (hidden 128, vocabulary 256, or Llama 2's 32000 tokens: a
    vocabulary far wider than the chunk, as the 128k ones are) on 4096 tokens: the same loss and
    gradients as the plain head (within `head_bounds`), and a lower peak."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4096, 128, generator=g)
    w = torch.randn(vocab, 128, generator=g) * 0.02
    t = torch.randint(0, vocab, (4096,), generator=g)
    plain = _measured_head(lambda a, b, c: ops.cross_entropy(ops.linear(a, b), c), h, w, t)
    chunked = _measured_head(lambda a, b, c: ops.linear_cross_entropy(a, b, c), h, w, t)
    loss_bound, h_bound, w_bound = head_bounds(h, w, t, 1.0 / t.numel())
    assert_within(chunked[0] * t.numel(), plain[0] * t.numel(), loss_bound, "loss")
    assert_within(chunked[1], plain[1], h_bound, "grad hidden")
    assert_within(chunked[2], plain[2], w_bound, "grad weight")
    logits_bytes = 4096 * vocab * 4
    assert plain[3] >= 2 * logits_bytes  # the logits and their gradient, at least
    assert chunked[3] < plain[3]
    if vocab > 4096:  # a chunk of 512 tokens' logits at a time (8 chunks): ~6.9x lower
        assert chunked[3] < plain[3] / 6


def _small_model(seed: int = 7, moe: bool = False):
    from ultrascale.config import build_config
    from ultrascale.models.llama import build_model

    experts = dict(num_experts=4, experts_top_k=2, moe_ffn_hidden_size=24, first_k_dense=1)
    cfg = build_config({"model": {"preset": None, "hidden_size": 32, "num_layers": 2,
                                  "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48,
                                  "vocab_size": 100, **(experts if moe else {})},
                        "parallel": {"dp": 1}})
    return build_model(cfg.model, seed)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_model_with_fused_kernels_and_chunked_loss_matches_reference(moe):
    """parallelize's kernel step on a model under selective recompute: every norm, rotary and
    activation (inside its checkpoint; the experts' too, which take the routing weights) and the
    loss are swapped, and the loss and every gradient match the reference model's."""
    from ultrascale.parallel.kernels import (
        ChunkedLoss, TritonRMSNormKernel, TritonRotary, TritonSwiGLU, apply_kernels,
    )
    from ultrascale.parallel.recompute import apply_recompute
    from ultrascale.parallel.seams import inner_of
    from ultrascale.models.llama import FeedForward
    from ultrascale.models.moe import GroupedExperts

    reference, fused = _small_model(moe=moe), _small_model(moe=moe)
    for model in (reference, fused):
        apply_recompute(model, "selective")
    apply_kernels(fused, "triton", chunked_loss=True, chunk_tokens=5)
    kinds = {type(m) for m in fused.modules()}
    assert {TritonRMSNormKernel, TritonRotary, TritonSwiGLU, ChunkedLoss} <= kinds
    assert (GroupedExperts in kinds) == moe
    acts = [inner_of(m.act) for m in fused.modules() if isinstance(m, (FeedForward,
                                                                       GroupedExperts))]
    assert [type(a) for a in acts] == [TritonSwiGLU] * 2
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in reference.named_parameters()]

    g = torch.Generator().manual_seed(8)
    tokens, targets = (torch.randint(0, 100, (2, 12), generator=g) for _ in range(2))
    losses = [m(tokens, None, targets) for m in (reference, fused)]
    for loss in losses:
        loss.backward()
    # The loss: 24 tokens' cross-entropies of 100 logits, each a few ulps apart (the kernels'
    # outputs differ from the references' by round-off only): 1e-6 relative.
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    # Each gradient: sums over the 24 tokens of products of activations that the kernels computed
    # a few ulps apart, carried back through two layers; as in the parity tests (tests/parity.py
    # GRAD_RTOL) each element within 1e-5 of its tensor's largest. Measured: at most 5.2e-7 under
    # the default, ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2 kernel paths (one
    # element relative to itself differed by 3.5e-5 on another machine: an element much smaller
    # than its tensor's largest carries their sums' round-off).
    ref_grads = dict(reference.named_parameters())
    worst = 0.0
    for name, p in fused.named_parameters():
        ref = ref_grads[name].grad
        scale = float(ref.abs().max())
        worst = max(worst, float((p.grad - ref).abs().max()) / scale)
        torch.testing.assert_close(p.grad, ref, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")
    print(f"fused model gradients: {worst:.1e} of their tensors' largest")  # pytest -s


def test_kernel_choice_and_refusals(monkeypatch):
    from ultrascale import kernels
    from ultrascale.config import ConfigError
    from ultrascale.parallel.support import check_supported
    from ultrascale.parallel.kernels import resolve_kernels
    from parity import make_config

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("auto", cpu, compiling=False) == "torch"
    assert resolve_kernels("triton", cpu, compiling=False) == "triton"  # the interpreter is on
    assert resolve_kernels("auto", cuda, compiling=True) == "torch"  # inductor fuses them itself
    assert resolve_kernels("auto", cuda, compiling=False) == "triton"
    check_supported(make_config(["training.kernels=triton", "device=cpu"]))

    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_kernels("auto", cpu, compiling=False) == "torch"
    with pytest.raises(ConfigError, match="training.kernels=triton: Triton kernels run on CUDA"):
        resolve_kernels("triton", cpu, compiling=False)
    with pytest.raises(ConfigError, match="training.kernels=triton: .*TRITON_INTERPRET=1"):
        check_supported(make_config(["training.kernels=triton", "device=cpu"]))
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    assert resolve_kernels("auto", cuda, compiling=False) == "torch"
    with pytest.raises(ConfigError, match="triton is not installed .pip install triton"):
        check_supported(make_config(["training.kernels=triton", "device=cuda"]))


def test_attention_backend_choice():
    """On CUDA: flash for half precision without a mask (head_dim a multiple of 8 up to 256),
    memory-efficient otherwise; never the math backend. PyTorch's fused kernel on a CPU."""
    assert ops.attention_backend(torch.randn(1, 2, 4, 8)) == "cpu"
    bf16, fp32 = torch.bfloat16, torch.float32
    assert ops.sdpa_backend("cuda", bf16, 64, masked=False) == "flash"
    assert ops.sdpa_backend("cuda", torch.float16, 256, masked=False) == "flash"
    assert ops.sdpa_backend("cuda", bf16, 64, masked=True) == "efficient"  # context parallel
    assert ops.sdpa_backend("cuda", fp32, 64, masked=False) == "efficient"
    assert ops.sdpa_backend("cuda", bf16, 320, masked=False) == "efficient"
    assert ops.sdpa_backend("cpu", bf16, 64, masked=False) == "cpu"


def test_measured_attention_choice_is_swapped_in_and_cached(monkeypatch):
    """The probe's choice (parallel/attention_backend.py): every plain attention core, under
    selective recompute's checkpoint too, becomes one naming the kernel; a cached result is not
    measured again; a CPU keeps PyTorch's fused kernel. `ops.attention` with a named kernel on a
    CPU computes what it computes without one (grouped kv heads expanded, the same numbers)."""
    from ultrascale.models.llama import CausalAttention
    from ultrascale.parallel import attention_backend as ab
    from ultrascale.parallel.recompute import apply_recompute

    model = _small_model()
    apply_recompute(model, "selective")
    assert ab.apply_attention_backend(model, torch.device("cpu"), torch.float32, 2, 12) \
        == ab.describe_cpu()
    calls = []

    def fake_probe(*args):
        calls.append(args)
        return {"backend": "cudnn+expand", "ms": {"cudnn+expand": 1.0, "flash": "refused: x"}}

    monkeypatch.setattr(ab, "probe", fake_probe)
    monkeypatch.setattr(ab, "_read_cache", lambda: {})
    monkeypatch.setattr(ab, "_write_cache", lambda key, result: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    line = ab.apply_attention_backend(model, torch.device("cuda"), torch.bfloat16, 2, 12)
    assert line.startswith("SDPA cudnn+expand") and "flash refused: x" in line
    cores = [m for m in model.modules() if type(m) is CausalAttention]
    assert cores and all(c.backend == "cudnn+expand" for c in cores)
    assert len(calls) == 1 and calls[0][2:6] == (2, 12, 4, 2)  # the run's shape, this rank's heads
    ab.choose_backend(*calls[0])
    assert len(calls) == 1  # measured once a process (and once a machine: the disk cache)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, h, 16, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(ops.attention(q, k, v, backend="cpu+expand"),
                               ops.attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_the_plain_loss_compiles_with_the_blocks():
    """training.compile rebases the plain loss onto its compiled class (torchtitan compiles its loss
    too); the chunked one stays eager. Nothing compiles until a forward runs."""
    from ultrascale.models.llama import LanguageModelLoss
    from ultrascale.parallel.compile import compile_blocks
    from ultrascale.parallel.kernels import ChunkedLoss

    model = _small_model()
    compile_blocks(model)
    assert type(model.criterion).__name__ == "CompiledLanguageModelLoss"
    assert isinstance(model.criterion, LanguageModelLoss)
    chunked = _small_model()
    chunked.criterion = ChunkedLoss()
    compile_blocks(chunked)
    assert type(chunked.criterion) is ChunkedLoss
