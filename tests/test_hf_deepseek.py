"""DeepSeek-V3 (and V2) in and out of Hugging Face: tiny random DeepseekV3ForCausalLM and
DeepseekV2ForCausalLM models built by transformers from a config (no download) give, imported
into one process and into tp2, pp2, dp2 x ep2 and cp2, transformers' logits (1e-5); import then
export returns the very same tensors; a trained tiny-deepseek exports to a folder transformers
loads with our logits, whose multi-token prediction weights come back on import; the
group-limited router picks the experts transformers' picks; what the classes cannot hold is
refused by name.

The models (4 layers, 4 heads, 8 experts of 32, one shared, MLA with values narrower than queries
and keys):
- `v3`: a query latent, YaRN scaling with its softmax correction, the first layer dense, 8
  experts in 4 groups of which a token keeps 2, routed_scaling_factor 2.5, a random expert bias;
- `v3-no-q-lora`: one query projection, every layer a mixture of experts, no groups;
- `v2`: DeepSeek-V2's softmax router (greedy, not renormalised), routed_scaling_factor 1.5.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import hf_models
from distributed import run_ranks
from ultrascale.config import ConfigError, build_config

pytest.importorskip("transformers")
ATOL = 1e-5
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              vocab_size=259, max_position_embeddings=64, rms_norm_eps=1e-6,
              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def configs():
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        "v3": DeepseekV3Config(**COMMON, q_lora_rank=32, n_group=4, topk_group=2,
                               first_k_dense_replace=1, routed_scaling_factor=2.5,
                               rope_parameters=YARN),
        "v3-no-q-lora": DeepseekV3Config(**COMMON, q_lora_rank=None, n_group=1, topk_group=1,
                                         first_k_dense_replace=0),
        "v2": DeepseekV2Config(**COMMON, q_lora_rank=32, first_k_dense_replace=1,
                               topk_method="greedy", routed_scaling_factor=1.5),
    }


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    folders = hf_models.save_models(tmp_path_factory.mktemp("deepseek"), configs())
    # The expert bias is a buffer hf_models leaves at zero: give it values, saved with the rest.
    from safetensors.torch import save_file
    path = folders["v3"] / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 0.05 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folders


def test_each_deepseek_model_matches_transformers_in_one_process(ds_dir):
    inputs = hf_models.tokens()
    for name, folder in ds_dir.items():
        cfg, logits = hf_models.ours(folder, inputs)
        m = cfg.model
        assert m.attention == "mla" and m.architecture == ("deepseek_v2" if name == "v2" else
                                                           "deepseek_v3")
        torch.testing.assert_close(logits, hf_models.hf_logits(folder, inputs), rtol=0,
                                   atol=ATOL, msg=lambda msg, n=name: f"{n}: {msg}")
    v3 = build_config({"model": {"from_hf": str(ds_dir["v3"])}}).model
    assert (v3.router_groups, v3.router_topk_groups, v3.routed_scaling_factor) == (4, 2, 2.5)
    assert v3.rope_scaling.type == "yarn" and v3.rope_interleave and v3.first_k_dense == 1
    assert v3.balance == "aux_free" and v3.mtp_layers == 0  # transformers saved no MTP weights
    v2 = build_config({"model": {"from_hf": str(ds_dir["v2"])}}).model
    assert (v2.router, v2.router_renormalize, v2.routed_scaling_factor) == ("softmax", False, 1.5)


def _logits_by_position(results: list[dict], name: str, seq: int) -> list[torch.Tensor]:
    """The whole logits of each data-parallel group: tp ranks' vocabulary columns side by side,
    cp ranks' positions put back in order."""
    from ultrascale.parallel.context import SequenceShards

    groups: dict[int, dict] = {}
    for r in results:
        mine = r[name]
        if mine["logits"] is not None:
            groups.setdefault(mine["dp"], {})[(mine["cp"], mine["tp"])] = mine
    out = []
    for held in groups.values():
        cp = max(c for c, _ in held) + 1
        whole = None
        for c in range(cp):
            parts = sorted((t, m) for (cc, t), m in held.items() if cc == c)
            piece = torch.cat([m["logits"][..., :m["valid"]] if m["valid"] is not None
                               else m["logits"] for _, m in parts], dim=-1)
            if whole is None:
                whole = piece.new_zeros(piece.shape[0], seq, piece.shape[-1])
            positions = SequenceShards(cp).positions(seq, c) if cp > 1 else torch.arange(seq)
            whole[:, positions] = piece
        out.append(whole)
    return out


