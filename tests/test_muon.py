"""Muon's pieces on one process: Newton-Schulz, which parameters it steps, and the counts the
estimator and the planner take from params.py (against the model's own parameters)."""

import json

import pytest
import torch

from parity import make_config
from ultrascale.layout import Layout
from ultrascale.memory.estimator import estimate
from ultrascale.optim.muon import is_matrix, newton_schulz, update_scale
from ultrascale.params import stage_matrix_params
from ultrascale.train.trainer import build_model


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (4, 24, 40)])
def test_newton_schulz_orthogonalises_each_matrix(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g)
    assert o.shape == g.shape and o.dtype == torch.float32
    # The quintic leaves every singular value in about [0.7, 1.2] (not exactly 1).
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25
    if len(shape) == 3:  # a stack of experts: each on its own
        for e in range(shape[0]):
            torch.testing.assert_close(o[e], newton_schulz(g[e]), rtol=1e-5, atol=1e-6)
    # Scale-free: the momentum's size does not matter, only its direction.
    torch.testing.assert_close(newton_schulz(1e3 * g), o, rtol=1e-4, atol=1e-5)
    assert update_scale(shape) == pytest.approx(0.2 * max(shape[-2:]) ** 0.5)


@pytest.mark.parametrize("overrides", [
    [],
    ["model.attention_bias=true", "model.qk_norm=true", "model.tie_embeddings=false"],
    ["model.num_experts=8", "model.experts_top_k=2", "model.moe_ffn_hidden_size=32",
     "model.first_k_dense=1", "model.shared_experts=1", "model.shared_expert_gate=true"],
], ids=["tiny", "bias-qknorm-untied", "moe-shared-gated"])
def test_matrix_count_matches_the_model(overrides):
    """params.py's count of Muon's matrices is the model's is_matrix parameters: the blocks'
    projections and experts, not the embedding, head, norms, biases, router or gates."""
    cfg = make_config(overrides)
    model = build_model(cfg.model, 1)
    muon = {n: p.numel() for n, p in model.named_parameters() if is_matrix(n, p.dim())}
    assert not any(k in n for n in muon for k in ("embed", "norm", "bias", "router", "gate."))
    assert any(n.endswith("q_proj.weight") for n in muon)
    dense, experts = stage_matrix_params(cfg.model, Layout(), cfg.model.num_layers, 0)
    assert dense + experts == sum(muon.values())


def test_the_estimate_counts_one_buffer_per_matrix():
    cfg = make_config([])
    adam = estimate(cfg.model, cfg.layout())
    muon = estimate(cfg.model, cfg.layout().with_(optimizer="muon"))
    matrices = sum(stage_matrix_params(cfg.model, Layout(), cfg.model.num_layers, 0))
    assert adam.optimizer - muon.optimizer == 4 * matrices
    assert (adam.params, adam.grads) == (muon.params, muon.grads)
    # ZeRO-1 over dp=2: each rank saves its half.
    lay = cfg.layout().with_(dp=2, zero=1)
    assert (estimate(cfg.model, lay).optimizer - estimate(cfg.model, lay.with_(optimizer="muon"))
            .optimizer) == 2 * matrices


def test_the_planner_costs_newton_schulz():
    from ultrascale.config import ModelConfig
    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware

    model, hw = ModelConfig(preset="llama3-8b"), get_hardware("h100")

    def extra(lay: Layout) -> float:
        """Muon's optimizer term over AdamW's."""
        return (predict(model, lay.with_(optimizer="muon"), hw).breakdown["optimizer"]
                - predict(model, lay, hw).breakdown["optimizer"])

    one = extra(Layout(dp=1, mbs=1, grad_accum=64, seq_len=4096))
    assert one > 0  # one rank runs every matrix's Newton-Schulz
    for zero in (0, 1):  # dealt over 8 replicas or shards (plus the all-to-alls)
        assert 0 < extra(Layout(dp=8, zero=zero, mbs=1, grad_accum=8, seq_len=4096)) < one / 4


