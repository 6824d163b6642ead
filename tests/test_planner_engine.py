"""The planner predicting our engine ranks only what the engine runs: every layout it ranks, written
as an `ultrascale train` config, passes the trainer's pre-launch checks (config validation and
`check_supported`; not the file-system ones). Other runtimes may rank more, marked as such."""

import pytest

from ultrascale.config import ConfigError, ModelConfig, build_config, layout_sections
from ultrascale.parallel.support import check_supported
from ultrascale.planner import get_hardware, plan
from ultrascale.planner.command import train_config
from ultrascale.planner.cost import uneven_pp_layers

# (preset, devices, global batch tokens, sequence length, GPU): 8k sequences (where context
# parallel is a candidate), uneven pipelines (28 and 126 layers), several GPU profiles.
CASES = [("llama3-8b", 8, 2**20, 8192, "h100"), ("llama3-70b", 64, 4 * 2**20, 4096, "h100"),
         ("llama3-1b", 16, 2**20, 4096, "a100"), ("llama3-3b", 32, 2**21, 4096, "b200"),
         ("llama3-405b", 512, 16 * 2**20, 8192, "h100")]


def _config(model: ModelConfig, layout) -> dict:
    data = {"model": model.model_dump(mode="json"), **layout_sections(layout)}
    stages = uneven_pp_layers(model, layout)
    if stages:
        data["parallel"]["pp_layers"] = stages
    return data


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[4]}-seq{c[3]}" for c in CASES])
def test_every_ranked_layout_passes_the_trainers_prelaunch_checks(case):
    preset, devices, tokens, seq, gpu = case
    model = ModelConfig(preset=preset)
    result = plan(model, devices, tokens, get_hardware(gpu), seq_len=seq, top=None)
    assert result.ranked
    for p in result.ranked:
        data = _config(model, p.layout)
        assert data == train_config(model, p.layout)  # what `ultrascale plan` writes
        check_supported(build_config(data))
        assert not p.unsupported


def test_the_issues_two_plans_rank_what_the_engine_runs_first():
    """llama3-8b on 8 H100s at 8k tokens ranked a cp=2 layout first; llama3-70b on 64 ranked
    zero_bubble with tp 4 third. Context parallel runs now (issue 28), and zero bubble under tp
    (issue 46): both plans' layouts are configs the engine takes, none left out."""
    h100 = get_hardware("h100")
    small = plan(ModelConfig(preset="llama3-8b"), 8, 2**20, h100, seq_len=8192)
    assert small.best.layout.cp == 2 and not small.best.unsupported
    check_supported(build_config(_config(ModelConfig(preset="llama3-8b"), small.best.layout)))
    big = plan(ModelConfig(preset="llama3-70b"), 64, 4 * 2**20, h100, seq_len=4096)
    assert big.left_out == 0
    # (4th of 5 since the estimator counts the flat gradient buffers the engine keeps, issue 48)
    zb = [p for p in big.ranked if p.layout.pp_schedule == "zero_bubble"
          and p.layout.tp > 1 and p.layout.pp > 1]
    assert zb and not zb[0].unsupported
    check_supported(build_config(_config(ModelConfig(preset="llama3-70b"), zb[0].layout)))


def test_another_runtime_ranks_more_and_marks_it(monkeypatch):
    """nanotron's plan keeps what ours would refuse, marked with the reason; ours leaves it out.
    No gap of our engine is left (rules/engine.py), so one is written here as a gap would be:
    context parallelism refused."""
    from ultrascale import rules
    from ultrascale.planner.search import SearchSpace

    def cp_gap(model, lay):
        if lay.cp > 1:
            return rules.Violation("parallel.cp", lay.cp, "context parallelism is not "
                                   "implemented", "set parallel.cp=1", gap=True)
        return None

    monkeypatch.setattr(rules.engine, "ENGINE_GAPS", (cp_gap,))
    model = ModelConfig(preset=None, hidden_size=1024, num_layers=8, num_heads=8,
                        num_kv_heads=2, ffn_hidden_size=2048, vocab_size=32000)
    space = SearchSpace(cp=[1, 2])
    result = plan(model, 8, 2**19, get_hardware("h100"), seq_len=4096, runtime="nanotron",
                  top=None, space=space)
    assert result.left_out == 0
    marked = [p for p in result.ranked if p.unsupported]
    assert marked and all(p.layout.cp > 1 for p in marked)
    assert all(p.as_dict()["ultrascale_refuses"] == p.unsupported for p in marked)
    assert all("context parallelism is not implemented" in p.unsupported[0] for p in marked)
    assert any(p.layout.cp == 1 for p in result.ranked)
    with pytest.raises(ConfigError, match="context parallelism is not implemented"):
        check_supported(build_config(_config(model, marked[0].layout)))
    ours = plan(model, 8, 2**19, get_hardware("h100"), seq_len=4096, top=None, space=space)
    assert ours.left_out > 0 and ours.ranked and all(p.layout.cp == 1 for p in ours.ranked)


def test_a_sliding_window_is_planned_with_ulysses_context_parallelism():
    """Ulysses runs a window shorter than the sequence inside the attention kernel (whole
    sequences per head), where ring and all-gather cp compute masked blocks: the plan's cp
    layouts take that mode, and each is accepted by the trainer's checks."""
    from ultrascale.planner.search import SearchSpace

    windowed = ModelConfig(preset=None, hidden_size=1024, num_layers=8, num_heads=8,
                           num_kv_heads=2, ffn_hidden_size=2048, vocab_size=32000,
                           sliding_window=1024)
    result = plan(windowed, 8, 2**19, get_hardware("h100"), seq_len=4096, top=None,
                  space=SearchSpace(cp=[1, 2]))
    with_cp = [p for p in result.ranked if p.layout.cp > 1]
    assert with_cp and result.left_out == 0
    assert {p.layout.cp_mode for p in with_cp} == {"ulysses"}
    check_supported(build_config(_config(windowed, with_cp[0].layout)))


def test_a_mixture_of_experts_is_planned_as_the_engine_runs_it():
    """Experts run with any tp (each expert split over tp) and any cp: the plan ranks such
    layouts, with ep and cp among them (ep and cp together too), each accepted by the trainer's
    checks; another runtime ranks tp > 1 too."""
    moe = ModelConfig(preset=None, hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2,
                      ffn_hidden_size=2048, vocab_size=32000, num_experts=8, experts_top_k=2)
    result = plan(moe, 8, 2**19, get_hardware("h100"), seq_len=16384, top=None)
    assert result.ranked
    assert any(p.layout.ep > 1 and p.layout.cp > 1 for p in result.ranked)
    for p in result.ranked[:20]:
        check_supported(build_config(_config(moe, p.layout)))
    other = plan(moe, 8, 2**19, get_hardware("h100"), seq_len=4096, runtime="nanotron", top=None)
    assert any(p.layout.tp > 1 for p in other.ranked)
