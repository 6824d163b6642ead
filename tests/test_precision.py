"""Mixed precision on one process: `auto` resolved once, the refusals (with their reasons), what
`apply_precision` does to a model, fp32 master weights and fp32 gradient accumulation, the loss
scaler, and an exact resume in bf16 and fp16."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cli_helpers import FAST, ultrascale
from parity import make_config, train_rank
from ultrascale import devices, rules
from ultrascale.config import ConfigError, build_config
from ultrascale.layout import Layout, storage_bytes


def test_auto_resolves_to_one_dtype():
    assert devices.resolve_dtype("auto", cuda=True, flags=set()) == "bf16"
    assert devices.resolve_dtype("auto", cuda=False, flags={"avx512_bf16", "avx2"}) == "bf16"
    assert devices.resolve_dtype("auto", cuda=False, flags={"amx_bf16"}) == "bf16"
    assert devices.resolve_dtype("auto", cuda=False, flags={"avx2", "avx512f"}) == "fp32"
    for d in ("fp32", "bf16", "fp16", "fp8"):
        assert devices.resolve_dtype(d, cuda=False, flags=set()) == d
    here = devices.resolve_dtype("auto", cuda=False)
    assert here == ("bf16" if devices.cpu_computes_bf16() else "fp32")


def test_auto_is_resolved_once_when_the_config_is_validated():
    here = devices.resolve_dtype("auto", cuda=False)
    cfg = make_config(["precision.dtype=auto"])
    assert cfg.precision.dtype == cfg.layout().dtype == here
    assert build_config(cfg.model_dump()).precision.dtype == here  # read back: still the same
    assert build_config({}, ["device=cuda"]).precision.dtype == "bf16"
    # The validation context's `cuda` (the planner, a Slurm sweep) wins over this machine.
    assert build_config({}, ["device=cpu"], cuda=True).precision.dtype == "bf16"
    assert build_config({}, ["precision.dtype=fp16"], cuda=True).precision.dtype == "fp16"
    # A layout written by hand is never guessed from `auto`.
    assert [v.key for v in rules.value_violations(Layout(dtype="auto"))] == ["precision.dtype"]
    # fp8 keeps its parameters and activations in bf16.
    assert storage_bytes("fp8") == storage_bytes("bf16") == 2 and storage_bytes("fp32") == 4


def test_dry_run_and_the_run_files_show_the_resolved_dtype(tmp_path):
    proc = ultrascale("train", *FAST, "--dry-run", "--set", "logging.run_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    here = devices.resolve_dtype("auto", cuda=False)
    # The header lists only the settings that differ from the defaults: `auto` resolved to this
    # machine's dtype is not one of them, so the precision line is what says what runs.
    assert "precision: " + ("fp32 throughout" if here == "fp32" else
                            "bf16 parameters and activations, fp32 master weights") in proc.stdout
    assert "dtype: auto" not in proc.stdout


@pytest.mark.parametrize("overrides,key,reason", [
    (["precision.dtype=fp16", "precision.loss_scaling=none"], "precision.loss_scaling",
     "fp16 without loss scaling loses every gradient below"),
    (["precision.dtype=fp8", "precision.fp8_recipe=bogus"], "precision.fp8_recipe",
     "Input should be 'tensorwise', 'rowwise' or 'blockwise'"),
])
def test_bad_precision_is_refused_with_its_reason(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        make_config(overrides)
    assert key in str(err.value) and reason in str(err.value)


def test_unknown_recipe_in_the_rules():
    p = SimpleNamespace(dtype="fp8", fp8_recipe="per-channel", fp8_emulate=False,
                        loss_scaling="dynamic")
    (v,) = rules.precision_violations(p)
    assert (v.key, v.value) == ("precision.fp8_recipe", "per-channel")
    assert "tensorwise, rowwise, blockwise" in v.message


def test_fp8_recipe_the_device_lacks_is_refused_without_emulate(tmp_path):
    """torch's CPU scaled matmul takes tensor-wise and row-wise scales, not blocks: blockwise is
    refused before any process starts, with the reason and both ways out; fp8_emulate runs it."""
    from ultrascale.parallel.precision import apply_precision, native_fp8_recipes
    from ultrascale.models.llama import build_model

    cpu = torch.device("cpu")
    assert native_fp8_recipes(cpu) == ("tensorwise", "rowwise")
    proc = ultrascale("train", *FAST, "--set", "precision.dtype=fp8",
                      "--set", "precision.fp8_recipe=blockwise", cwd=tmp_path)
    assert proc.returncode != 0
    assert "The scaled matmul of this CPU does not run the blockwise FP8 recipe (it runs " \
           "tensorwise, rowwise)" in proc.stderr
    assert "precision.fp8_emulate=true" in proc.stderr
    assert "among tensorwise, rowwise" in proc.stderr
    # The engine refuses it the same way (a rank started by torchrun without our launcher).
    cfg = make_config(["precision.dtype=fp8", "precision.fp8_recipe=blockwise"])
    with pytest.raises(ConfigError, match="does not run the blockwise FP8 recipe"):
        apply_precision(build_model(cfg.model, 0), cfg.precision, cpu)
    emulated = make_config(["precision.dtype=fp8", "precision.fp8_recipe=blockwise",
                            "precision.fp8_emulate=true"])
    plan = apply_precision(build_model(cfg.model, 0), emulated.precision, cpu)
    assert plan.fp8.name == "blockwise" and not plan.fp8.native
    assert "EMULATED" in emulated.precision.summary()


def test_apply_precision_puts_parameters_in_the_compute_dtype():
    from ultrascale.models.llama import Linear, LinearMatmul, build_model
    from ultrascale.parallel.precision import Fp8Matmul, apply_precision

    cfg = make_config(["model.tie_embeddings=false"])
    for dtype, param in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                         ("fp16", torch.float16), ("fp8", torch.bfloat16)):
        model = build_model(cfg.model, 0)
        plan = apply_precision(model, cfg.precision.model_copy(update={"dtype": dtype}),
                               torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {param}
        assert (plan.scaler is not None) == (dtype == "fp16")
        fp8 = {n for n, m in model.named_modules()
               if isinstance(m, Linear) and isinstance(m.matmul, Fp8Matmul)}
        if dtype == "fp8":  # every linear of the blocks; the output head stays bf16
            assert fp8 == {n for n, m in model.layers.named_modules(prefix="layers")
                           if isinstance(m, Linear)} and len(fp8) == 7 * 4
            assert type(model.output.matmul) is LinearMatmul
        else:
            assert fp8 == set()


def test_fp8_leaves_the_routed_experts_in_bf16():
    """A mixture of experts under fp8: the linear layers of the blocks multiply in FP8, the shared
    experts' included; the routed experts (stacked weights run by grouped GEMM, not linear
    layers) stay bf16; the router (a bf16 weight) multiplies in fp32; the aux-free expert bias, a
    buffer, stays fp32. It trains."""
    from ultrascale.models.llama import Linear, build_model
    from ultrascale.parallel.precision import Fp8Matmul, apply_precision

    cfg = make_config(["model.num_experts=4", "model.experts_top_k=2", "model.shared_experts=1",
                       "model.moe_ffn_hidden_size=32", "model.first_k_dense=1",
                       "model.balance=aux_free", "model.router=sigmoid"])
    model = build_model(cfg.model, 0)
    apply_precision(model, cfg.precision.model_copy(update={"dtype": "fp8", "fp8_emulate": True}),
                    torch.device("cpu"))
    moe = model.layers["1"].mlp
    assert {moe.gate.weight.dtype, moe.experts.gate_proj.dtype, moe.experts.down_proj.dtype} \
        == {torch.bfloat16}
    assert moe.gate.expert_bias.dtype == torch.float32
    shared = [m for m in moe.shared_experts.modules() if isinstance(m, Linear)]
    assert len(shared) == 3 and all(isinstance(m.matmul, Fp8Matmul) for m in shared)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = moe.gate(x).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ moe.gate.weight.float().t())
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], None, tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and moe.experts.up_proj.grad.dtype == torch.bfloat16
    assert moe.experts.up_proj.grad.abs().sum() > 0


def test_loss_scaler():
    from ultrascale.parallel.precision import LossScaler

    s = LossScaler(init=1024.0, window=2)
    for overflow, scale in ((False, 1024), (False, 2048), (True, 1024), (False, 1024),
                            (True, 512), (False, 512), (False, 1024)):
        s.update(overflow)
        assert s.scale == scale
    assert s.skipped_steps == 2
    again = LossScaler(1.0, 2)
    again.load_state(s.state())
    assert (again.scale, again.clean_steps, again.skipped_steps) == (1024, 0, 2)


def test_one_process_masters_and_fp32_accumulation():
    """bf16 on one process (no buckets): the micro-batch gradients are summed in fp32 beside the
    fp32 masters, which the optimizer updates; the bf16 parameters follow them."""
    from ultrascale.checkpoint.index import VALUE, piece_key
    from ultrascale.checkpoint.resume import model_shapes
    from ultrascale.checkpoint.state import state_to_save
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import ParallelContext
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    cfg = make_config(["precision.dtype=bf16"])
    ctx = ParallelContext.without_mesh("cpu")
    comm.set_context(ctx)
    rt = parallelize(build_model(cfg.model, 0), ctx, cfg)
    owner = rt.data_parallel
    rt.build_optimizer(1e-2, (0.9, 0.95), 0.0)
    tokens = torch.randint(0, 256, (3, 2, 17), generator=torch.Generator().manual_seed(0))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    # What each micro-batch contributes, in bf16 as autograd makes it, summed in fp32.
    expected: dict[str, torch.Tensor] = {}
    for x, y in micro:
        loss = rt.module(x, None, y)
        grads = torch.autograd.grad(loss * 0.01, [p for _, p in owner.named])
        for (n, _), g in zip(owner.named, grads):
            assert g.dtype == torch.bfloat16
            expected[n] = expected.get(n, 0) + g.float()
    rt.forward_backward(micro, 0.01)
    rt.finish_gradients()
    for n, p in owner.named:
        assert p.grad is None and owner.masters[n].grad.dtype == torch.float32
        torch.testing.assert_close(owner.masters[n].grad, expected[n], rtol=0, atol=0)
    rt.clip_grad_norm(None)
    rt.optimizer_step(1e-2)
    for n, p in owner.named:
        assert torch.equal(p, owner.masters[n].to(torch.bfloat16))
    # What the optimizer steps and a checkpoint saves: the fp32 masters.
    held = {h.name: h.value for h in owner.held()}
    assert all(held[n] is owner.masters[n] for n, _ in owner.named)
    saved = state_to_save(rt, model_shapes(cfg.model))
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert torch.equal(saved[piece_key(VALUE, "embed.weight", (0, 0))],
                       owner.masters["embed.weight"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_resume_is_exact(tmp_path, dtype):
    """A checkpoint holds the fp32 masters, the optimizer state and (fp16) the loss scaler: a
    resumed run continues bit for bit."""
    base = [f"precision.dtype={dtype}", "precision.loss_scale_window=2",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2"]
    full = train_rank(make_config(base + ["training.steps=4",
                                          f"checkpoint.dir={tmp_path / 'full'}"]
                                  ).model_dump(mode="json"))
    train_rank(make_config(base + ["training.steps=2"]).model_dump(mode="json"))
    resumed = train_rank(make_config(base + ["training.steps=4", "checkpoint.resume=auto"]
                                     ).model_dump(mode="json"))
    assert len(full["losses"]) == 4 and resumed["losses"] == full["losses"][2:]
    for name, w in full["state"].items():
        assert torch.equal(resumed["state"][name], w), name


def test_estimator_and_cost_model_count_each_precision_as_implemented():
    """Bytes: bf16 and fp16 hold 2-byte parameters and activations, an fp32 gradient buffer and
    fp32 masters; fp8 holds the same (bf16 outside the matmuls). Rates: fp8 speeds up the blocks'
    matmuls only (attention, the head, the collectives stay bf16) and pays for quantising."""
    from ultrascale.config import ModelConfig
    from ultrascale.memory.estimator import estimate
    from ultrascale.planner.cost import block_times, predict
    from ultrascale.planner.hardware import PROFILES

    model = ModelConfig(preset="llama3-8b")
    base = Layout(dp=8, tp=2, sequence_parallel=True, mbs=1, seq_len=4096)
    est = {d: estimate(model, base.with_(dtype=d)) for d in ("fp32", "bf16", "fp16", "fp8")}
    psi = est["bf16"].params / 2  # parameters on a rank
    assert est["bf16"].grads == 4 * psi and est["bf16"].optimizer == 12 * psi
    assert est["fp32"].params == 4 * psi and est["fp32"].optimizer == 8 * psi
    for d in ("fp16", "fp8"):
        e = est[d]
        assert (e.params, e.grads, e.optimizer, e.activations) == (
            est["bf16"].params, est["bf16"].grads, est["bf16"].optimizer, est["bf16"].activations)
    h100 = PROFILES["h100"]
    bf16, fp8 = (block_times(model, base.with_(dtype=d), h100) for d in ("bf16", "fp8"))
    assert fp8["matmul_f"] < 0.7 * bf16["matmul_f"]
    assert fp8["attention_f"] == bf16["attention_f"]
    assert fp8["elementwise_f"] > bf16["elementwise_f"]
    p_bf16, p_fp8 = (predict(model, base.with_(dtype=d), h100) for d in ("bf16", "fp8"))
    assert p_fp8.breakdown["tp_comm"] == pytest.approx(p_bf16.breakdown["tp_comm"])
    assert p_fp8.step_time_s < p_bf16.step_time_s


def test_a_sweep_predicts_the_dtype_its_runs_compute_in(tmp_path):
    """A local sweep's base says auto: its predictions take the dtype the runs resolve to here."""
    import yaml

    from ultrascale.planner.cost import predict
    from ultrascale.planner.hardware import get_hardware
    from ultrascale.planner.sweep import load_grid
    from ultrascale.planner.sweep_report import add_predictions

    spec = {"base": {"model": {"preset": "tiny"}, "device": "cpu",
                     "training": {"steps": 3, "seq_len": 32, "warmup_steps": 1}},
            "out": str(tmp_path / "out"), "predict": "h100", "grid": {"parallel.dp": [1, 2]}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(spec))
    grid = load_grid(tmp_path / "grid.yaml")
    add_predictions(grid)
    here = devices.resolve_dtype("auto", cuda=False)
    for run, dp in zip(grid.runs, (1, 2)):
        cfg = make_config([f"parallel.dp={dp}"], base=spec["base"])
        want = predict(cfg.model, cfg.layout(), get_hardware("h100"),
                       memory=False)
        assert run.predicted["predicted_step_time_s"] == pytest.approx(want.step_time_s)
