"""The mixture of experts on one process (models/moe.py): the grouped GEMM against its per-expert
loop, the MoE against a token-by-token reference, the routers, capacity and dropped tokens, the
sequence-wise auxiliary loss (the same whatever the micro-batches), the z-loss, the expert bias
and its update, recording under full recomputation, names and initialisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ultrascale.config import ModelConfig, build_config
from ultrascale.distributed.mesh import ParallelContext
from ultrascale.models import grouped_gemm
from ultrascale.models.llama import FeedForward, build_model
from ultrascale.models.moe import MoE, Router
from ultrascale.parallel.apply import parallelize


def moe_config(**changes) -> ModelConfig:
    base = dict(preset=None, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=64, vocab_size=64, num_experts=4, experts_top_k=2,
                moe_ffn_hidden_size=16, first_k_dense=1)
    return ModelConfig(**{**base, **changes})


def moe_layer(seed: int = 0, **changes) -> MoE:
    model = build_model(moe_config(**changes), seed)
    return model.layers["1"].mlp


# -- grouped GEMM ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_grouped_gemm_equals_the_loop_forward_and_backward(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 1, 3])  # an expert without tokens among them
    x = torch.randn(int(counts.sum()), 32, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(5, 48, 32, generator=gen).to(dtype).requires_grad_()
    upstream = torch.randn(x.shape[0], 48, generator=gen).to(dtype)
    outs, grads = {}, {}
    for impl in ("grouped", "loop"):
        assert impl == "loop" or grouped_gemm.grouped_mm_applies(x, w)
        y = grouped_gemm.grouped_mm(x, w, counts, impl)
        grads[impl] = torch.autograd.grad(y, (x, w), upstream)
        outs[impl] = y.detach()
    torch.testing.assert_close(outs["grouped"], outs["loop"], rtol=tol, atol=tol)
    for a, b in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert grads["grouped"][1][1].abs().sum() == 0  # no rows, no gradient
    # A plain sum's expanded (stride-0) gradient reaches the grouped kernel contiguous.
    grouped_gemm.grouped_mm(x, w, counts).sum().backward()
    # Widths the kernel does not take (rows of 6 x 4 bytes) run the loop, with the same result.
    odd = torch.randn(5, 6, 32, generator=gen)
    assert not grouped_gemm.grouped_mm_applies(x.float(), odd)
    torch.testing.assert_close(grouped_gemm.grouped_mm(x.detach().float(), odd, counts),
                               grouped_gemm.grouped_mm_loop(x.detach().float(), odd, counts))


def test_moe_grouped_and_loop_paths_agree_in_a_layer():
    moe = moe_layer(shared_experts=1)
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2))
    results = []
    for impl in ("grouped", "loop"):
        moe.experts.impl = impl
        y = moe(x)
        results.append((y.detach(), *torch.autograd.grad(y, [x, *moe.parameters()], upstream)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- the MoE against a token-by-token reference ---------------------------------------------------

def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.gate(flat)
    e = moe.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(routing.ids.shape[1]):
            i = int(routing.ids[t, j])
            h = F.silu(flat[t] @ e.gate_proj[i].T) * (flat[t] @ e.up_proj[i].T)
            out[t] += routing.weights[t, j] * (h @ e.down_proj[i].T)
    if moe.shared_experts is not None:
        shared = moe.shared_experts(flat)
        if moe.shared_expert_gate is not None:  # Qwen2-MoE: sigmoid(w . x) per token
            shared = torch.sigmoid(flat @ moe.shared_expert_gate.weight.T) * shared
        out = out + shared
    return out.view_as(x)


@pytest.mark.parametrize("changes", [dict(), dict(experts_top_k=1), dict(router="sigmoid"),
                                     dict(shared_experts=2), dict(balance="aux_free"),
                                     dict(shared_experts=2, shared_expert_gate=True),
                                     dict(router_renormalize=False),
                                     dict(experts_top_k=1, router_renormalize=True)],
                         ids=["top2-softmax", "top1", "sigmoid", "shared", "aux-free",
                              "shared-gated", "top2-not-renormalised", "top1-renormalised"])
def test_moe_equals_the_token_by_token_reference(changes):
    moe = moe_layer(**{"balance": "none", **changes})  # the reference has no balancing loss
    if moe.gate.expert_bias is not None:  # a bias that changes the choice, not the weights
        moe.gate.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    up = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    got, ref = moe(x), reference_moe(moe, x)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    params = [p for p in moe.parameters()]
    g_got = torch.autograd.grad(got, [x, *params], up)
    g_ref = torch.autograd.grad(ref, [x, *params], up)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_routers():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10, 8, generator=gen)
    soft1 = Router(8, 4, 1, "softmax", bias=False)
    torch.nn.init.normal_(soft1.weight, generator=gen)
    r = soft1(x)
    # Softmax top-1 keeps the probability (the router learns from the output), top-k > 1 and
    # sigmoid renormalise over the chosen experts.
    torch.testing.assert_close(r.weights[:, 0], r.probs.max(-1).values)
    sig = Router(8, 4, 2, "sigmoid", bias=True)
    sig.weight.data.copy_(soft1.weight)
    r = sig(x)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(10))
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(10))
    # The bias decides the choice only: a large bias on expert 3 puts it in every token's top 2,
    # with the weight its own score gives it.
    sig.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    biased = sig(x)
    assert (biased.ids == 3).any(-1).all()
    scores = (x @ sig.weight.T).sigmoid()
    chosen = scores.gather(-1, biased.ids)
    torch.testing.assert_close(biased.weights, chosen / chosen.sum(-1, keepdim=True))
    # router_renormalize overrides: Mixtral renormalises even a top-1 (its weight is 1), Qwen-MoE
    # with norm_topk_prob off keeps the top-2 probabilities as they are.
    forced = Router(8, 4, 1, "softmax", bias=False, renormalize=True)
    forced.weight.data.copy_(soft1.weight)
    torch.testing.assert_close(forced(x).weights, torch.ones(10, 1))
    kept = Router(8, 4, 2, "softmax", bias=False, renormalize=False)
    kept.weight.data.copy_(soft1.weight)
    r = kept(x)
    torch.testing.assert_close(r.weights, r.probs.topk(2, dim=-1).values)


# -- balancing ------------------------------------------------------------------------------------

def test_aux_loss_is_sequence_wise_and_the_same_for_any_micro_batches():
    """DeepSeek-V3's form: per sequence alpha x sum_i f_i P_i, counted once per token of the
    sequence (the token loss's units). Four sequences at once, or two micro-batches of two,
    give the same summed loss and the same router gradient."""
    moe = moe_layer(aux_loss_coeff=0.1)
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(6))
    weight = moe.gate.weight
    moe.balance.reset()
    whole = moe.balance(moe.gate(x.reshape(-1, 32)), 4, 0)
    g_whole, = torch.autograd.grad(whole, weight)
    halves = [moe.balance(moe.gate(part.reshape(-1, 32)), 2, 0) for part in x.split(2)]
    g_halves, = torch.autograd.grad(sum(halves), weight)
    torch.testing.assert_close(sum(halves), whole)
    torch.testing.assert_close(g_halves, g_whole, rtol=1e-6, atol=1e-7)
    # By hand, for the first sequence.
    r = moe.gate(x[0])
    counts = torch.zeros(4).index_add_(0, r.ids.flatten(), torch.ones(12))
    f = counts * 4 / (2 * 6)
    expected = 0.1 * (f * r.probs.mean(0)).sum() * 6
    torch.testing.assert_close(moe.balance(r, 1, 0), expected)
    # Recorded (detached) and summed over the calls of the step.
    assert float(moe.balance.aux_sum) == pytest.approx(2 * whole.item() + expected.item(), rel=1e-5)
    assert moe.balance.load.sum() == 2 * 4 * 6 * 2 + 6 * 2


def test_balancing_losses_reach_the_router_scaled_like_the_token_loss():
    moe = moe_layer(z_loss_coeff=0.01, aux_loss_coeff=0.0, balance="none")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7))
    flat = x.reshape(-1, 32)
    grads = []
    for scale in (1.0, 0.25):
        moe.balance.loss_scale = scale
        y = moe(x)
        # The output is unchanged by the attached loss; backward of a zero loss on it leaves the
        # router only the z-loss gradient, times the scale.
        g, = torch.autograd.grad((y * 0).sum(), moe.gate.weight)
        grads.append(g)
    z = 0.01 * torch.logsumexp(flat @ moe.gate.weight.T, -1).pow(2).sum()
    g_z, = torch.autograd.grad(z, moe.gate.weight)
    torch.testing.assert_close(grads[0], g_z)
    torch.testing.assert_close(grads[1], 0.25 * g_z)
    assert float(moe.balance.z_sum) == pytest.approx(2 * z.item(), rel=1e-5)


def test_capacity_drops_and_counts():
    moe = moe_layer(capacity_factor=0.5)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(8))
    moe.balance.reset()
    y = moe(x)
    routing = moe.gate(x.reshape(-1, 32))
    capacity = math.ceil(0.5 * 16 * 2 / 4)
    load = torch.bincount(routing.ids.flatten(), minlength=4)
    assert moe.balance.dropped == int((load - capacity).clamp(min=0).sum()) > 0
    assert moe.balance.load.tolist() == load.tolist()  # the load counts demand, before drops
    # Kept choices are the first `capacity` of each expert in token order; the others add nothing.
    ids, dropped = moe.over_capacity(routing.ids)
    assert dropped == moe.balance.dropped
    assert torch.bincount(ids.flatten(), minlength=5)[:4].max() <= capacity
    full = moe_layer(capacity_factor=100.0)
    full.load_state_dict(moe.state_dict())
    dropless = moe_layer()
    dropless.load_state_dict(moe.state_dict())
    torch.testing.assert_close(full(x), dropless(x))
    assert not torch.allclose(y, dropless(x))


# -- the model ------------------------------------------------------------------------------------

def test_names_shapes_first_dense_layers_and_initialisation():
    cfg = moe_config(shared_experts=1, balance="aux_free")
    model = build_model(cfg, seed=3)
    assert isinstance(model.layers["0"].mlp, FeedForward)  # first_k_dense=1
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
              if n.startswith("layers.1.mlp.")}
    assert shapes == {
        "layers.1.mlp.gate.weight": (4, 32),  # Mixtral / Qwen-MoE's router name
        "layers.1.mlp.experts.gate_proj": (4, 16, 32),  # E stacked [out, in] linear weights
        "layers.1.mlp.experts.up_proj": (4, 16, 32),
        "layers.1.mlp.experts.down_proj": (4, 32, 16),
        "layers.1.mlp.shared_experts.gate_proj.weight": (16, 32),
        "layers.1.mlp.shared_experts.up_proj.weight": (16, 32),
        "layers.1.mlp.shared_experts.down_proj.weight": (32, 16),
    }
    assert dict(model.named_buffers()).keys() == {"layers.1.mlp.gate.expert_bias",
                                                  "layers.2.mlp.gate.expert_bias"}
    assert "layers.1.mlp.gate.expert_bias" in model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    gated = moe_config(shared_experts=1, shared_expert_gate=True)  # Qwen2-MoE's [1, hidden] gate
    assert tuple(build_model(gated, 0).layers["1"].mlp.shared_expert_gate.weight.shape) == (1, 32)
    assert sum(p.numel() for p in build_model(gated, 0).parameters()) == gated.num_params() \
        == cfg.num_params() + 2 * 32
    again, other = build_model(cfg, seed=3), build_model(cfg, seed=4)
    for (n, a), b, c in zip(model.state_dict().items(), again.state_dict().values(),
                            other.state_dict().values()):
        assert torch.equal(a, b), n
        if n.endswith(("gate_proj", "down_proj")):
            assert not torch.equal(a, c), n
    # MFU counts the active parameters: attention, router, shared and top-k routed experts.
    layer_attn = 2 * 32 * 32 + 2 * 32 * 16  # q, o and the grouped-query k, v
    active = (3 * (layer_attn + 2 * 32) + 3 * 32 * 64  # + norms; the dense first layer's MLP
              + 2 * (32 * 4 + (1 + 2) * 3 * 32 * 16) + 32)  # router, shared + 2 experts; final norm
    assert cfg.flops_per_token(16) == 6.0 * (active + 64 * 32) + 12.0 * 3 * 32 * 16
    # The residual-output projection of the experts is scaled like down_proj.weight.
    assert model.layers["1"].mlp.experts.down_proj.std() < model.layers["1"].mlp.experts.up_proj.std()


def _one_process_runtime(overrides):
    cfg = build_config({"model": {"preset": "tiny-moe", "num_layers": 2},
                        "parallel": {"dp": 1}, "device": "cpu", "precision": {"dtype": "fp32"},
                        "training": {"micro_batch_size": 2, "seq_len": 16}}, overrides)
    rt = parallelize(build_model(cfg.model, 0), ParallelContext.without_mesh(), cfg)
    rt.build_optimizer(1e-3, (0.9, 0.95), 0.0)
    return cfg, rt


def test_the_runtime_moves_the_expert_bias_and_reports_the_load():
    cfg, rt = _one_process_runtime(["model.bias_update_rate=0.01", "model.balance=aux_free"])
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(9))
    micro = [(tokens[:, :-1], tokens[:, 1:])]
    rt.forward_backward(micro, 1 / 32)
    loads = {k: b.mlp.balance.load.clone() for k, b in rt.module.layers.items()}
    rt.optimizer_step(1e-3)
    m = rt.moe_metrics()
    for k, block in rt.module.layers.items():
        load = loads[k]
        expected = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(block.mlp.gate.expert_bias, expected.float())
        assert m["load_max_over_mean_per_layer"][k] == pytest.approx(
            float(load.max() / load.mean()), abs=1e-4)
    assert m["load_mean"] == 32 * 2 / 8 and m["dropped_tokens"] == 0
    assert m["aux_loss"] == 0.0  # aux_free: no auxiliary loss


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_records_the_load_once_and_keeps_the_gradients(mode):
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(10))
    micro = [(tokens[:, :-1], tokens[:, 1:])]
    runs = []
    for recompute in ("none", mode):
        cfg, rt = _one_process_runtime([f"training.recompute={recompute}",
                                        "model.balance=aux_loss", "model.z_loss_coeff=0.01"])
        rt.forward_backward(micro, 1 / 32)
        runs.append(({k: b.mlp.balance.load.clone() for k, b in rt.module.layers.items()},
                     {n: p.grad.clone() for n, p in rt.module.named_parameters()}))
    (load_a, grad_a), (load_b, grad_b) = runs
    for k in load_a:
        assert torch.equal(load_a[k], load_b[k])
    for n in grad_a:
        torch.testing.assert_close(grad_b[n], grad_a[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("zero", [0, 1])
def test_resume_restores_the_expert_bias(zero, tmp_path):
    """The bias is a buffer, not a parameter: a checkpoint keeps it (ZeRO's shards too), and a
    run resumed from step 2 logs the uninterrupted run's losses and ends with its weights."""
    import shutil

    from ultrascale.train.trainer import train

    def run(*extra):
        cfg = build_config({"model": {"preset": "tiny-moe", "num_layers": 2},
                            "parallel": {"dp": 1, "zero": zero}, "device": "cpu",
                            "training": {"micro_batch_size": 2, "seq_len": 32, "steps": 4,
                                         "warmup_steps": 1},
                            "checkpoint": {"dir": str(tmp_path), "every": 2},
                            "logging": {"progress": False, "sample_tokens": 0}}, list(extra))
        return train(cfg, return_state=True, generate_sample=False)

    full = run()
    shutil.rmtree(tmp_path / "step_00000004")
    resumed = run("checkpoint.resume=auto")
    assert resumed.losses == full.losses[2:]
    bias = "layers.1.mlp.gate.expert_bias"
    assert full.final_state[bias].abs().max() > 0
    for name, t in full.final_state.items():
        assert resumed.final_state[name].equal(t), name
