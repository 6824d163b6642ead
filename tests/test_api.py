"""The Python API of docs/api.md (issue 50): a checkpoint of any layout, a run folder or a Hugging
Face folder loads as a plain module on one process; its tokenizer and a sample; the memory
estimate and the plan as functions, giving what the commands print."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import hf_models
from distributed import run_ranks
from parity import TINY
from ultrascale import api
from ultrascale.config import ConfigError, build_config

DOC = (Path(__file__).parent.parent / "docs" / "api.md").read_text()


def _train_two_ranks(cfg: dict) -> dict:
    from ultrascale.train.trainer import train

    result = train(build_config(cfg), return_state=True, generate_sample=False)
    return {"state": result.final_state, "checkpoint": str(result.checkpoint)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A dp=2 ZeRO-1 run of the tiny model (its checkpoint split over two files), 3 steps."""
    root = tmp_path_factory.mktemp("api")
    cfg = json.loads(json.dumps(TINY))
    cfg["parallel"] = {"dp": 2, "zero": 1}
    cfg["training"].update(steps=3)
    cfg["checkpoint"] = {"dir": str(root / "run" / "checkpoints")}
    out = run_ranks(2, _train_two_ranks, cfg)[0]
    return root / "run", out


def test_a_checkpoint_of_two_ranks_loads_as_one_plain_module(run):
    folder, trained = run
    model = api.load(folder)  # the run folder: its newest checkpoint
    assert isinstance(model, torch.nn.Module) and not model.training
    for name, t in model.state_dict().items():
        assert torch.equal(t, trained["state"][name]), name
    same = api.load(trained["checkpoint"])
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(tokens), same(tokens))
        assert model(tokens).shape == (2, 8, model.cfg.vocab_size)
    tok = api.tokenizer(folder)
    text = api.generate(model, tok, "The ", max_new_tokens=8, seed=3)
    assert text.startswith("The ") and text == api.generate(same, tok, "The ",
                                                                  max_new_tokens=8, seed=3)
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        api.load(folder / "rank_logs")


def test_a_hugging_face_folder_loads_with_transformers_logits(tmp_path):
    pytest.importorskip("transformers")
    folder = hf_models.save_models(tmp_path, {"llama": hf_models.configs()["llama"]})["llama"]
    model = api.load(folder)
    tokens = hf_models.tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_models.hf_logits(folder, tokens),
                                   rtol=0, atol=1e-5)


def test_memory_and_plan_are_the_commands_answers(capsys):
    from ultrascale.cli import main

    est = api.estimate_memory("llama3-8b", dp=8, zero=1, seq_len=4096, gpu="h100")
    assert main(["memory", "--preset", "llama3-8b", "--dp", "8", "--zero", "1", "--seq-len",
                 "4096", "--gpu", "h100", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert (est.total, est.fits, est.params) == (cli["total"], cli["fits"], cli["params"])
    result = api.plan("llama3-8b", gpus=64, gpu="h100", global_batch_tokens="4M")
    assert main(["plan", "--preset", "llama3-8b", "--gpus", "64", "--gpu", "h100",
                 "--global-batch-tokens", "4M", "--json", "--config-out", "none"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert [p.layout.short() for p in result.ranked] == [r["layout"] for r in cli["ranked"]]
    assert result.best.step_time_s == cli["ranked"][0]["step_time_s"]
    narrowed = api.plan("llama3-8b", gpus=8, zero=[1], tp=[1])
    assert {(p.layout.zero, p.layout.tp) for p in narrowed.ranked} == {(1, 1)}
    one = api.plan("llama3-8b", gpus=8, zero=1, tp=1, recompute="full")  # one value, no list
    assert one.ranked and {(p.layout.zero, p.layout.tp, p.layout.recompute)
                           for p in one.ranked} == {(1, 1, "full")}


def test_the_api_refuses_what_the_commands_refuse():
    from ultrascale.planner.search import PlanError

    with pytest.raises(PlanError, match="at least 1 device"):
        api.plan("llama3-8b", gpus=0)
    with pytest.raises(PlanError, match="parallel.tp=0 must be at least 1"):
        api.plan("llama3-8b", gpus=8, tp=[2, 0])
    with pytest.raises(ValueError, match="not a fraction"):
        api.estimate_memory("tiny", device_memory=2**30, headroom=1.0)


def test_the_guide_names_the_api_and_nothing_else():
    named = set(re.findall(r"\bapi\.(\w+)\(", DOC))
    assert named == set(api.__all__), named


def test_importing_the_package_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from ultrascale import api; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