def test_the_config_takes_muon_and_nothing_else():
    assert make_config(["training.optimizer=muon"]).training.optimizer == "muon"
    with pytest.raises(Exception, match="optimizer"):
        make_config(["training.optimizer=sgd"])


def test_plan_ranks_layouts_for_muon(tmp_path, capsys):
    """`ultrascale plan --optimizer muon`: the same layouts fit in less memory, and the config it
    writes trains with Muon."""
    import yaml

    from ultrascale.cli import main

    plans = {}
    for opt in ("adamw", "muon"):
        out = tmp_path / f"{opt}.yaml"
        capsys.readouterr()
        assert main(["plan", "--preset", "llama3-8b", "--gpus", "8", "--optimizer", opt,
                     "--config-out", str(out), "--json"]) == 0
        plans[opt] = (json.loads(capsys.readouterr().out), yaml.safe_load(out.read_text()))
    adam, muon = plans["adamw"][0]["ranked"][0], plans["muon"][0]["ranked"][0]
    assert muon["layout_fields"]["optimizer"] == "muon"
    assert muon["layout"] == adam["layout"] and muon["memory_bytes"] < adam["memory_bytes"]
    assert plans["muon"][1]["training"]["optimizer"] == "muon"


# -- the engine's Muon against references written apart from it ------------------------------------

MUON_MOE = ["model.num_experts=8", "model.experts_top_k=2", "model.moe_ffn_hidden_size=32",
            "model.first_k_dense=1", "training.optimizer=muon", "training.weight_decay=0.1",
            "training.lr=0.02"]
CHECKED = ("layers.0.mlp.up_proj.weight", "layers.1.mlp.experts.down_proj")  # tall; wide stack
STEPS = 3


