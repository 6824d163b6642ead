"""Counted communication and memory of one step against the ZeRO paper's formulas.

psi = parameters of the model, N = dp, 4 bytes an element (fp32). Buckets are padded to a
multiple of N elements so they cut into equal shards: psi_pad = sum of padded bucket lengths.

    stage  traffic per step (payload bytes, per rank)          held per rank after the step
    0      all-reduce 4 psi          (wire 2(N-1)/N x 4 psi)    params 4psi, grads 4psi, Adam 8psi
    1      reduce-scatter + all-gather, 4 psi_pad each          params 4psi, grads 4psi, Adam 8psi/N
    2      same as 1                                            params 4psi, grads 4psi/N, Adam 8psi/N
    3      all-gather 2 x 4 psi_pad + reduce-scatter 4 psi_pad  everything / N
"""

import pytest

from distributed import run_ranks
from zero_ranks import measure_step

N = 2
F32 = 4


@pytest.fixture(scope="module")
def measured():
    return {z: run_ranks(N, measure_step, [f"parallel.dp={N}", f"parallel.zero={z}",
                                           "parallel.bucket_mb=0.05"])
            for z in range(4)}


def dp_traffic(r):
    """(calls, payload bytes, wire bytes) per kind on the dp dimension."""
    return {k.split("/")[0]: v for k, v in r["traffic"].items() if k.endswith("/dp")}


@pytest.mark.parametrize("zero", range(4))
def test_traffic_matches_theory(measured, zero):
    for r in measured[zero]:
        psi, psi_pad, nb = r["psi"], sum(r["padded"]), len(r["padded"])
        assert psi <= psi_pad < psi + N * nb  # padding: less than N elements a bucket
        t = dp_traffic(r)
        wire = sum(w for _, _, w in t.values())
        if zero == 0:
            assert set(t) == {"all_reduce"}
            assert t["all_reduce"][:2] == (nb, F32 * psi)
            assert wire == pytest.approx(2 * (N - 1) / N * F32 * psi)
        elif zero in (1, 2):
            assert set(t) == {"reduce_scatter", "all_gather"}
            assert t["reduce_scatter"][:2] == (nb, F32 * psi_pad)
            assert t["all_gather"][:2] == (nb, F32 * psi_pad)
            # The same bytes on the wire as one all-reduce of the gradients.
            assert wire == pytest.approx(2 * (N - 1) / N * F32 * psi_pad)
        else:
            assert set(t) == {"reduce_scatter", "all_gather"}
            assert t["reduce_scatter"][1] == F32 * psi_pad
            # Each block gathered before its forward and again before its backward.
            assert t["all_gather"][1] == 2 * F32 * psi_pad
            assert (t["all_gather"][1] + t["reduce_scatter"][1]) / (F32 * psi) == \
                pytest.approx(3.0, rel=N * nb / psi)


@pytest.mark.parametrize("zero", range(4))
def test_memory_matches_zero_formulas(measured, zero):
    ranks = measured[zero]
    for r in ranks:
        m, psi, psi_pad = r["memory"], r["psi"], sum(r["padded"])
        # Adam: two moments per element plus a 4-byte step counter per optimized tensor.
        counters = F32 * (r["n_params"] if zero == 0 else r["segments"])
        sharded = {"params": zero >= 3, "grads": zero >= 2, "optimizer": zero >= 1}
        full = {"params": F32 * psi, "grads": F32 * psi, "optimizer": 2 * F32 * psi}
        for part, is_sharded in sharded.items():
            held = m[f"{part}_bytes"] - (counters if part == "optimizer" else 0)
            if not is_sharded:
                pad = F32 * (psi_pad - psi) if zero >= 1 and part != "optimizer" else 0
                assert held == full[part] + pad, part
            else:
                per_elem = full[part] // psi
                # 1/N of the padded total; the optimizer skips the padding elements.
                if part == "optimizer":
                    assert abs(held - full[part] / N) <= per_elem * (psi_pad - psi), part
                else:
                    assert held == per_elem * psi_pad // N, part
    if zero >= 1:  # the shards of the optimizer state cover the model exactly once
        total = sum(r["memory"]["optimizer_bytes"] - F32 * r["segments"] for r in ranks)
        assert total == 2 * F32 * ranks[0]["psi"]


@pytest.mark.parametrize("zero", [0, 1])
def test_hybrid_sharding_sends_a_shard_across_groups(zero):
    """dp=4 as 2 groups of 2: the gradients are reduce-scattered inside a group (dp_shard), and
    only the half each rank holds crosses groups (dp_replicate): the playbook's hierarchical
    all-reduce, 1/dp_shard of the bytes on the slow links."""
    for r in run_ranks(4, measure_step, ["parallel.dp=4", "parallel.dp_shard=2",
                                         f"parallel.zero={zero}", "parallel.bucket_mb=0.05"]):
        psi_pad, nb = sum(r["padded"]), len(r["padded"])
        t = {k: v for k, v in r["traffic"].items() if "/dp" in k}
        assert set(t) == {"reduce_scatter/dp_shard", "all_reduce/dp_replicate",
                          "all_gather/dp_shard"}
        assert t["reduce_scatter/dp_shard"][:2] == (nb, F32 * psi_pad)
        assert t["all_reduce/dp_replicate"][:2] == (nb, F32 * psi_pad // 2)
        assert t["all_gather/dp_shard"][:2] == (nb, F32 * psi_pad)


def test_hybrid_sharding_with_ep_sends_each_shard_across_groups():
    """dp=4 as 2 groups of dp_shard 2 with ep2 inside each (ZeRO-1): dense buckets are
    reduce-scattered inside the group and half of each crosses groups; an expert bucket's shard
    group is the one rank holding that expert in its group (no transfer), so the whole bucket is
    all-reduced across groups with the replica holding the same expert, and nothing else moves it
    over dp."""
    moe = ["model.num_experts=8", "model.experts_top_k=2", "model.moe_ffn_hidden_size=32",
           "model.first_k_dense=1"]
    for r in run_ranks(4, measure_step, moe + ["parallel.dp=4", "parallel.dp_shard=2",
                                               "parallel.ep=2", "parallel.zero=1",
                                               "parallel.bucket_mb=0.05"]):
        experts, nb_e = sum(r["expert_padded"]), len(r["expert_padded"])
        dense, nb_d = sum(r["padded"]) - experts, len(r["padded"]) - nb_e
        assert experts > 0 and dense > 0
        t = {k: v for k, v in r["traffic"].items() if "/dp" in k}
        assert set(t) == {"reduce_scatter/dp_shard", "all_reduce/dp_replicate",
                          "all_gather/dp_shard"}
        assert t["reduce_scatter/dp_shard"][:2] == (nb_d, F32 * dense)
        assert t["all_gather/dp_shard"][:2] == (nb_d, F32 * dense)
        assert t["all_reduce/dp_replicate"][:2] == (nb_d + nb_e, F32 * (dense // 2 + experts))
