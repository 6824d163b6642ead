"""The data people have: JSON-lines, Parquet and `datasets` save_to_disk folders give the same token
stream and the same training; a Hugging Face tokenizer folder separates documents with its BOS and
EOS and sets the vocabulary; the validation split's loss lands in the metrics every N steps, the
same in every layout; `ultrascale generate` samples the same text from checkpoints of two
layouts."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_ranks
from parity import TINY
from ultrascale.config import Config, ConfigError, build_config

TEXTS = [f"Document {i}: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (1 + i % 3))
         for i in range(40)]


def _tokenizer_folder(path):
    """A tiny byte-level BPE trained here, with Llama-style special tokens: <s> before every
    document (add_bos_token), </s> after."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return path


def _sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), parquet,
                   row_group_size=7)
    saved = tmp_path / "saved"
    Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        str(saved), max_shard_size="2KB")
    assert len(list(saved.glob("*.arrow"))) > 1  # several Arrow files, read in order
    return {"jsonl": jsonl, "parquet": parquet, "save_to_disk": saved}


def _config(source, tokenizer="byte", extra_data=None, **training):
    data = json.loads(json.dumps(TINY))
    if tokenizer != "byte":
        data["model"].pop("vocab_size")  # follows the tokenizer
    data["data"] = {"source": str(source), "tokenizer": str(tokenizer), **(extra_data or {})}
    data["training"].update({"steps": 3, "seq_len": 16, **training})
    return build_config(data)


def test_parquet_and_save_to_disk_train_on_the_same_tokens_as_jsonl(tmp_path):
    from ultrascale.data.dataset import load_dataset
    from ultrascale.preflight import data_tokens
    from ultrascale.train.trainer import train

    tok = _tokenizer_folder(tmp_path / "tok")
    sources = _sources(tmp_path)
    streams, losses = {}, {}
    for name, src in sources.items():
        cfg = _config(src, tok)
        assert cfg.model.vocab_size == 300  # model.vocab_size followed the tokenizer
        ds, _ = load_dataset(str(src), str(tok), 16, 300)
        streams[name] = ds.tokens
        losses[name] = train(cfg, generate_sample=False).losses
        tokens, exact = data_tokens(cfg)
        assert tokens >= len(ds.tokens) and not exact  # a bound: the tokenizer is not bytes
    for name in ("parquet", "save_to_disk"):
        assert streams[name].tolist() == streams["jsonl"].tolist(), name
        assert losses[name] == losses["jsonl"], name

    from ultrascale.data.tokenizers import load_tokenizer
    t = load_tokenizer(str(tok))
    stream = streams["jsonl"].tolist()
    assert (t.bos_id, t.eos_id) == (1, 2)
    assert stream.count(1) == stream.count(2) == len(TEXTS)  # one BOS and one EOS a document
    first = t.document(TEXTS[0])
    assert stream[:len(first)] == first and first[0] == 1 and first[-1] == 2
    assert t.decode(first) == TEXTS[0]


def test_byte_streams_of_tables_are_counted_exactly_and_bad_columns_named(tmp_path):
    from ultrascale.data.dataset import load_dataset
    from ultrascale.preflight import check_data_files, data_tokens

    sources = _sources(tmp_path)
    for src in (sources["parquet"], sources["save_to_disk"]):
        cfg = _config(src)
        ds, _ = load_dataset(str(src), "byte", 16, 256)
        assert data_tokens(cfg) == (len(ds.tokens), True)
        with pytest.raises(ConfigError, match="no 'body' column.*data.text_key"):
            check_data_files(build_config({**cfg.model_dump(), "data": {
                "source": str(src), "text_key": "body"}}))


def test_a_datasetdict_folder_is_refused_naming_its_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    from ultrascale.preflight import check_data_files

    folder = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_dict({"text": TEXTS}),
                 "test": Dataset.from_dict({"text": TEXTS[:3]})}).save_to_disk(str(folder))
    with pytest.raises(ConfigError, match=r"splits \(train, test\).*dd/train"):
        check_data_files(_config(folder))
    check_data_files(_config(folder / "train"))


def test_eval_loss_lands_in_the_metrics_every_n_steps(tmp_path):
    from ultrascale.train.trainer import train

    for val in ({"val_fraction": 0.1}, {"val_source": str(_sources(tmp_path)["jsonl"])}):
        cfg = _config("builtin", extra_data=val, eval_every=2, steps=5)
        data = cfg.model_dump(mode="json")
        data["logging"].update(metrics_file=str(tmp_path / "m.jsonl"), every=4)
        (tmp_path / "m.jsonl").unlink(missing_ok=True)
        result = train(Config.model_validate(data), generate_sample=False)
        lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
        evals = {x["step"]: x["eval_loss"] for x in lines if "eval_loss" in x}
        assert sorted(evals) == [2, 4, 5] and dict(result.eval_losses) == evals
        assert all(0 < v < 7 for v in evals.values())
        assert [x["step"] for x in lines] == [1, 2, 4, 5]
        assert all(x["eval_tokens"] == 4 * 2 * 16 for x in lines if "eval_loss" in x)
    with pytest.raises(ConfigError, match="no validation split"):
        _config("builtin", eval_every=2)


def _train_rank(config: dict) -> dict:
    from ultrascale.train.trainer import train

    result = train(Config.model_validate(config), generate_sample=False)
    return {"losses": result.losses, "evals": result.eval_losses,
            "checkpoint": str(result.checkpoint)}


@pytest.mark.slow
def test_generate_gives_the_same_text_from_two_layouts_and_eval_losses_agree(tmp_path, capsys):
    from ultrascale.cli import main

    runs = {}
    for name, layout in (("dp1", []), ("tp2-pp2", ["parallel.tp=2", "parallel.pp=2"])):
        cfg = build_config(TINY, ["training.steps=6", "training.grad_accum_steps=2",
                                  "training.eval_every=3", "data.val_fraction=0.05",
                                  f"checkpoint.dir={tmp_path / name}", *layout])
        data = cfg.model_dump(mode="json")
        world = cfg.parallel.world_size
        runs[name] = _train_rank(data) if world == 1 else run_ranks(world, _train_rank, data)[0]
    a, b = runs["dp1"], runs["tp2-pp2"]
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5,
                               atol=0)
    assert [s for s, _ in a["evals"]] == [s for s, _ in b["evals"]] == [3, 6]
    torch.testing.assert_close(torch.tensor([v for _, v in b["evals"]]),
                               torch.tensor([v for _, v in a["evals"]]), rtol=1e-5, atol=0)
    texts = []
    for run in (a, b):
        assert main(["generate", run["checkpoint"], "--prompt", "def ", "--max-new-tokens", "40",
                     "--seed", "3"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("def ") + 20
