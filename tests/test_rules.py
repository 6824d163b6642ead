"""Layout rules live once (the rules package): the config, the memory estimator and the engine's
pre-launch check refuse the same layouts with the same words."""

import pytest

from ultrascale import rules
from ultrascale.config import ConfigError, ModelConfig, build_config
from ultrascale.layout import Layout
from ultrascale.memory.estimator import LayoutError, estimate
from ultrascale.parallel.support import check_supported

TINY = ModelConfig(preset="tiny")  # 4 heads, 2 kv heads, ffn 384, 4 layers


def _config(**parallel):
    training = {k: parallel.pop(k) for k in ("seq_len", "grad_accum_steps") if k in parallel}
    return {"model": {"preset": "tiny"}, "parallel": {"dp": 1, **parallel},
            "training": {"micro_batch_size": 1, **training}}


def test_sequence_parallel_splits_each_context_parallel_ranks_tokens():
    """cp gives a rank seq_len / cp tokens and sequence parallel splits those over tp: tp must
    divide seq_len / cp, not only seq_len. 20 tokens over cp 2 leave 10 per rank, which tp 4
    cannot split, though it divides 20."""
    bad = Layout(tp=4, cp=2, seq_len=20, sequence_parallel=True)
    good = bad.with_(seq_len=40)
    assert [v.key for v in rules.layout_violations(TINY, bad)] == ["training.seq_len"]
    assert rules.layout_violations(TINY, good) == []
    with pytest.raises(ConfigError, match="10 tokens per context-parallel rank are not divisible "
                                          "by parallel.tp=4"):
        build_config(_config(tp=4, cp=2, sequence_parallel=True, seq_len=20))
    with pytest.raises(LayoutError, match="10 tokens per context-parallel rank"):
        estimate(TINY, bad)
    build_config(_config(tp=4, cp=2, sequence_parallel=True, seq_len=40))
    estimate(TINY, good)
    # Without cp the text is the one it always was; 2 cp must divide seq_len first.
    with pytest.raises(ConfigError, match=r"training.seq_len=18 is not divisible by "
                                          r"parallel.tp=4, which sequence parallel needs"):
        build_config(_config(tp=4, sequence_parallel=True, seq_len=18))
    assert [v.reason.split(" (")[0] for v in rules.sequence_violations(
        Layout(cp=4, seq_len=20))] == ["training.seq_len=20 is not divisible by 2 x parallel.cp=8"]


CASES = [dict(tp=3), dict(tp=8), dict(pp=3), dict(pp=2, pp_virtual_stages=2),
         dict(pp=2, pp_virtual_stages=2, pp_schedule="interleaved"), dict(dp=4, dp_shard=3),
         dict(cp=3, seq_len=20), dict(tp=4, cp=2, sequence_parallel=True, seq_len=20),
         dict(dp=2, ep=2), dict(tp=2, sequence_parallel=True, seq_len=15), dict(tp=2, pp=2)]


@pytest.mark.parametrize("case", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items())
                                             for c in CASES])
def test_config_and_estimator_ask_the_same_rules(case):
    """The config checks the layout rules (the schedules' own are the engine's, at launch); the
    estimator checks both."""
    lay = Layout(**case)
    broken = rules.layout_violations(TINY, lay)
    schedule = rules.schedule_violations(lay)
    try:
        build_config(_config(**case))
        config_says = None
    except ConfigError as err:
        config_says = str(err)
    try:
        estimate(TINY, lay)
        estimator_says = None
    except LayoutError as err:
        estimator_says = str(err)
    assert config_says == (broken[0].message if broken else None)
    assert estimator_says == ((broken + schedule)[0].message if broken + schedule else None)


def _cp_gap(model, lay):
    """A gap of the engine as one would be written (a test's: none is left today)."""
    if lay.cp > 1:
        return rules.Violation("parallel.cp", lay.cp, "context parallelism is not implemented",
                               "set parallel.cp=1", gap=True)
    return None