def import_and_logits(configs_by_name: dict[str, dict], inputs: torch.Tensor) -> dict:
    """In each rank: import each model into its layout, run a forward-only pass through the
    runtime, return this rank's logits and where they sit, and the gathered weights."""
    from ultrascale.config import Config
    from ultrascale.distributed import comm
    from ultrascale.distributed.mesh import init_parallel
    from ultrascale.models.llama import build_model
    from ultrascale.parallel.apply import parallelize
    from ultrascale.parallel.tensor import TensorParallelPlan

    out = {}
    for name, data in configs_by_name.items():
        cfg = Config.model_validate(data)
        ctx = init_parallel(cfg)
        comm.set_context(ctx)
        rt = parallelize(build_model(cfg.model, cfg.training.seed), ctx, cfg,
                         pretrained=cfg.model.from_hf)
        rt.build_optimizer(1e-3, (0.9, 0.95), 0.0)
        seen: list = []
        if rt.module.norm is not None:  # the last pipeline stage holds the head
            rt.module.criterion = hf_models.CaptureLogits(rt.module.criterion, seen)
        mine = inputs.chunk(cfg.parallel.dp)[ctx.coord("dp")]
        rt.evaluate([(mine, torch.zeros_like(mine))])
        plan = next((p for p in rt.parts if isinstance(p, TensorParallelPlan)), None)
        vocab = plan.vocab if plan is not None else None
        out[name] = {"logits": seen[0] if seen else None, "tp": ctx.coord("tp"),
                     "cp": ctx.coord("cp"), "dp": ctx.coord("dp"),
                     "valid": vocab.valid if vocab else None, "state": rt.full_state_dict()}
    return out


LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2-ep2": {"dp": 2, "ep": 2},
           "cp2": {"cp": 2}}
MODELS = {"tp2": ("v3", "v3-no-q-lora", "v2"), "pp2": ("v3",), "dp2-ep2": ("v3", "v2"),
          "cp2": ("v3",)}


@pytest.mark.slow
def test_import_into_each_layout_gives_transformers_logits(ds_dir):
    """One spawn of two ranks imports each model into each layout in turn; each data-parallel
    group's logits (tp's columns and cp's positions put together) are transformers', and the
    weights gathered back are the file's."""
    inputs = hf_models.tokens(seed=1)
    cases = {f"{layout}/{model}": hf_models.layout_config(ds_dir[model], LAYOUTS[layout])
             for layout, models in MODELS.items() for model in models}
    results = run_ranks(2, import_and_logits, cases, inputs)
    expected = {m: hf_models.hf_logits(ds_dir[m], inputs) for m in ds_dir}
    for case in cases:
        layout, model = case.split("/")
        groups = _logits_by_position(results, case, hf_models.SEQ)
        dp = LAYOUTS[layout].get("dp", 1)
        assert len(groups) == dp
        for d, logits in enumerate(groups):
            torch.testing.assert_close(logits, expected[model].chunk(dp)[d], rtol=0, atol=ATOL,
                                       msg=lambda m, c=case: f"{c}: {m}")
        _assert_same_weights(results[0][case]["state"], ds_dir[model],
                             "deepseek_v2" if model == "v2" else "deepseek_v3")


def _assert_same_weights(state, folder, arch):
    from ultrascale.hf_arch import hf_names, ours_only

    theirs = load_file(str(folder / "model.safetensors"))
    for ours, t in state.items():
        if ours_only(ours, arch):
            continue
        names = hf_names(ours, arch, 8)
        full = torch.stack([theirs[n] for n in names]) if len(names) > 1 else theirs[names[0]]
        assert torch.equal(t, full), ours


def test_hf_to_ultrascale_to_hf_returns_identical_tensors(ds_dir, tmp_path):
    from ultrascale.checkpoint.hf import export_hf, load_pretrained
    from ultrascale.models.llama import Llama

    for name in ("v3", "v2"):
        folder = ds_dir[name]
        cfg = build_config({"model": {"from_hf": str(folder)}, "training": {"seq_len": 16}})
        model = Llama(cfg.model)
        load_pretrained(model, folder)
        out = export_hf(cfg, model.state_dict(), tmp_path / name)
        back, original = (load_file(str(d / "model.safetensors")) for d in (out, folder))
        assert back.keys() == original.keys()
        for key, t in back.items():
            assert torch.equal(t, original[key]), key
        mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out, folder))
        for key in ("q_lora_rank", "kv_lora_rank", "n_group", "topk_group", "rope_parameters",
                    "routed_scaling_factor", "first_k_dense_replace", "n_routed_experts"):
            assert mine.get(key) == theirs.get(key), key


