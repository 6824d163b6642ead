"""A mixture of experts from the command line: the issue's memory and plan commands answer, bad
layouts are refused before launch with the fix, and the auxiliary-loss-free bias balances the
experts (a short run here; docs/moe.md has the 200-step figures and the command)."""

from __future__ import annotations

import json

import pytest

from test_cli_user import run_cli
from ultrascale.config import ConfigError, build_config
from ultrascale.memory.estimator import estimate
from ultrascale.parallel.support import check_supported


def test_memory_of_mixtral_with_expert_parallel():
    code, out, err = run_cli("memory", "--preset", "mixtral-8x7b", "--ep", "8", "--dp", "16",
                             "--zero", "1", "--seq-len", "4096", "--gpu", "h100", "--json")
    assert code == 0, err
    est = json.loads(out)
    assert est["layout"]["ep"] == 8
    experts = est["experts"]
    # 8 experts of 3 x 4096 x 14336 in 32 layers, 1 of them per rank, bf16.
    assert experts["params"] == 32 * 3 * 4096 * 14336 * 2
    code, out, _ = run_cli("memory", "--preset", "mixtral-8x7b", "--ep", "8", "--dp", "16",
                           "--zero", "1", "--seq-len", "4096", "--gpu", "h100")
    assert "of which routed experts" in out and "MoE routing" in out


def test_plan_of_deepseek_v3_on_2048_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("plan", "--preset", "deepseek-v3", "--gpus", "2048", "--gpu", "h100",
                             "--global-batch-tokens", "16M", "--json")
    assert code == 0, err
    plan = json.loads(out)
    best = plan["ranked"][0]["layout_fields"]
    # The experts spread by ep, no context parallel at 4K tokens; whether a tp of 2 inside an
    # NVLink node beats none is the cost model's call (DualPipeV's pairs hiding the all-to-alls
    # tipped it to tp2 on H100s), not this test's.
    assert best["ep"] > 1 and best["cp"] == 1 and best["tp"] <= 2
    assert best["dp"] * best["tp"] * best["pp"] == 2048


def _config(**parallel):
    model = parallel.pop("model", {})
    return {"model": {"preset": "tiny-moe", **model}, "parallel": {"dp": 1, **parallel}}


@pytest.mark.parametrize("parallel,key,fix", [
    (dict(dp=4, ep=3), "parallel.ep=3 must divide parallel.dp=4", "Choose ep among [1, 2, 4]"),
    (dict(dp=6, ep=3), "and model.num_experts=8", "Choose ep among [1, 2]"),
    (dict(dp=2, ep=2, model={"num_experts": 0}), "needs a mixture-of-experts model",
     "Set parallel.ep=1"),
    (dict(model={"experts_top_k": 9}), "model.experts_top_k=9 must be between 1 and "
     "model.num_experts=8", "Set experts_top_k to at most 8"),
    (dict(model={"first_k_dense": 5}), "model.first_k_dense=5 exceeds model.num_layers=4",
     "Choose first_k_dense between 0 and 4"),
])
def test_bad_layouts_are_refused_with_the_fix(parallel, key, fix):
    with pytest.raises(ConfigError) as err:
        build_config(_config(**parallel))
    assert key in str(err.value) and fix in str(err.value)
    args = [f"--set=parallel.{k}={v}" for k, v in parallel.items() if k != "model"]
    args += [f"--set=model.{k}={v}" for k, v in parallel.get("model", {}).items()]
    code, _, err_text = run_cli("train", "--set=model.preset=tiny-moe", *args, "--dry-run")
    assert code != 0 and key in err_text


def test_hybrid_sharding_takes_ep_inside_its_shard_groups():
    """ep with dp_shard runs when ep divides dp_shard (tests/test_expert_parallel.py), and the
    estimate shards each expert over dp_shard / ep ranks; otherwise it is refused with the fix."""
    cfg = build_config(_config(dp=8, ep=2, dp_shard=4))
    check_supported(cfg)
    lay = cfg.layout().with_(dtype="bf16", zero=1)
    experts = estimate(cfg.model, lay).experts["optimizer"]
    assert experts == pytest.approx(2 * estimate(cfg.model, lay.with_(dp_shard=None)).experts[
        "optimizer"])  # 2 expert shards a group against 4 over all of dp
    with pytest.raises(ConfigError, match="parallel.ep=2 must divide parallel.dp_shard=3"):
        build_config(_config(dp=6, ep=2, dp_shard=3))


def test_compile_pipeline_context_and_recompute_with_experts_pass_the_checks():
    for parallel, training in ((dict(dp=2, ep=2), {"compile": True}),
                               (dict(dp=2, ep=2, pp=2, zero=1), {"recompute": "full"}),
                               (dict(dp=2, ep=2, cp=2, zero=3), {"recompute": "full"}),
                               (dict(pp=2, cp=4, cp_mode="ulysses"), {"compile": True})):
        data = _config(**parallel) | {"training": training}
        check_supported(build_config(data))


def _imbalance_of_run(tmp_path, balance: str) -> tuple[list[float], list[dict]]:
    """80 steps of tiny-moe (2 layers, 16 sequences of 32 tokens) on one process: each step's
    max / mean expert load, and its MoE figures."""
    from ultrascale.train.trainer import train

    metrics = tmp_path / f"metrics-{balance}.jsonl"
    cfg = build_config({"model": {"preset": "tiny-moe", "num_layers": 2, "balance": balance},
                        "parallel": {"dp": 1},
                        "training": {"steps": 80, "seq_len": 32, "micro_batch_size": 16},
                        "logging": {"progress": False, "sample_tokens": 0, "every": 1,
                                    "metrics_file": str(metrics)}, "device": "cpu"})
    train(cfg, generate_sample=False)
    figures = [json.loads(line)["moe"] for line in metrics.read_text().splitlines()]
    return [f["load_max_over_mean"] for f in figures], figures


# The mean max / mean load of the last 10 steps, measured over seeds 1234 and 1-4 under the
# default and ATEN_CPU_CAPABILITY=avx2 kernel paths (MKL_ENABLE_INSTRUCTIONS=AVX2 gives the
# default's): 1.69-2.92 with the bias, 3.85-4.00 without. The threshold keeps a margin of 0.38
# above the worst balanced run and 0.55 below the best unbalanced one.
BALANCED_BELOW = 3.3


def test_the_aux_free_bias_balances_the_experts(tmp_path):
    """A shorter version of docs/moe.md's run: the router collapses early onto two experts per
    layer (max / mean load near E / k = 4, where a run without balancing stays), then the bias,
    moved by the measured load after each step, spreads the tokens again."""
    imbalance, figures = _imbalance_of_run(tmp_path, "aux_free")
    unbalanced, _ = _imbalance_of_run(tmp_path, "none")  # the control: the same run, no bias
    assert len(imbalance) == 80 and max(imbalance[:20]) > 3.8
    assert sum(imbalance[-10:]) / 10 < BALANCED_BELOW < sum(unbalanced[-10:]) / 10
    assert all(f["dropped_tokens"] == 0 and f["aux_loss"] == 0 for f in figures)
    assert figures[-1]["load_mean"] == 16 * 32 * 2 / 8