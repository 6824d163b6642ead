"""The estimator against `ultrascale memory --measure` over the grid (issue 48): the committed rows
(benchmarks/data/memory_vs_measure.jsonl, `python benchmarks/memory_vs_measure.py`) against
today's estimate, and a small sample measured again here on two-layer models (the whole grid takes
half an hour: not in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ultrascale.memory.measure_grid import GRID, SMOKE, measure_row, summary, with_estimate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "data" / "memory_vs_measure.jsonl"


def _committed() -> list[dict]:
    return [with_estimate(json.loads(line)) for line in RESULTS.read_text().splitlines()]


def test_the_committed_grid_meets_the_acceptance():
    """Every layout of the grid measured, each within 300 s, on the five models; over the at least
    50 rows of the models the estimator describes, the estimate within 5% of the measurement at
    the median and 10% at worst (docs/memory.md's table; a model whose attention has no theory
    yet is left out: `measure_grid.uncovered`)."""
    rows = _committed()
    assert {r["row"] for r in rows} == {r.key for r in GRID}
    assert {r["model"] for r in rows} == {"llama3-8b", "llama3-70b", "mixtral-8x7b",
                                         "qwen3-30b-a3b", "deepseek-v3"}
    s = summary(rows)
    assert s["rows"] >= 50 and s["slowest_measure_s"] < 300
    assert s["median_abs_error"] <= 0.05
    assert s["worst_abs_error"] <= 0.10, (s["worst_row"], s["worst_abs_error"])


def test_the_grid_covers_every_dimension():
    text = " ".join(r.layout for r in GRID)
    for key in ("zero=0", "zero=1", "zero=2", "zero=3", "dp_shard", "tp=", "sp=true", "cp_mode=ulysses",
                "cp_mode=all_gather", "cp=", "ep=", "afab", "1f1b", "interleaved", "zero_bubble",
                "dualpipev", "zero3_gather=step", "zero3_gather=micro_batch", "recompute=selective",
                "recompute=full", "optimizer=muon", "dtype=fp32", "dtype=fp16", "dtype=fp8"):
        assert key in text, key


def test_a_sample_measured_again_matches_the_estimate():
    """Two rows of the grid on two-layer versions of their models (llama3-8b dp 8 ZeRO-1,
    mixtral-8x7b dp 8 ep 8), measured now: the estimate within 5% of each."""
    for row in SMOKE:
        result = with_estimate(measure_row(row, num_layers=2))
        assert abs(result["error"]) <= 0.05, (row.key, result["error"])
        assert result["seconds"] < 300


def test_muons_step_holds_its_updates_and_results():
    """Muon's optimizer step keeps two fp32 copies of the rank's matrix shards at once
    (optim/muon.py: the Nesterov updates, then the orthogonalised results): mixtral-8x7b under
    ep8 with ZeRO-1 peaks there (measured 129.4 GiB), which the estimate without them put 34%
    lower. Every Muon row of the committed grid within the grid's median target (5%)."""
    rows = [r for r in _committed() if "optimizer=muon" in r["row"]]
    assert len(rows) >= 5 and any(r["measured"]["phase"] == "optimizer step" for r in rows)
    for r in rows:
        assert abs(r["error"]) <= 0.05, (r["row"], r["error"])


def test_zero2_with_one_micro_batch_holds_a_bucket_not_a_layer():
    """ZeRO-2 with one micro-batch frees each bucket's full gradient once reduce-scattered, so a
    layer's backward holds the bucket being filled and the one before it (theory/data.py
    `_zero2_buckets`), not a layer's: a small model's view fits in one bucket, whole (the
    estimate with a layer's gradient read tiny-moe under cp4 33% low). Measured on fake tensors:
    the comm buffers at the peak are the whole fp32 gradient; the estimate within 5%; with
    buckets of 0.25 MB the estimate still within 5%."""
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout

    model = ModelConfig(preset="tiny-moe")
    for extra in ({}, {"bucket_mb": 0.25}):
        layout = Layout(cp=4, cp_mode="ring", zero=2, seq_len=1024, mbs=1, dtype="bf16",
                        **extra)
        got = measure(config_for(model, layout)).as_dict()
        if not extra:
            assert got["comm_buffers"] == 4 * model.num_params()
        est = estimate(model, layout)
        assert abs(est.total - got["total"]) <= 0.05 * got["total"], (extra, est.total, got)