@pytest.mark.slow
def test_trained_tiny_deepseek_exports_to_transformers_and_its_mtp_comes_back(tmp_path):
    """3 steps of tiny-deepseek (its MTP module, the expert bias moved), checkpointed;
    `ultrascale export` writes a DeepseekV3ForCausalLM folder that transformers loads (reporting
    the MTP layer as a checkpoint of DeepSeek's own) with our logits; importing the folder back
    gives every tensor, the MTP module's included, and the MTP layer repeats the embedding and
    the head as DeepSeek's checkpoints do."""
    from transformers import AutoModelForCausalLM

    from ultrascale.checkpoint.hf import load_pretrained
    from ultrascale.cli import main
    from ultrascale.config import Config
    from ultrascale.models.llama import Llama
    from ultrascale.train.trainer import train

    data = build_config({
        "model": {"preset": "tiny-deepseek"},
        "training": {"seq_len": 16, "micro_batch_size": 2, "steps": 3, "warmup_steps": 0},
        "parallel": {"dp": 1}, "logging": {"progress": False, "sample_tokens": 0,
                                           "metrics_file": str(tmp_path / "m.jsonl")},
        "checkpoint": {"dir": str(tmp_path / "ck")}, "device": "cpu",
        "precision": {"dtype": "fp32"}}).model_dump(mode="json")
    result = train(Config.model_validate(data), return_state=True, generate_sample=False)
    state = result.final_state
    assert state["layers.1.mlp.gate.expert_bias"].abs().max() > 0
    assert main(["export", str(result.checkpoint), "--to-hf", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = Llama(Config.model_validate(data).model)
    ours.load_state_dict(state)
    inputs = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs), hf(inputs).logits, rtol=0, atol=ATOL)
    back_cfg = build_config({"model": {"from_hf": str(tmp_path / "out")}})
    assert back_cfg.model.mtp_layers == 1
    back = Llama(back_cfg.model)
    assert load_pretrained(back, tmp_path / "out") == len(back.state_dict())
    for name, t in back.state_dict().items():
        assert torch.equal(t, state[name]), name
    files = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(files["model.layers.4.embed_tokens.weight"], state["embed.weight"])
    assert torch.equal(files["model.layers.4.shared_head.head.weight"], state["output.weight"])
    assert torch.equal(files["model.layers.4.eh_proj.weight"], state["mtp.0.eh_proj.weight"])


def test_group_limited_routing_picks_the_experts_transformers_picks():
    """On the same router weights, bias and tokens, our router and transformers'
    DeepseekV3TopkRouter choose the same experts with the same weights; the groups matter (an
    unlimited router chooses otherwise for some tokens)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from ultrascale.models.moe import Router

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
        theirs.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=gen))
    ours = Router(32, 16, 4, "sigmoid", bias=True, groups=4, topk_groups=2, scaling=2.5)
    free = Router(32, 16, 4, "sigmoid", bias=True)
    for r in (ours, free):
        r.load_state_dict({"weight": theirs.weight.detach(),
                           "expert_bias": theirs.e_score_correction_bias.detach()})
    x = torch.randn(512, 32, generator=gen)
    with torch.no_grad():
        _, their_weights, their_ids = theirs(x)
        mine = ours(x)
        unlimited = free(x)
    order = their_ids.argsort(-1)
    assert torch.equal(mine.ids.sort(-1).values, their_ids.gather(-1, order))
    torch.testing.assert_close(mine.weights.gather(-1, mine.ids.argsort(-1)),
                               their_weights.gather(-1, order), rtol=1e-6, atol=1e-6)
    changed = (unlimited.ids.sort(-1).values != mine.ids.sort(-1).values).any(-1)
    assert 0 < int(changed.sum()) < 512


def test_what_deepseeks_classes_cannot_hold_is_refused(ds_dir, tmp_path):
    from ultrascale.hf_export import export_class
    from ultrascale.hf_arch import HFConfigError

    folder = tmp_path / "v2-groups"
    folder.mkdir()
    cfg = json.loads((ds_dir["v2"] / "config.json").read_text())
    cfg.update(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="topk_method='group_limited_greedy'.*not implemented"):
        build_config({"model": {"hf_config": str(folder)}})
    tiny = build_config({"model": {"preset": "tiny-deepseek"}, "parallel": {"dp": 1}}).model
    assert export_class(tiny) == "DeepseekV3ForCausalLM"
    for change, says in (({"router": "softmax"}, "router_renormalize=True cannot be written as "
                          "a DeepseekV2ForCausalLM: it never renormalises"),
                         ({"architecture": "deepseek_v3", "router": "softmax"},
                          "router='softmax'.*its router's scores are sigmoids"),
                         ({"mtp_layers": 1, "attention": "mha", "q_lora_rank": 0,
                           "kv_lora_rank": 0, "qk_rope_head_dim": 0, "qk_nope_head_dim": 0,
                           "v_head_dim": 0, "rope_interleave": False},
                          "mtp_layers=1 cannot be written as a LlamaForCausalLM: it has no "
                          "multi-token prediction")):
        with pytest.raises(HFConfigError, match=says):
            export_class(tiny.model_copy(update=change))
