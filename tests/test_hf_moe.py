"""Hugging Face mixtures of experts in and out: tiny random Mixtral, Qwen3-MoE and Qwen2-MoE models
built by transformers from a config (no download, `hf_models.moe_configs`) and saved with
save_pretrained (one tensor per expert) give, imported into one process, ep2 and pp2 x ep2,
transformers' logits within 1e-5; import then export returns the very same tensors; an exported
run loads in transformers with our logits; what our model cannot compute exactly is refused by
name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers  # noqa: F401 (required by the tests: requirements-test.txt)
from safetensors.torch import load_file

import hf_models
from distributed import run_ranks
from ultrascale.config import ConfigError, build_config

ATOL = 1e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return hf_models.save_models(tmp_path_factory.mktemp("hf_moe"), hf_models.moe_configs())


def _load(folder, **model_keys):
    from ultrascale.checkpoint.hf import load_pretrained
    from ultrascale.models.llama import Llama

    cfg = build_config({"model": {"from_hf": str(folder), **model_keys},
                        "training": {"seq_len": 16}})
    model = Llama(cfg.model)
    assert load_pretrained(model, folder) == len(model.state_dict()) - (
        cfg.model.num_layers if cfg.model.balance == "aux_free" else 0)  # the bias: ours alone
    return cfg, model


def _files(folder):
    index = folder / "model.safetensors.index.json"
    names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() \
        else {"model.safetensors"}
    out = {}
    for f in names:
        out.update(load_file(str(folder / f)))
    return out


def test_each_moe_architecture_reads_its_config_and_matches_transformers(moe_dir):
    inputs = hf_models.tokens()
    for name, folder in moe_dir.items():
        cfg, model = _load(folder)
        with torch.no_grad():
            torch.testing.assert_close(model(inputs), hf_models.hf_logits(folder, inputs),
                                       rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    keys = {name: build_config({"model": {"from_hf": str(f)}}).model
            for name, f in moe_dir.items()}
    m = keys["mixtral"]
    assert (m.architecture, m.num_experts, m.experts_top_k, m.router_renormalize,
            m.first_k_dense, m.shared_experts) == ("mixtral", 4, 2, True, 0, 0)
    q3 = keys["qwen3_moe"]
    assert (q3.first_k_dense, q3.moe_ffn_hidden_size, q3.ffn_hidden_size, q3.qk_norm,
            q3.router_renormalize, q3.head_dim) == (1, 32, 128, True, True, 24)
    q2 = keys["qwen2_moe"]
    assert (q2.shared_experts, q2.shared_expert_gate, q2.router_renormalize,
            q2.attention_bias) == (2, True, False, True)
    # output_router_logits is off in these configs: transformers trains them without its loss.
    assert {k.balance for k in keys.values()} == {"none"}
    assert m.aux_loss_coeff == pytest.approx(0.001 * 2 / 4)  # router_aux_loss_coef x k / layers
    # The key matters: Mixtral's top-1 weight is renormalised to 1, a plain softmax top-1's is not.
    _, plain = _load(moe_dir["mixtral-top1"], router_renormalize=False)
    with torch.no_grad():
        gap = (plain(inputs) - hf_models.hf_logits(moe_dir["mixtral-top1"], inputs)).abs().max()
    assert gap > 1e-2


LAYOUTS = {"ep2": {"dp": 2, "ep": 2},
           "dp2-pp2-ep2-zero1": {"dp": 2, "pp": 2, "ep": 2, "zero": 1}}
ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_into_expert_parallel_layouts_gives_transformers_logits(moe_dir, layout):
    """One spawn per layout, the three architectures imported in it: each rank reads the experts
    it keeps (setting up the layout, import included, sends nothing between ranks); every rank
    holding the head gives transformers' logits, and the weights gathered over ep and pp are the
    files' (each expert in its place)."""
    from ultrascale.hf_arch import hf_names

    inputs = hf_models.tokens(seed=1)
    configs = {name: hf_models.layout_config(moe_dir[name], LAYOUTS[layout]) for name in ARCHS}
    world = build_config(next(iter(configs.values()))).parallel.world_size
    results = run_ranks(world, hf_models.import_and_logits, configs, inputs)
    for name in ARCHS:
        groups = hf_models.assemble(results, name)
        assert len(groups) == LAYOUTS[layout]["dp"]
        expected = hf_models.hf_logits(moe_dir[name], inputs)
        for logits in groups:
            torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL,
                                       msg=lambda m, n=name: f"{layout} {n}: {m}")
        # Each rank read its own slices and experts from the files: no weight is sent between
        # ranks. The import writes what the optimizer steps (ZeRO's fp32 master shards), so under
        # ZeRO-1/2 the full parameters are then published from the shards by the all-gather that
        # ends every optimizer step, and nothing else moves.
        for r in results:
            setup = r[name]["setup_comm"]
            if LAYOUTS[layout].get("zero", 0) in (1, 2):
                assert setup and all(key.startswith("all_gather/") for key in setup), setup
            else:
                assert setup == {}, setup
        theirs = load_file(str(moe_dir[name] / "model.safetensors"))
        arch = build_config(configs[name]).model.architecture
        for ours, t in results[0][name]["state"].items():
            names = hf_names(ours, arch, 4)
            want = theirs[names[0]] if len(names) == 1 and t.dim() < 3 else \
                torch.stack([theirs[n] for n in names])
            assert torch.equal(t, want), ours