def test_check_supported_lists_the_engines_gaps_from_the_rules(monkeypatch):
    cfg = build_config(_config(dp=4, tp=2, pp=2, cp=2, zero=1, ep=2, dp_shard=2,
                               pp_schedule="zero_bubble", seq_len=64)
                       | {"precision": {"dtype": "fp8"},
                          "model": {"preset": "tiny-deepseek", "sliding_window": 32}})
    # fp8 runs (parallel/precision.py), zero_bubble under tp too (issue 46), experts under tp
    # (issue 45), ep with dp_shard, a sliding window under ring attention and over multi-head
    # latent attention: no gap is left.
    assert rules.ENGINE_GAPS == () and rules.engine_violations(cfg.model, cfg.layout()) == []
    check_supported(cfg)
    # A gap, where there is one, is listed before launch in its own words, with its fix.
    monkeypatch.setattr(rules.engine, "ENGINE_GAPS", (_cp_gap,))
    refused = rules.engine_violations(cfg.model, cfg.layout())
    assert [v.key for v in refused] == ["parallel.cp"] and refused[0].gap
    with pytest.raises(ConfigError) as err:
        check_supported(cfg)
    assert str(err.value) == "\n".join(v.line() for v in refused)
    assert str(err.value).endswith("set parallel.cp=1.")
    # A pipeline schedule's own rule comes first, in the words of the schedule.
    cfg = build_config(_config(pp=2, pp_schedule="interleaved", pp_virtual_stages=2,
                               grad_accum_steps=3))
    with pytest.raises(ConfigError, match=r"^parallel.pp_schedule='interleaved': The "
                                          r"'interleaved' schedule .* multiple of pp=2. Use 2 or "
                                          r"4 micro-batches.$"):
        check_supported(cfg)


def test_what_were_the_engines_gaps_pass():
    """Each gap of the engine was one entry of ENGINE_GAPS, deleted as its feature landed (with
    a parity test): context parallel and ZeRO with cp (issue 28), fp16 and fp8 (issue 30),
    experts under cp (issues 28 with 29), experts under tp (issue 45), expert parallel with
    hybrid sharding, a sliding window (on one process, under each cp mode, over multi-head
    latent attention)."""
    fp16 = {"precision": {"dtype": "fp16"}}
    check_supported(build_config(_config(cp=2, dp=2, zero=1, seq_len=64) | fp16))
    check_supported(build_config(_config(cp=2, seq_len=64) | fp16
                                 | {"model": {"preset": "tiny-moe"}}))
    check_supported(build_config(_config(tp=2, seq_len=64) | {"model": {"preset": "tiny-moe"}}))
    check_supported(build_config(_config(dp=4, ep=2, dp_shard=2, seq_len=64)
                                 | {"model": {"preset": "tiny-moe"}}))
    for preset in ("tiny", "tiny-deepseek"):
        for mode in ("ring", "all_gather", "ulysses"):
            check_supported(build_config(_config(cp=2, seq_len=64, cp_mode=mode)
                                         | {"model": {"preset": preset, "sliding_window": 32}}))


