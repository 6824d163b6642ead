"""Chat data (`data.format: chat`, data/chat.py) with a tokenizer folder made here (chat_data.py,
no download): the tokens the loss counts are exactly the assistant tokens transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks, with the template's
generation markers or (a template without them) by role; conversations packed whole with their
boundaries; and the refusals, before any process starts, with their fix: no assistant turn, no
chat template, unknown roles, a conversation longer than seq_len (refused, or dropped and cut and
counted in the run's header), transformers missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import chat_data
from test_cli_user import run_cli  # the command in this process, starting nothing
from ultrascale.config import ConfigError, build_config
from ultrascale.data.chat import ChatDataError, chat_tokenizer, load_chat
from ultrascale.data.windows import IGNORE, micro_batch

SEQ = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"marked": chat_data.tokenizer_folder(root / "marked"),
            "plain": chat_data.tokenizer_folder(root / "plain", chat_data.PLAIN),
            "none": chat_data.tokenizer_folder(root / "none", None),
            "data": chat_data.conversations_file(root / "chat.jsonl", count=60), "root": root}


def _data(folders, tokenizer="marked", source=None, **keys):
    cfg = build_config({"data": {"format": "chat", "source": str(source or folders["data"]),
                                 "tokenizer": str(folders[tokenizer]), **keys},
                        "training": {"seq_len": SEQ}, "model": {"vocab_size": 256}})
    return cfg.data


def _conversations(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("tokenizer", ["marked", "plain"])
def test_the_loss_counts_exactly_the_tokens_apply_chat_template_marks(folders, tokenizer):
    """Every sample cut back into its conversations (where they begin): each is the template's
    rendering, and its counted targets are exactly the tokens the markers template's
    `return_assistant_tokens_mask` marks (shifted by one: a target is the next token). The
    template without markers finds the same tokens by role."""
    ds = load_chat(str(folders["data"]), _data(folders, tokenizer, overlong="drop"), SEQ)
    marker_tok = chat_tokenizer(str(folders["marked"]))
    kept = [m for m in _conversations(folders["data"])
            if len(marker_tok.apply_chat_template(m, tokenize=True)) <= SEQ]
    assert ds.stats.conversations == len(kept) + ds.stats.overlong
    assert ds.stats.by_markers == (tokenizer == "marked")
    expected = iter(kept)
    for i in range(len(ds)):
        window = ds.window(i)
        _, targets, starts = micro_batch([window])
        edges = [0, *window.begins.tolist()]
        for a, b in zip(edges, edges[1:]):  # the last piece is the padding
            want = marker_tok.apply_chat_template(next(expected), tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
            assert window.tokens[a:b].tolist() == want["input_ids"]
            counted = targets[0, a:b - 1] != IGNORE
            assert counted.tolist() == [bool(x) for x in want["assistant_masks"][1:]]
            assert (starts[0, a:b] == a).all()  # one document each
        assert (targets[0, edges[-1] - 1:] == IGNORE).all()  # padding trains on nothing
    assert next(expected, None) is None
    assert ds.loss_tokens(range(len(ds))) == ds.stats.loss_tokens > 0


def test_loss_on_all_counts_every_token_but_each_conversations_first(folders):
    ds = load_chat(str(folders["data"]), _data(folders, loss_on="all", overlong="drop"), SEQ)
    window = ds.window(0)
    _, targets, _ = micro_batch([window])
    pad = window.begins[-1]
    assert (targets[0, :pad - 1] != IGNORE).sum() == pad - len(window.begins)


def test_conversations_refused_before_launch_with_the_fix(folders):
    root = folders["root"]
    cases = {
        "no assistant turn": ([[{"role": "user", "content": "hello"}]], "no assistant turn"),
        "unknown role": ([[{"role": "human", "content": "hi"},
                           {"role": "gpt", "content": "yes"}]], "'gpt', 'human'"),
        "not messages": ([[{"role": "user"}]], "non-empty list"),
        "too long": ([[{"role": "user", "content": "hello " * 80},
                       {"role": "assistant", "content": "yes"}]], "data.overlong=drop"),
    }
    for name, (extra, needle) in cases.items():
        path = chat_data.conversations_file(root / f"{name}.jsonl", count=3, extra=extra)
        with pytest.raises(ChatDataError, match=needle) as err:
            load_chat(str(path), _data(folders, source=path), SEQ)
        assert f"{path}:4" in str(err.value)  # where: the fourth record
    with pytest.raises(ChatDataError, match="has no chat template"):
        chat_tokenizer(str(folders["none"]))
    with mock.patch.dict(sys.modules, {"transformers": None}), \
            pytest.raises(ChatDataError, match=r"pip install -e '.\[chat\]'"):
        chat_tokenizer(str(folders["marked"]))
    with pytest.raises(ConfigError, match="data.tokenizer='byte'"):
        build_config({"data": {"format": "chat", "source": str(folders["data"])}})


def test_train_refuses_bad_chat_data_before_any_process_and_counts_overlong_ones(folders):
    root = folders["root"]
    long_one = [{"role": "user", "content": "hello " * 80}, {"role": "assistant", "content": "ok"}]
    path = chat_data.conversations_file(root / "overlong.jsonl", count=40, extra=[long_one])
    sets = ["data.format=chat", f"data.source={path}", f"data.tokenizer={folders['marked']}",
            "model.vocab_size=256", f"training.seq_len={SEQ}", "parallel.dp=1",
            "training.micro_batch_size=2", "device=cpu", f"logging.run_dir={root / 'run'}"]
    args = ["train"] + [a for s in sets for a in ("--set", s)]
    code, out, err = run_cli(*args)
    assert code == 2 and "longer than training.seq_len=64" in err and "overlong.jsonl:41" in err
    code, out, err = run_cli(*args, "--set", "data.overlong=drop", "--dry-run")
    assert code == 0, err
    assert "chat data: 41 conversations, 1 longer than training.seq_len=64 dropped; " in out
    code, out, err = run_cli(*args, "--set", "data.overlong=cut", "--dry-run")
    assert "1 longer than training.seq_len=64 cut to seq_len" in out
    cut = load_chat(str(path), _data(folders, source=path, overlong="cut"), SEQ)
    assert cut.stats.conversations == 41 and cut.stats.overlong == 1
    code, out, err = run_cli(*args[:-2], "--set", f"data.tokenizer={folders['none']}",
                              "--set", f"logging.run_dir={root / 'run2'}")
    assert code == 2 and "has no chat template" in err


def test_uneven_conversations_give_uneven_loss_tokens_per_sample(folders):
    ds = load_chat(str(folders["data"]), _data(folders, overlong="drop"), SEQ)
    counts = [ds.loss_tokens([i]) for i in range(len(ds))]
    assert len(set(counts)) > 3
    assert ds.loss_tokens([0, 1, 2]) == sum(counts[:3])
    train, val = ds.split(0.25)
    assert len(val) == -(-len(ds) // 4) and len(train) + len(val) == len(ds)
    np.testing.assert_array_equal(val.window(0).tokens, ds.window(len(train)).tokens)


def _write(path: Path, key: str, conversations: list) -> Path:
    path.write_text("".join(json.dumps({key: c}) + "\n" for c in conversations))
    return path


def test_sharegpt_records_and_text_parts_pack_as_role_and_content(folders):
    """The same conversations written as ShareGPT's {from, value} (human, gpt) and with each
    content cut into OpenAI's text parts give the very samples and loss tokens of the
    {role, content} form; an image part and a message without content are refused with the fix;
    an assistant's tool call (no content, `tool_calls`) is taken."""
    root = folders["root"]
    convs = _conversations(folders["data"])[:30]
    speaker = {"user": "human", "assistant": "gpt"}
    share = [[{"from": speaker.get(m["role"], m["role"]), "value": m["content"]} for m in c]
             for c in convs]
    halves = [[{**m, "content": [{"type": "text", "text": m["content"][:len(m["content"]) // 2]},
                                 {"type": "text", "text": m["content"][len(m["content"]) // 2:]}]}
               for m in c] for c in convs]
    base = load_chat(str(_write(root / "base.jsonl", "messages", convs)),
                     _data(folders, overlong="drop"), SEQ)
    for name, key, variant in [("sharegpt", "conversations", share), ("parts", "messages", halves)]:
        path = _write(root / f"{name}.jsonl", key, variant)
        ds = load_chat(str(path), _data(folders, source=path, overlong="drop", messages_key=key),
                       SEQ)
        assert np.array_equal(ds.tokens, base.tokens) and np.array_equal(ds.counted, base.counted)
        assert ds.stats.loss_tokens == base.stats.loss_tokens > 0
    image = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
              {"role": "assistant", "content": "yes"}]]
    empty = [[{"role": "user", "content": None}, {"role": "assistant", "content": "yes"}]]
    for name, extra, needle in [("image", image, "'image_url' content part"),
                                ("empty", empty, "ShareGPT's")]:
        path = chat_data.conversations_file(root / f"{name}.jsonl", count=3, extra=extra)
        with pytest.raises(ChatDataError, match=needle):
            load_chat(str(path), _data(folders, source=path), SEQ)
    call = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    tools = [[{"role": "user", "content": "what weather"},
              {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "content": "nice"}, {"role": "assistant", "content": "nice today"}]]
    path = chat_data.conversations_file(root / "tools.jsonl", count=3, extra=tools)
    assert load_chat(str(path), _data(folders, source=path), SEQ).stats.conversations == 4
