"""Corpus, tokenizers, pre-tokenized files and the layout-independent sampler."""

import json

import numpy as np
import pytest

from cli_helpers import ultrascale
from ultrascale.data.corpus import documents
from ultrascale.data.dataset import load_dataset, tokenize_source
from ultrascale.data.sampler import GlobalBatchSampler
from ultrascale.data.tokenizers import ByteTokenizer, load_tokenizer


def test_builtin_corpus_ships_with_python():
    docs = list(documents("builtin"))
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café – ok"
    assert tok.decode(tok.encode(text)) == text


def test_step_samples_do_not_depend_on_layout():
    sampler = GlobalBatchSampler(1000, seed=5)
    global_batch = 24
    for step in range(3):
        consumed = step * global_batch
        reference = sampler.indices(consumed, global_batch)
        for dp, mbs in [(1, 24), (2, 3), (4, 2), (8, 1), (3, 4)]:
            got = [i for r in range(dp)
                   for mb in sampler.rank_micro_batches(consumed, global_batch, dp, r, mbs)
                   for i in mb]
            assert got == reference


def test_epochs_are_permutations_and_resume_is_positional():
    sampler = GlobalBatchSampler(10, seed=1)
    first, second = sampler.indices(0, 10), sampler.indices(10, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # each epoch reshuffles
    assert GlobalBatchSampler(10, seed=1).indices(7, 6) == (first + second)[7:13]


def test_text_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second doc"}) + "\n")
    tokens = tokenize_source(str(tmp_path), ByteTokenizer())
    assert bytes(tokens.tolist()).decode() == "hello world\n\nsecond doc\n\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="data.text_key"):
        tokenize_source(str(bad), ByteTokenizer())


def test_tokenize_command_writes_a_memmap_dataset(tmp_path):
    proc = ultrascale("tokenize", "builtin", "--out", str(tmp_path / "corpus.bin"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    ds, _ = load_dataset(str(tmp_path / "corpus.bin"), "byte", 64, 256)
    direct, _ = load_dataset("builtin", "byte", 64, 256)
    assert len(ds) == len(direct)
    np.testing.assert_array_equal(ds.sample(17), direct.sample(17))


def test_local_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(list(documents("builtin"))[:20],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(str(path))
    assert loaded.vocab_size <= 300
    ds, _ = load_dataset("builtin", str(path), 32, 512)
    assert ds.tokens.max() < loaded.vocab_size
    with pytest.raises(ValueError, match="model.vocab_size"):
        load_dataset("builtin", str(path), 32, 100)


def test_missing_tokenizer_file():
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer("/nonexistent/tokenizer.json")