def test_context_parallel_rules():
    """2 cp divides seq_len (two balanced chunks per rank), and Ulysses' head split needs cp to
    divide each tp rank's query heads (kv heads are replicated where cp does not divide them);
    an unknown mode is refused by the config's types and by the layout's values."""
    for mode in ("ring", "all_gather", "ulysses"):
        check_supported(build_config(_config(cp=4, seq_len=64, cp_mode=mode)))  # 2 kv heads < 4
    with pytest.raises(ConfigError, match=r"training.seq_len=60 is not divisible by 2 x "
                                          r"parallel.cp=8 .* Change seq_len or cp"):
        build_config(_config(cp=4, seq_len=60))
    with pytest.raises(ConfigError, match=r"parallel.cp_mode=ulysses splits the attention heads "
                                          r"over cp, and parallel.cp=8 does not divide "
                                          r"model.num_heads=4. Choose cp among \[2, 4\], or "
                                          r"parallel.cp_mode=ring or all_gather"):
        build_config(_config(cp=8, seq_len=64, cp_mode="ulysses"))
    with pytest.raises(ConfigError, match=r"model.num_heads / parallel.tp = 4 / 2 = 2"):
        build_config(_config(cp=4, tp=2, seq_len=64, cp_mode="ulysses"))
    build_config(_config(cp=2, tp=2, seq_len=64, cp_mode="ulysses"))
    with pytest.raises(ConfigError, match="cp_mode"):
        build_config(_config(cp=2, seq_len=64, cp_mode="zigzag"))
    assert [v.key for v in rules.value_violations(Layout(cp_mode="zigzag"))] == \
        ["parallel.cp_mode"]
    with pytest.raises(LayoutError, match="parallel.cp_mode=ulysses"):
        estimate(TINY, Layout(cp=8, seq_len=64, cp_mode="ulysses"))


def test_model_rules_and_kv_heads():
    assert rules.model_violations(TINY) == []
    odd = TINY.model_copy(update={"hidden_size": 12, "num_heads": 4})
    assert [v.key for v in rules.model_violations(odd)] == ["model.hidden_size"]
    with pytest.raises(ConfigError, match="model.num_kv_heads=3 does not divide model.num_heads=4"):
        build_config({"model": {"preset": "tiny", "num_kv_heads": 3}})
    assert rules.kv_heads_split(8, 4) and rules.kv_heads_split(2, 2)
    assert not rules.kv_heads_split(2, 4)  # tp above the kv heads: every rank keeps them


def test_violations_read_as_one_paragraph():
    v = rules.Violation("parallel.tp", 3, "parallel.tp=3 does not divide 4", "Choose 1, 2 or 4")
    assert v.message == "parallel.tp=3 does not divide 4. Choose 1, 2 or 4."
    assert v.line() == "parallel.tp=3: parallel.tp=3 does not divide 4. Choose 1, 2 or 4."
    gap = rules.Violation("parallel.cp", 2, "not yet", "set cp=1", gap=True)
    assert gap.line() == "parallel.cp=2: not yet; set cp=1."


def test_a_window_over_some_layers_names_them_and_a_window():
    """`model.sliding_window_layers` (rules/shape.py): layers of the model, each once, with a
    window to slide; refused before launch with the fix otherwise."""
    ok = build_config({"model": {"preset": "tiny", "sliding_window": 16,
                                 "sliding_window_layers": [1, 3]}})
    assert [ok.model.window_of(i) for i in range(5)] == [None, 16, None, 16, 16]  # MTP: last's
    for model, match in (({"sliding_window_layers": [1]}, "model.sliding_window is not set. Set "
                                                         "model.sliding_window"),
                         ({"sliding_window": 16, "sliding_window_layers": [1, 4]},
                          r"name layers 0..3 once each \(\[4\] are not\)"),
                         ({"sliding_window": 16, "sliding_window_layers": [1, 1]}, "some repeat")):
        with pytest.raises(ConfigError, match=match):
            build_config({"model": {"preset": "tiny", **model}})


def test_the_layout_minimums_are_the_config_keys_own():
    """`rules.value_violations` refuses below each key's least value (`rules.layout.MINIMUMS`),
    the `ge` the config key declares: `memory` and `plan` refuse what `train` refuses (plan
    accepted seq_len=1 and then wrote a config that `train` could not load)."""
    from ultrascale.config import layout_keys
    from ultrascale.rules.layout import MINIMUMS

    declared = {k.layout: (k.name, next(c.ge for c in k.field.metadata if hasattr(c, "ge")))
                for k in layout_keys() if k.layout in MINIMUMS}
    assert declared == MINIMUMS
    assert [v.message for v in rules.value_violations(Layout(seq_len=1))] == \
        ["training.seq_len=1 must be at least 2."]
    with pytest.raises(LayoutError, match="at least 2"):
        estimate(TINY, Layout(seq_len=1))