def _engine_muon(grads: list[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """The trainer's optimizer path on one process (`parallelize`, `build_optimizer`,
    `finish_gradients`, `optimizer_step`) with the gradients set by hand: each step's weights of
    the checked tensors."""
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.parallel.apply import parallelize

    cfg = make_config(MUON_MOE)
    ctx = init_parallel(cfg)
    comm.set_context(ctx)
    t = cfg.training
    rt = parallelize(build_model(cfg.model, t.seed), ctx, cfg)
    rt.build_optimizer(t.lr, (t.beta1, t.beta2), t.weight_decay, "muon",
                       momentum=t.muon_momentum, ns_steps=t.muon_ns_steps)
    params = dict(rt.named_parameters())
    out = {n: [params[n].detach().clone()] for n in CHECKED}
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone() if n in step else torch.zeros_like(p)
        rt.finish_gradients()
        rt.optimizer_step(t.lr)
        for n in CHECKED:
            out[n].append(params[n].detach().clone())
    return out


def _written_muon(w0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, mu: float,
                  ns_steps: int, nesterov: bool = True) -> list[torch.Tensor]:
    """Muon as Keller Jordan's post and Moonlight's paper state it, in float64, one matrix (each
    of a stack) at a time: momentum m = mu m + g, the Nesterov direction g + mu m, its quintic
    Newton-Schulz orthogonalisation (a, b, c) = (3.4445, -4.7750, 2.0315) on the Frobenius-
    normalised matrix (its transpose when tall), decoupled weight decay, the update scaled by
    0.2 sqrt(max(rows, cols))."""
    a, b, c = 3.4445, -4.7750, 2.0315
    w, m = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64)
    out = [w0.double().clone()]
    for g in grads:
        g = g.double()
        m = mu * m + g
        direction = g + mu * m if nesterov else m
        for idx in (range(w.shape[0]) if w.dim() == 3 else [None]):
            d = direction[idx] if idx is not None else direction
            x = d.T if d.shape[0] > d.shape[1] else d
            x = x / (x.norm() + 1e-7)
            for _ in range(ns_steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            o = x.T if d.shape[0] > d.shape[1] else x
            target = w[idx] if idx is not None else w
            target.mul_(1 - lr * wd).add_(o, alpha=-lr * 0.2 * max(d.shape) ** 0.5)
        out.append(w.clone())
    return out


def _update_distance(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max over steps of |got_t - ref_t| / |ref_t - ref_0| (Frobenius): the error against how far
    the reference moved."""
    return max(float((g.double() - r).norm() / (r - ref[0]).norm())
               for g, r in zip(got[1:], ref[1:]))


def test_muon_matches_an_independent_reference_on_a_matrix_and_an_expert_stack():
    """Three steps with fresh gradients each step (so that momentum and Nesterov matter): the
    engine's weights against the float64 reference above within 1e-4 of how far they moved
    (fp32 Newton-Schulz: 5 iterations of products over 64-128 terms, ~1e-5 of round-off), and
    against torch.optim.Muon (torch 2.13: Nesterov, Moonlight's `match_rms_adamw` scale, the same
    coefficients; its Newton-Schulz runs in bfloat16, unit round-off 2^-8 = 3.9e-3, compounded
    over five iterations: within 4e-2). Without Nesterov the update moves by more than 4x either
    tolerance."""
    cfg = make_config(MUON_MOE)
    t = cfg.training
    gen = torch.Generator().manual_seed(7)
    model = build_model(cfg.model, t.seed)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    grads = [{n: torch.randn(shapes[n], generator=gen) * 1e-2 for n in CHECKED}
             for _ in range(STEPS)]
    engine = _engine_muon(grads)
    for name in CHECKED:
        w0, gs = engine[name][0], [g[name] for g in grads]
        written = _written_muon(w0, gs, t.lr, t.weight_decay, t.muon_momentum, t.muon_ns_steps)
        assert _update_distance(engine[name], written) < 1e-4, name

        # torch.optim.Muon: 2-D parameters only, so a stack is its experts one by one.
        mats = [w0.clone()] if w0.dim() == 2 else [w.clone() for w in w0]
        params = [torch.nn.Parameter(m) for m in mats]
        opt = torch.optim.Muon(params, lr=t.lr, weight_decay=t.weight_decay,
                               momentum=t.muon_momentum, nesterov=True,
                               ns_steps=t.muon_ns_steps, adjust_lr_fn="match_rms_adamw")
        theirs = [w0.clone()]
        for g in gs:
            for p, gi in zip(params, [g] if g.dim() == 2 else list(g)):
                p.grad = gi.clone()
            opt.step()
            theirs.append(torch.stack([p.detach() for p in params]).view_as(w0).clone())
        assert _update_distance(engine[name], [x.double() for x in theirs]) < 4e-2, name

        plain = _written_muon(w0, gs, t.lr, t.weight_decay, t.muon_momentum, t.muon_ns_steps,
                              nesterov=False)
        assert _update_distance(plain, written) > 4 * 4e-2, name


class _Replicas:
    """A mesh stand-in for the exchange's dealing: every view `n` ranks, no tp."""

    def __init__(self, n: int):
        self.n, self.views = n, {}

    def size(self, view: str) -> int:
        return self.n


def test_matrices_are_dealt_by_size_evenly():
    """Each rank's share of the elements it orthogonalises (parallel/muon_exchange.py `_deal`):
    within one matrix of 1/N, where round-robin by position left one rank of a 4-layer
    llama3-8b's 28 matrices at 8 replicas 22% of them; every rank deals the same slots alike."""
    from ultrascale.parallel.muon_exchange import MatrixExchange, MatrixSlot

    h, kv, f, n = 4096, 1024, 14336, 8
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)] * 4
    slots = [MatrixSlot(f"m{k}", torch.Size(s), None, replicated_over="dp")
             for k, s in enumerate(shapes)]
    owners = MatrixExchange(_Replicas(n), slots, ns_steps=5).zero_owner
    assert owners == MatrixExchange(_Replicas(n), slots, ns_steps=5).zero_owner
    sizes = [s.local_numel for s in slots]
    total, largest = sum(sizes), max(sizes)
    shares = [sum(x for x, o in zip(sizes, owners) if o == r) for r in range(n)]
    assert sum(shares) == total and max(shares) <= total / n + largest
    round_robin = [sum(x for k, x in enumerate(sizes) if k % n == r) for r in range(n)]
    assert max(round_robin) > 0.2 * total > max(shares)
