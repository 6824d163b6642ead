"""Hugging Face in and out: tiny random Llama, Qwen2, Qwen3 and Mistral models built by
transformers from a config (no download) and saved with save_pretrained give, imported into any
layout, transformers' logits; an exported run loads in transformers with our logits; import then
export returns the very same tensors; bad folders are refused naming the file or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers  # noqa: F401 (required by the tests: requirements-test.txt)
from safetensors.torch import load_file, save_file

import hf_models
from distributed import run_ranks
from ultrascale.config import ConfigError, build_config

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_models.save_models(tmp_path_factory.mktemp("hf"))


def test_each_architecture_reads_its_config_and_matches_transformers_in_one_process(hf_dir):
    inputs = hf_models.tokens()
    for name, folder in hf_dir.items():
        cfg, logits = hf_models.ours(folder, inputs)
        assert cfg.model.architecture == name
        torch.testing.assert_close(logits, hf_models.hf_logits(folder, inputs), rtol=0, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    qwen3 = build_config({"model": {"from_hf": str(hf_dir["qwen3"])}}).model
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.num_kv_heads) == (24, True, 1)
    assert build_config({"model": {"from_hf": str(hf_dir["qwen2"])}}).model.attention_bias
    llama = build_config({"model": {"from_hf": str(hf_dir["llama"])}}).model
    assert llama.rope_scaling.factor == 4.0 and llama.tie_embeddings


LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2},
           "dp2-tp2-pp2-zero3": {"dp": 2, "tp": 2, "pp": 2, "zero": 3}}
# Eight ranks cost the most: there, the two architectures with the most features (tied embeddings,
# rope scaling and vocabulary padding; q/k norms, a wide head_dim and a kv head tp keeps whole).
ARCHS = {"dp2-tp2-pp2-zero3": ("llama", "qwen3")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_into_a_layout_gives_transformers_logits(hf_dir, layout):
    """One spawn per layout, every architecture imported in it; each group of ranks holding the
    head gives the whole logits, and the gathered weights are the file's."""
    inputs = hf_models.tokens(seed=1)
    chosen = {n: f for n, f in hf_dir.items() if n in ARCHS.get(layout, hf_dir)}
    configs = {name: hf_models.layout_config(folder, LAYOUTS[layout])
               for name, folder in chosen.items()}
    world = build_config(next(iter(configs.values()))).parallel.world_size
    results = run_ranks(world, hf_models.import_and_logits, configs, inputs)
    for name, folder in chosen.items():
        expected = hf_models.hf_logits(folder, inputs)
        groups = hf_models.assemble(results, name)
        assert len(groups) == LAYOUTS[layout].get("dp", 1)
        for logits in groups:
            torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL,
                                       msg=lambda m, n=name: f"{layout} {n}: {m}")
        _assert_same_weights(results[0][name]["state"], folder, name)
        # The forward-only pipeline sends one activation (batch x seq x hidden, fp32) across each
        # stage boundary, from every (dp, tp) rank of the sending stage: nothing else over pp.
        lay = {"dp": 1, "tp": 1, "pp": 1, **LAYOUTS[layout]}
        activation = inputs.numel() * 64 * 4
        expected_bytes = (lay["pp"] - 1) * lay["dp"] * lay["tp"] * activation
        assert sum(r[name]["pp_sent"] for r in results) == expected_bytes
        assert sum(r[name]["pp_received"] for r in results) == expected_bytes


def _assert_same_weights(state, folder, arch):
    from ultrascale.hf_arch import hf_name

    theirs = load_file(str(folder / "model.safetensors"))
    for ours, t in state.items():
        assert torch.equal(t, theirs[hf_name(ours, arch)]), ours


def test_hf_to_ultrascale_to_hf_returns_identical_tensors(hf_dir, tmp_path):
    from ultrascale.checkpoint.hf import export_hf, load_pretrained
    from ultrascale.models.llama import Llama

    for name in ("llama", "qwen3"):
        folder = hf_dir[name]
        cfg = build_config({"model": {"from_hf": str(folder)}, "training": {"seq_len": 16}})
        model = Llama(cfg.model)
        load_pretrained(model, folder)
        out = export_hf(cfg, model.state_dict(), tmp_path / name, max_shard_bytes=200_000)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # sharded, with its index
        back = {}
        for f in set(index["weight_map"].values()):
            back.update(load_file(str(out / f)))
        original = load_file(str(folder / "model.safetensors"))
        assert back.keys() == original.keys() - {"lm_head.weight"} if cfg.model.tie_embeddings \
            else back.keys() == original.keys()
        for key, t in back.items():
            assert torch.equal(t, original[key]), key
        mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out, folder))
        for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                    "rope_parameters", "tie_word_embeddings", "max_position_embeddings"):
            assert mine.get(key) == theirs.get(key), key