def test_hf_to_ultrascale_to_hf_returns_identical_tensors(moe_dir, tmp_path):
    from ultrascale.checkpoint.hf import export_hf

    for name in ARCHS:
        folder = moe_dir[name]
        cfg, model = _load(folder)
        out = export_hf(cfg, model.state_dict(), tmp_path / name, max_shard_bytes=200_000)
        back, original = _files(out), load_file(str(folder / "model.safetensors"))
        assert back.keys() == original.keys()
        for key, t in back.items():
            assert torch.equal(t, original[key]), key
        mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out, folder))
        for key in ("architectures", "num_experts", "num_local_experts", "num_experts_per_tok",
                    "intermediate_size", "moe_intermediate_size", "norm_topk_prob",
                    "mlp_only_layers", "decoder_sparse_step", "shared_expert_intermediate_size",
                    "router_aux_loss_coef", "output_router_logits", "qkv_bias"):
            assert mine.get(key) == theirs.get(key), (name, key)


def test_export_after_training_loads_in_transformers_with_our_logits(moe_dir, tmp_path):
    """3 steps of each architecture in one process with the auxiliary loss on (which exports as
    output_router_logits with transformers' coefficient), checkpointed; `ultrascale export` writes
    the folder; transformers loads it and gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from ultrascale.cli import main
    from ultrascale.config import Config
    from ultrascale.models.llama import Llama
    from ultrascale.train.trainer import train

    inputs = hf_models.tokens(seed=2)
    for name in ARCHS:
        data = hf_models.layout_config(moe_dir[name])
        data["model"].update(balance="aux_loss", aux_loss_coeff=0.01)
        data["training"]["steps"] = 3
        data["checkpoint"]["dir"] = str(tmp_path / name / "ck")
        data["logging"]["metrics_file"] = str(tmp_path / name / "metrics.jsonl")
        result = train(Config.model_validate(data), return_state=True, generate_sample=False)
        out = tmp_path / name / "out"
        assert main(["export", str(result.checkpoint), "--to-hf", str(out)]) == 0
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        ours = Llama(Config.model_validate(data).model)
        ours.load_state_dict(result.final_state)
        with torch.no_grad():
            torch.testing.assert_close(ours(inputs), hf(inputs).logits, rtol=0, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        exported = json.loads((out / "config.json").read_text())
        assert exported["output_router_logits"] is True
        moe_layers = 3 if name == "qwen3_moe" else 4  # Qwen3-MoE's first layer is dense
        assert exported["router_aux_loss_coef"] == pytest.approx(0.01 * moe_layers / 2)
        trained, original = _files(out), load_file(str(moe_dir[name] / "model.safetensors"))
        expert = next(k for k in trained if ".experts.1." in k)
        assert not torch.equal(trained[expert], original[expert])  # the experts were trained


def test_the_expert_bias_is_refused_on_export_unless_dropped(moe_dir, tmp_path):
    """balance=aux_free keeps a bias no Mixtral tensor holds: zero, it exports (it changes
    nothing); non-zero, export names it and refuses, unless told to drop it."""
    from ultrascale.checkpoint.hf import export_hf

    cfg, model = _load(moe_dir["mixtral"], balance="aux_free")
    state = model.state_dict()
    export_hf(cfg, state, tmp_path / "zero")
    assert _files(tmp_path / "zero").keys() == load_file(
        str(moe_dir["mixtral"] / "model.safetensors")).keys()
    state["layers.2.mlp.gate.expert_bias"] = torch.tensor([0.1, 0.0, -0.1, 0.0])
    with pytest.raises(ConfigError, match=r"layers\.2\.mlp\.gate\.expert_bias.*--drop-expert-bias"):
        export_hf(cfg, state, tmp_path / "biased")
    assert not (tmp_path / "biased").exists()
    export_hf(cfg, state, tmp_path / "dropped", drop_expert_bias=True)
    assert not any("expert_bias" in k for k in _files(tmp_path / "dropped"))


def test_balance_settings_map_both_ways(moe_dir, tmp_path):
    """output_router_logits turns our auxiliary loss on, its coefficient scaled by k / MoE
    layers (the same weight per layer near balance); export writes the imported value back."""
    from ultrascale.hf_export import export_config

    folder = shutil.copytree(moe_dir["qwen3_moe"], tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(output_router_logits=True, router_aux_loss_coef=0.003)
    (folder / "config.json").write_text(json.dumps(cfg))
    model = build_config({"model": {"from_hf": str(folder)}}).model
    assert model.balance == "aux_loss" and model.aux_loss_coeff == pytest.approx(0.003 * 2 / 3)
    written = export_config(model, cfg, max_positions=16)
    assert (written["router_aux_loss_coef"], written["output_router_logits"]) == (0.003, True)


# -- refusals, each naming the architecture or the feature ---------------------------------------


def _edited(src, dst, **changes):
    folder = shutil.copytree(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return folder


def test_features_our_model_lacks_are_refused_by_name(moe_dir, tmp_path):
    cases = [
        (moe_dir["mixtral"], {"architectures": ["DeepseekV3ForCausalLM"]},
         "DeepseekV3ForCausalLM.*lacks kv_lora_rank.*multi-head latent attention"),
        (moe_dir["mixtral"], {"architectures": ["OlmoeForCausalLM"]},
         "OlmoeForCausalLM.*q and k norms"),
        (moe_dir["mixtral"], {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        (moe_dir["qwen3_moe"], {"mlp_only_layers": [1]},
         r"mlp_only_layers=\[1\].*dense layers are \[1\].*first_k_dense"),
        (moe_dir["qwen3_moe"], {"mlp_only_layers": [], "decoder_sparse_step": 2},
         r"decoder_sparse_step=2: its dense layers are \[0, 2\]"),
        (moe_dir["qwen2_moe"], {"shared_expert_intermediate_size": 48},
         "shared_expert_intermediate_size=48.*multiple of moe_intermediate_size=32"),
    ]
    for i, (src, changes, words) in enumerate(cases):
        folder = _edited(src, tmp_path / str(i), **changes)
        with pytest.raises(ConfigError, match=words):
            build_config({"model": {"from_hf": str(folder)}})


def test_runs_that_no_hugging_face_class_holds_are_refused_on_export(moe_dir):
    from ultrascale.checkpoint.hf import hf_tensors
    from ultrascale.models.llama import Llama

    def refused(data, words):
        cfg = build_config(data)
        with torch.device("meta"):
            state = Llama(cfg.model).state_dict()
        with pytest.raises(ConfigError, match=words):
            hf_tensors(cfg.model, state, torch.float32)

    # tiny-moe: a llama with experts exports as Mixtral, whose router is a softmax.
    refused({"model": {"preset": "tiny-moe"}}, "model.router='sigmoid'.*MixtralForCausalLM")
    refused({"model": {"preset": "tiny-moe", "router": "softmax", "first_k_dense": 1}},
            "model.first_k_dense=1.*MixtralForCausalLM")
    refused({"model": {"from_hf": str(moe_dir["qwen3_moe"]), "shared_experts": 1}},
            "model.shared_experts=1.*Qwen3MoeForCausalLM")
    refused({"model": {"from_hf": str(moe_dir["qwen2_moe"]), "shared_expert_gate": False}},
            "model.shared_expert_gate=False.*Qwen2MoeForCausalLM")
    refused({"model": {"from_hf": str(moe_dir["mixtral-top1"]), "router_renormalize": False}},
            "model.router_renormalize=False.*always renormalises")


def test_a_missing_or_misshapen_expert_is_refused_naming_the_tensor(moe_dir, tmp_path):
    from safetensors.torch import save_file

    from ultrascale.checkpoint.hf import check_folder

    cfg = build_config({"model": {"from_hf": str(moe_dir["mixtral"])}}).model
    tensors = load_file(str(moe_dir["mixtral"] / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**tensors, name: tensors[name][:, :64].contiguous()},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"{name} has shape \(64, 64\).*\(64, 128\).*"
                                          r"layers\.1\.mlp\.experts\.down_proj"):
        check_folder(cfg, bad)
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"{name}.*in none of the safetensors"):
        check_folder(cfg, bad)