def test_zero3_layer_backward_holds_the_gradient_in_flight_before_it():
    """ZeRO-3: a layer's backward holds its own full gradient and the one of the layer whose
    backward ran just before, its reduce-scatter in flight until the next launch
    (theory/data.py `_layer_backward`). Three mixtral-8x7b layers (dp 8, no ep), where the
    estimate with one gradient read 20% low: within 5% of the engine's step on fake tensors."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="mixtral-8x7b", num_layers=3)
    layout = Layout(dp=8, zero=3, seq_len=1024, mbs=1, dtype="bf16")
    got = measure(config_for(model, layout)).total
    assert abs(estimate(model, layout).total - got) <= 0.05 * got


def test_a_stage_without_the_loss_peaks_in_a_layer_backward():
    """A pipeline stage without the loss peaks in a layer's backward with its held activations:
    ours' SwiGLU backward rebuilds silu(gate) and, in an MoE layer, sums the routing weight's
    gradient over fp32 copies made a chunk at a time (theory/block.py
    `swiglu_backward_workspace`, models/swiglu.py); the RMSNorm's backward holds five fp32
    copies of the residual stream, whole under tp without sequence parallel
    (`norm_backward_workspace`). tiny-moe under pp2 (1F1B), and tiny under tp4 x pp2, where the
    estimate without them read 13% and 7.5% low: within 5% of the engine's step on fake
    tensors; the chunk is the model's."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure
    from ultrascale.models.swiglu import ROW_DOT_CHUNK
    from ultrascale.theory import block

    assert block.ROW_DOT_CHUNK == ROW_DOT_CHUNK
    for preset, layout in (
            ("tiny-moe", Layout(pp=2, pp_schedule="1f1b", grad_accum=4, seq_len=1024, mbs=2,
                                dtype="bf16")),
            ("tiny", Layout(tp=4, pp=2, pp_schedule="1f1b", grad_accum=4, seq_len=1024, mbs=1,
                            dtype="bf16"))):
        model = ModelConfig(preset=preset)
        got = measure(config_for(model, layout)).total
        assert abs(estimate(model, layout).total - got) <= 0.05 * got, (preset, got)



def test_a_rebuilt_layer_meets_its_backward_workspace_not_the_loss():
    """Under full recomputation a layer's backward holds its rebuilt layer, its SwiGLU's or
    norm's workspace and the gradient bucket being filled at once, after the loss's backward has
    freed the final norm's and the loss's tensors (memory/estimator.py `_meeting_transients`).
    With the largest of them alone, tiny-moe read 10% low under ZeRO-2 and 16% under ZeRO-3:
    within 5% of the engine's step on fake tensors."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="tiny-moe")
    for extra in ({"dp": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}):
        layout = Layout(recompute="full", seq_len=128, mbs=2, dtype="fp32",
                        grad_accum_dtype="fp32", **extra)
        got = measure(config_for(model, layout)).as_dict()
        est = estimate(model, layout)
        assert "recomputed layer" in est.transient_parts, est.transient_parts
        assert abs(est.total - got["total"]) <= 0.05 * got["total"], (extra, est.total, got)


def test_zero2_buffers_come_after_the_first_backward_where_every_forward_comes_first():
    """ZeRO-2 with micro-batches to accumulate fills its whole fp32 gradient buffers a bucket at
    a time in the first backward; under all-forward-all-backward every forward has run by then,
    so the buffers meet one micro-batch's activations fewer than the peak, and the layers'
    backward meets their first bucket only (theory/data.py `ZERO2_GRADS`, memory/estimator.py
    `_fold`). With the buffers whole beside every activation, this model (tiny's layers at
    hidden 512 and a 32k vocabulary) read 13% high under dp8 x pp2 with 2 micro-batches: within
    5% of the engine's step on fake tensors."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="tiny", hidden_size=512, ffn_hidden_size=1536, num_heads=8,
                        num_kv_heads=4, vocab_size=32000)
    layout = Layout(dp=8, pp=2, zero=2, pp_schedule="afab", grad_accum=2, seq_len=1024, mbs=1,
                    dtype="bf16")
    got = measure(config_for(model, layout)).total
    assert abs(estimate(model, layout).total - got) <= 0.05 * got, got


