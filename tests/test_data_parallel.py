"""Bucketed, overlapped data-parallel reduction: the reductions really start during backward, only
the last micro-batch reduces, fp32 accumulation of low-precision gradients, refused settings."""

import pytest
import torch
from torch import nn

from distributed import run_ranks
from parity import make_config
from ultrascale.config import ConfigError
from ultrascale.distributed import comm
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.parallel.support import check_supported
from ultrascale.parallel.data import DataParallel
from zero_ranks import backward_timeline, zero3_forward_timeline

SMALL_BUCKETS = ["parallel.bucket_mb=0.05"]  # the tiny model spans several buckets


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_bucket_reductions_start_before_backward_ends(zero):
    out = run_ranks(2, backward_timeline, ["parallel.dp=2", f"parallel.zero={zero}"]
                    + SMALL_BUCKETS)
    for r in out:
        launches = [t for t, kind, tag in r["events"] if tag == "grad_bucket"]
        assert r["n_buckets"] >= 3
        assert len(launches) == r["n_buckets"]  # one reduction per bucket, none per micro-step
        # Every bucket but the one holding the embedding (whose gradient is the last one of the
        # backward) was launched while backward was still computing earlier layers.
        early = [t for t in launches if t < r["marks"]["embed_backward"]]
        assert len(early) == r["n_buckets"] - 1
        assert all(t < r["marks"]["backward_end"] for t in launches)
        assert r["launch_log"][-1] == r["embed_bucket"]


def test_no_reduction_before_the_last_micro_batch():
    """With 3 micro-batches every reduction is launched during the third backward."""
    out = run_ranks(2, backward_timeline, ["parallel.dp=2", "training.grad_accum_steps=3"]
                    + SMALL_BUCKETS)
    for r in out:
        launches = [t for t, kind, tag in r["events"] if tag == "grad_bucket"]
        assert len(launches) == r["n_buckets"]


def test_overlap_off_reduces_after_backward():
    out = run_ranks(2, backward_timeline, ["parallel.dp=2", "parallel.overlap=false"]
                    + SMALL_BUCKETS)
    for r in out:
        launches = [t for t, kind, tag in r["events"] if tag == "grad_bucket"]
        assert len(launches) == r["n_buckets"]
        assert all(t > r["marks"]["backward_end"] for t in launches)


def test_fp32_accumulation_of_bf16_gradients():
    """bf16 parameters accumulate their micro-batch gradients in an fp32 buffer, and their fp32
    master weights take the fp32 sum itself (no cast back to bf16); the step updates the masters
    and refreshes the bf16 parameters from them. The buffer is not zero-filled after the step:
    the next step's first micro-batch replaces what it holds."""
    ctx = ParallelContext.without_mesh("cpu")
    comm.set_context(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    dp = DataParallel(model, ctx, accum_dtype=torch.float32)
    inputs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(3)]
    expected = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for x in inputs:  # what each micro-batch contributes, summed in fp32
        model.zero_grad(set_to_none=True)
        grads = torch.autograd.grad(model(x).float().pow(2).sum(), list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            expected[n] += g.float()
    for i, x in enumerate(inputs):
        with dp.no_sync(last=i == 2):
            model(x).float().pow(2).sum().backward()
    bucket_grads = {n: b.grad_view(i).clone() for b in dp.buckets for i, n in enumerate(b.names)}
    dp.finish()
    for n, p in model.named_parameters():
        assert bucket_grads[n].dtype == torch.float32
        torch.testing.assert_close(bucket_grads[n], expected[n], rtol=1e-6, atol=1e-6)
        assert p.grad is None  # taken into the bucket
        master = dp.masters[n]
        assert master.dtype == torch.float32
        views = {m: b.grad_view(i) for b in dp.buckets for i, m in enumerate(b.names)}
        assert master.grad.data_ptr() == views[n].data_ptr()  # the bucket's fp32 sum, no copy
        torch.testing.assert_close(master.grad, expected[n], rtol=1e-6, atol=1e-6)
    before = {n: m.clone() for n, m in dp.masters.items()}
    dp.build_optimizer(1e-2, (0.9, 0.95), 0.0)
    dp.step(1e-2)
    for n, p in model.named_parameters():
        assert not torch.equal(dp.masters[n], before[n])  # the fp32 master moved
        assert torch.equal(p, dp.masters[n].to(torch.bfloat16))  # the bf16 copy follows it
    x = inputs[0]
    model(x).float().pow(2).sum().backward()
    dp.finish()
    grads = torch.autograd.grad(model(x).float().pow(2).sum(), list(model.parameters()))
    for (n, _), g in zip(model.named_parameters(), grads):  # the new step's gradient alone
        torch.testing.assert_close(dp.masters[n].grad, g.float(), rtol=1e-6, atol=1e-6)


def test_zero_composes_with_context_parallel():
    # ZeRO shards over dp x cp; parity: tests/test_context_parallel_parity.py (dp2 x cp2, ZeRO 1
    # and 3).
    for zero in (1, 2, 3):
        check_supported(make_config([f"parallel.zero={zero}", "parallel.cp=2", "parallel.dp=2"]))


def test_zero3_composes_with_pipeline_and_tensor_parallel():
    # Parity: tests/test_pipeline_parity.py (dp2 x pp2) and test_pipeline_tensor_parallel.py.
    check_supported(make_config(["parallel.zero=3", "parallel.pp=2", "parallel.dp=2",
                                 "parallel.tp=2", "training.grad_accum_steps=2"]))


def test_dp_shard_must_divide_dp():
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=3 does not divide parallel.dp=4"):
        make_config(["parallel.dp=4", "parallel.dp_shard=3"])


def test_hybrid_and_zero_settings_are_accepted():
    for overrides in (["parallel.dp=4", "parallel.dp_shard=2", "parallel.zero=3"],
                      ["parallel.dp=2", "parallel.zero=1"]):
        check_supported(make_config(overrides))


def test_zero3_prefetches_the_next_block():
    """ZeRO-3 asks for layer i+1's parameters before layer i computes, so that gather runs
    under layer i's forward."""
    for r in run_ranks(2, zero3_forward_timeline, ["parallel.dp=2", "parallel.zero=3"]):
        spans = [r["spans"][str(i)] for i in range(len(r["spans"]))]
        n_layers = len(spans)
        for i, (start, _) in enumerate(spans):
            # units gathered so far: the (tied) embedding, layers 0..i, and layer i+1 prefetched
            assert sum(t < start for t in r["gathers"]) == min(i + 3, n_layers + 1)
        assert len(r["gathers"]) == n_layers + 1  # each unit gathered once in a forward