def test_export_after_training_loads_in_transformers_with_our_logits(hf_dir, tmp_path):
    """5 steps of Qwen2 (biases) in one process, checkpointed; `ultrascale export` writes the
    folder; transformers loads it and gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from ultrascale.cli import main
    from ultrascale.config import Config
    from ultrascale.models.llama import Llama
    from ultrascale.train.trainer import train

    data = hf_models.layout_config(hf_dir["qwen2"])
    data["checkpoint"]["dir"] = str(tmp_path / "ck")
    data["logging"]["metrics_file"] = str(tmp_path / "metrics.jsonl")
    result = train(Config.model_validate(data), return_state=True, generate_sample=False)
    assert result.losses[-1] < result.losses[0]
    assert main(["export", str(result.checkpoint), "--to-hf", str(tmp_path / "out")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = Llama(Config.model_validate(data).model)
    ours.load_state_dict(result.final_state)
    inputs = hf_models.tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs), hf(inputs).logits, rtol=0, atol=ATOL)
        trained = hf.model.layers[0].self_attn.q_proj.bias
        assert not torch.equal(trained, load_file(str(hf_dir["qwen2"] / "model.safetensors"))[
            "model.layers.0.self_attn.q_proj.bias"])  # the biases were trained and exported


# -- refusals, each naming the file or tensor ------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architectures_are_refused_by_name(hf_dir, tmp_path):
    for arch, words in (("OlmoeForCausalLM", "mixture-of-experts"),
                        ("GPT2LMHeadModel", "cannot import or train")):
        folder = _copy(hf_dir["llama"], tmp_path / arch)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = [arch]
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=f"{arch}.*{words}"):
            build_config({"model": {"from_hf": str(folder)}})
    folder = _copy(hf_dir["llama"], tmp_path / "gelu")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        build_config({"model": {"hf_config": str(folder / "config.json")}})


def test_a_missing_shard_and_a_wrong_shape_are_refused_before_any_process_starts(
        hf_dir, tmp_path, capsys):
    from ultrascale.checkpoint.hf import export_hf, load_pretrained
    from ultrascale.cli import main
    from ultrascale.models.llama import Llama

    folder = hf_dir["mistral"]
    cfg = build_config({"model": {"from_hf": str(folder)}, "training": {"seq_len": 16}})
    model = Llama(cfg.model)
    load_pretrained(model, folder)
    sharded = export_hf(cfg, model.state_dict(), tmp_path / "sharded", max_shard_bytes=200_000)
    gone = sorted(sharded.glob("model-*.safetensors"))[1]
    gone.unlink()
    args = ["train", "--set", f"model.from_hf={sharded}", "--set", "training.seq_len=16",
            "--set", "parallel.dp=1", "--set", "logging.run_dir=" + str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert gone.name in err and "missing" in err
    assert not (tmp_path / "run" / "rank_logs").exists()  # nothing started

    bad = _copy(folder, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    args[2] = f"model.from_hf={bad}"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert name in err and "(128, 32)" in err and "model.safetensors" in err

    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"{name}.*in none of the safetensors"):
        load_pretrained(Llama(cfg.model), bad)


def test_a_bf16_run_imports_into_its_fp32_masters(hf_dir):
    """Under bf16 the optimizer steps fp32 masters: the import writes the folder's fp32 values
    there exactly, not their bf16 rounding (whole masters, or ZeRO-1/3's shards), and the bf16
    parameters are those values rounded."""
    from ultrascale import hf_arch
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize

    folder = hf_dir["qwen2"]  # q/k/v biases too
    theirs = load_file(str(folder / "model.safetensors"))
    for zero in (0, 1, 3):
        data = hf_models.layout_config(folder, {"zero": zero})
        data["precision"]["dtype"] = "bf16"
        cfg = Config.model_validate(data)
        ctx = init_parallel(cfg)
        comm.set_context(ctx)
        rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg,
                         pretrained=str(folder))
        state = rt.full_state_dict()
        for ours, t in state.items():
            want = theirs[hf_arch.hf_name(ours, cfg.model.architecture)]
            assert t.dtype == torch.float32 and torch.equal(t, want), (zero, ours)
            assert not torch.equal(want.to(torch.bfloat16).float(), want)  # rounding would show
        if zero < 3:  # ZeRO-3 gathers its parameters only for a forward
            for n, p in rt.module.named_parameters():
                assert p.dtype == torch.bfloat16 and torch.equal(p, state[n].to(torch.bfloat16))


def test_a_sliding_window_shorter_than_the_sequence_gives_transformers_logits(hf_dir,
                                                                            monkeypatch):
    """Mistral's window of 32 over 64 tokens: a query sees itself and the 31 keys before it, as
    transformers masks it (the definition); a window one key wider or narrower moves the logits
    far past the tolerance. Every layout takes it (ring attention too)."""
    from ultrascale.models import ops
    from ultrascale.parallel.support import check_supported

    inputs = torch.randint(0, hf_models.COMMON["vocab_size"], (2, 64),
                           generator=torch.Generator().manual_seed(1))
    cfg, logits = hf_models.ours(hf_dir["mistral"], inputs)
    assert cfg.model.sliding_window == 32
    expected = hf_models.hf_logits(hf_dir["mistral"], inputs)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    real = ops.attention
    for shift in (1, -1):
        monkeypatch.setattr(ops, "attention", lambda *a, window=None, _s=shift, **k: real(
            *a, window=None if window is None else window + _s, **k))
        _, wrong = hf_models.ours(hf_dir["mistral"], inputs)
        assert (wrong - expected).abs().max() > 100 * ATOL
    monkeypatch.setattr(ops, "attention", real)
    for layout in ({"tp": 2}, {"cp": 2}):
        check_supported(build_config({"model": {"from_hf": str(hf_dir["mistral"])},
                                      "training": {"seq_len": 64}, "parallel": layout}))


def test_a_window_over_some_layers_gives_transformers_logits_and_exports_back(tmp_path):
    """Qwen's window over some layers only, full attention over the others: by
    `max_window_layers` (Qwen2: the layers from 2 on) and by `layer_types` (Qwen3: every other
    layer), a window of 8 over 16 tokens. Our logits are transformers' (the definition); with
    the window on every layer, or on none, they are not; exported, the config slides the same
    layers and transformers' logits are ours again."""
    from transformers import Qwen2Config, Qwen3Config

    from ultrascale.checkpoint.hf import export_hf
    from ultrascale.models.llama import Llama

    common = {**hf_models.COMMON, "use_sliding_window": True, "sliding_window": 8}
    chosen = {"qwen2": Qwen2Config(**common, max_window_layers=2),
              "qwen3": Qwen3Config(**common, layer_types=["sliding_attention", "full_attention"]
                                   * 2)}
    folders = hf_models.save_models(tmp_path, chosen)
    inputs = hf_models.tokens()
    for name, layers in (("qwen2", [2, 3]), ("qwen3", [0, 2])):
        cfg, logits = hf_models.ours(folders[name], inputs)
        assert cfg.model.sliding_window_layers == layers
        expected = hf_models.hf_logits(folders[name], inputs)
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
        state = Llama(cfg.model).state_dict()
        for other in ({"sliding_window_layers": None},  # every layer slides
                      {"sliding_window": None, "sliding_window_layers": None}):  # none does
            model = Llama(cfg.model.model_copy(update=other))
            model.load_state_dict(dict(zip(state, _loaded(folders[name], cfg).values())))
            with torch.no_grad():
                assert (model(inputs) - expected).abs().max() > 100 * ATOL
        out = export_hf(cfg, _loaded(folders[name], cfg), tmp_path / f"{name}-out")
        written = json.loads((out / "config.json").read_text())
        kinds = ["sliding_attention" if i in layers else "full_attention" for i in range(4)]
        assert written["layer_types"] == kinds and written["use_sliding_window"]
        torch.testing.assert_close(hf_models.hf_logits(out, inputs), expected, rtol=0, atol=ATOL)


def test_linear_and_yarn_variants_give_transformers_logits_and_export_back(tmp_path):
    """Rope scalings beyond Llama 3.1's: position interpolation ("linear", factor 4) and YaRN with
    its attention factor given outright and its ramp ends unrounded (`truncate: false`), over 64
    tokens. Our logits are transformers' (the definition); with the setting dropped (no scaling,
    the factor YaRN derives, the ramp rounded) they are not; exported, the config says the same
    and transformers' logits are ours again."""
    from transformers import LlamaConfig, Qwen2Config

    from ultrascale.checkpoint.hf import export_hf
    from ultrascale.models.llama import Llama

    # The ramp over dimensions 1.4 to 4.4 of 8 (rounded: 1 to 5) for a 16-wide head.
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1}
    chosen = {
        "linear": LlamaConfig(**hf_models.COMMON, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "yarn-attention-factor": Qwen2Config(**hf_models.COMMON, rope_parameters={
            **yarn, "attention_factor": 1.3}),
        "yarn-untruncated": Qwen2Config(**hf_models.COMMON, rope_parameters={
            **yarn, "truncate": False}),
    }
    dropped = {"linear": None, "yarn-attention-factor": {"attention_factor": None},
               "yarn-untruncated": {"truncate": True}}
    folders = hf_models.save_models(tmp_path, chosen)
    inputs = torch.randint(0, hf_models.COMMON["vocab_size"], (2, 64),
                           generator=torch.Generator().manual_seed(2))
    for name, folder in folders.items():
        cfg, logits = hf_models.ours(folder, inputs)
        expected = hf_models.hf_logits(folder, inputs)
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
        scaling = cfg.model.rope_scaling
        off = None if dropped[name] is None else scaling.model_copy(update=dropped[name])
        model = Llama(cfg.model.model_copy(update={"rope_scaling": off}))
        model.load_state_dict(_loaded(folder, cfg))
        with torch.no_grad():
            assert (model(inputs) - expected).abs().max() > 100 * ATOL, name
        out = export_hf(cfg, _loaded(folder, cfg), tmp_path / f"{name}-out")
        written = json.loads((out / "config.json").read_text())["rope_parameters"]
        assert written["rope_type"] == scaling.type
        torch.testing.assert_close(hf_models.hf_logits(out, inputs), expected, rtol=0, atol=ATOL)


def _loaded(folder, cfg) -> dict:
    from ultrascale.checkpoint.hf import load_pretrained
    from ultrascale.models.llama import Llama

    model = Llama(cfg.model)
    load_pretrained(model, folder)
    return model.state_dict()


def test_hf_config_trains_the_architecture_with_fresh_weights_and_plan_names_it(hf_dir, capsys):
    from ultrascale.models.llama import build_model
    from ultrascale.planner.command import main as plan_main

    cfg = build_config({"model": {"hf_config": str(hf_dir["qwen3"] / "config.json")}})
    model = build_model(cfg.model, seed=0)
    assert model.layers["0"].attn.q_norm is not None and cfg.model.head_dim == 24
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params()
    assert plan_main(["--hf-config", str(hf_dir["qwen3"] / "config.json"), "--gpus", "8",
                      "--config-out", "none"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("qwen3 (Qwen3ForCausalLM) on 8 x")


def test_a_run_from_a_preset_exports_as_llama(tmp_path):
    """No Hugging Face folder behind it: config.json is written from the run's own keys."""
    from transformers import AutoModelForCausalLM

    from parity import TINY
    from ultrascale.checkpoint.gather import plain_state
    from ultrascale.checkpoint.hf import export_hf
    from ultrascale.models.llama import Llama
    from ultrascale.train.trainer import train

    cfg = build_config(TINY, ["training.steps=2", f"checkpoint.dir={tmp_path / 'ck'}"])
    result = train(cfg, generate_sample=False)
    run_cfg, state = plain_state(result.checkpoint)
    out = export_hf(run_cfg, state, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings
    ours = Llama(cfg.model)
    ours.load_state_dict(state)
    inputs = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs), hf(inputs).logits, rtol=0, atol=ATOL)


def test_a_larger_tokenizer_and_a_longer_sequence_than_the_pretrained_model_are_refused(
        hf_dir, tmp_path, capsys):
    """Issue 50, item 4: the fix for a tokenizer larger than model.from_hf's vocabulary was "set
    model.vocab_size", which the weights' shapes then refused; a seq_len beyond the model's
    max_position_embeddings was accepted without a word."""
    from test_data_formats import _tokenizer_folder

    from ultrascale.cli import main

    folder = _copy(hf_dir["llama"], tmp_path / "llama")  # 259 tokens, 64 positions
    tokenizer = _tokenizer_folder(tmp_path / "tok")  # 300 tokens
    base = ["train", "--set", f"model.from_hf={folder}", "--set", "parallel.dp=1",
            "--set", "logging.run_dir=" + str(tmp_path / "run")]
    assert main(base + ["--set", f"data.tokenizer={tokenizer}", "--set",
                        "training.seq_len=16"]) == 2
    err = capsys.readouterr().err
    assert "has 300 tokens" in err and "embeds 259" in err and "model.vocab_size" in err
    assert "set model.vocab_size" not in err and "does not hold" in err
    shutil.copy(tokenizer / "tokenizer.json", folder / "tokenizer.json")  # its own, larger here
    assert main(base + ["--set", f"data.tokenizer={tokenizer}", "--set",
                        "training.seq_len=16"]) == 2
    assert f"use the model's own tokenizer: data.tokenizer={folder}" in capsys.readouterr().err
    assert main(base + ["--set", "training.seq_len=128"]) == 2
    err = capsys.readouterr().err
    assert "training.seq_len=128" in err and "max_position_embeddings=64" in err
    assert "Set training.seq_len <= 64" in err
    assert not (tmp_path / "run" / "rank_logs").exists()  # nothing started