def test_zero_over_one_rank_holds_what_zero_0_holds():
    """ZeRO over a shard group of one rank (dp1, cp1) runs as zero 0 (parallel/apply.py), as the
    estimator counts it and the run's note says: ZeRO-2's full buffers beside its one "shard"
    and ZeRO-3's gathered copies held tiny 12% and 9% over zero 0 on fake tensors (with 4
    micro-batches) while the estimate stayed at zero 0's."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure_many

    model = ModelConfig(preset="tiny")
    layouts = [Layout(zero=z, grad_accum=4, seq_len=256, mbs=2, dtype="bf16") for z in (0, 2, 3)]
    plain, *sharded = [m.total for m in measure_many([config_for(model, lay)
                                                      for lay in layouts])]
    assert sharded == [plain, plain]
    for lay in layouts:
        assert abs(estimate(model, lay).total - plain) <= 0.02 * plain, lay.zero


def test_multi_token_predictions_block_backward_meets_the_main_loss():
    """Multi-token prediction's block runs its backward before the main model's layers, after
    its own loss's and final norm's backward but with the main loss's probabilities and final
    norm still held (memory/estimator.py `MTP_BACKWARD`): deepseek-v3's head stage (4 layers,
    dp32 tp4 pp2 ep4 ZeRO-2, zero bubble, full recompute) peaks there on fake tensors, 8.7% over
    the estimate that had every block's backward after the main loss's (6.5% after). Here
    tiny-deepseek: the rebuilt block and its workspace meet the main loss's tensors, the MTP
    head's are freed; within 10% of the engine's step on fake tensors."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="tiny-deepseek")
    layout = Layout(dp=2, zero=2, recompute="full", seq_len=4096, mbs=1, dtype="bf16")
    est = estimate(model, layout)
    assert {"recomputed layer", "layer backward workspace"} <= set(est.transient_parts)
    assert set(est.freed_parts) == {"MTP final norm", "MTP loss probabilities (fp32)"}
    assert {"final norm", "loss probabilities (fp32)"} <= set(est.activation_parts)
    got = measure(config_for(model, layout)).total
    assert abs(est.total - got) <= 0.10 * got, (est.total, got)


def test_context_parallel_buffers_live_in_the_attentions_backward_only():
    """Context parallel's backward buffers (dq, dK/dV in fp32, the gathered K/V) live while a
    layer's attention runs its backward: a transient of the layer backward, of which the larger
    of them and the norm's or SwiGLU's workspace counts (memory/estimator.py `_one_workspace`).
    Counted beside every phase, tiny-moe under cp2 all-gather and full recompute (its peak in a
    norm's backward) read 12% high: within 5% of the engine's step on fake tensors."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="tiny-moe")
    layout = Layout(dp=4, tp=4, pp=2, cp=2, ep=4, zero=3, pp_schedule="1f1b", grad_accum=4,
                    cp_mode="all_gather", recompute="full", seq_len=256, mbs=2, dtype="bf16")
    got = measure(config_for(model, layout)).total
    assert abs(estimate(model, layout).total - got) <= 0.05 * got, got


def test_zero3_under_ep_releases_a_layers_gradient_a_view_at_a_time():
    """ZeRO-3 under ep keeps an MoE layer's routed experts in a view of their own, so its
    gradient goes in two pieces launched one after another (experts, whose backward comes first,
    then the rest), each in flight until the next launch (theory/data.py `_grads_held`): a
    layer's backward meets the last piece of the layer after it, not all of it. Two mixtral-8x7b
    layers under dp16 x ep8 with full recompute read 5.6% high counting the whole layer (four
    layers with cp2 Ulysses: +12.3%, +3.8% now): within 3% of the engine's step on fake
    tensors (their bytes do not depend on the machine)."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="mixtral-8x7b", num_layers=2)
    layout = Layout(dp=16, ep=8, zero=3, recompute="full", seq_len=2048, mbs=1, dtype="bf16")
    got = measure(config_for(model, layout)).total
    assert abs(estimate(model, layout).total - got) <= 0.03 * got, got


def test_the_chunked_loss_and_query_key_norms_are_counted():
    """`training.chunked_loss` keeps the gradients its forward made (the hidden states' and the
    head's, fp32) instead of the fp32 probabilities, and holds one chunk's logits at a time; the
    RMSNorms over each query and key head (Qwen3's `qk_norm`) keep their fp32 input and
    normalized copy as the block's norms do. A Qwen3-0.6B-shaped model (16 heads of 128 over a
    width of 1024, a 152k vocabulary, 4 layers, 4096 tokens): on fake tensors, within 2% with
    and without either; the estimate that ignores them (the layout without the chunked loss,
    the model without q/k norms) over 30% high and 3% low (beyond the 2%)."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure_many

    model = ModelConfig(preset=None, hidden_size=1024, num_layers=4, num_heads=16,
                        num_kv_heads=8, head_dim=128, ffn_hidden_size=3072, vocab_size=151936,
                        tie_embeddings=True, qk_norm=True)
    plain = model.model_copy(update={"qk_norm": False})
    base = Layout(seq_len=4096, mbs=1, dtype="bf16", chunked_loss=True)
    cases = [(model, base), (model, base.with_(chunked_loss=False)), (plain, base)]
    got = [m.total for m in measure_many([config_for(m, lay) for m, lay in cases])]
    for (m, lay), measured in zip(cases, got):
        assert abs(estimate(m, lay).total - measured) <= 0.02 * measured, (m.qk_norm, lay)
    assert estimate(model, base.with_(chunked_loss=False)).total > 1.3 * got[0]
    assert estimate(plain, base).total < 0.97 * got[0]


def test_a_sliding_window_is_measured_as_a_gpu_runs_it():
    """`--measure` makes a GPU's kernel choices on fake CPU tensors: a sliding window shorter
    than the sequence takes the variable-length flash kernel there, as on a GPU, which makes no
    [s, s] mask (the masked path, taken before, built one per layer: the estimate read 13.8%
    below the measurement on this shape). The estimate within 2%."""
    from ultrascale.config_model import ModelConfig
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate
    from ultrascale.memory.measured import config_for, measure

    model = ModelConfig(preset="tiny", sliding_window=64)
    layout = Layout(seq_len=1024, mbs=2, dtype="bf16")
    got = measure(config_for(model, layout)).total
    assert abs(estimate(model, layout).total - got) <= 0.02 * got


def test_the_gpu_suites_peaks_are_read_from_either_summary_format(tmp_path, monkeypatch):
    """`memory_vs_measure.py --gpu-results` reads the one-GPU peaks of run.py's summaries
    (`stages`) and of the 2026-11-27 ones (`sections`), and sets `--measure` beside each."""
    from ultrascale.memory import measure_grid

    seen = []

    def fake_measure(row, workers=1):
        seen.append(row.layout)
        return {"measured": {"total": 1.01 * 2**30}, "seconds": 0.0}

    monkeypatch.setattr(measure_grid, "measure_row", fake_measure)
    runs = [{"layout": "mbs1", "measured_bytes": 2**30},
            {"layout": "mbs2", "error": "OutOfMemoryError"}]
    for parts in ("stages", "sections"):
        path = tmp_path / f"{parts}.json"
        path.write_text(json.dumps({parts: {"memory": {"result": runs}}}))
        out = measure_grid.against_gpu(path)
        assert [r["layout"] for r in out] == ["mbs1"]
        assert out[0]["error"] == pytest.approx(0.01)
    assert seen == [measure_grid.GPU_SUITE_LAYOUTS["mbs1"]] * 2
