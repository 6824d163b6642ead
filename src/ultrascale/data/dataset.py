"""Token streams cut into fixed-length training samples.

Documents are tokenized one at a time, each with its boundaries (`tokenizer.document`: EOS after
it, BOS before it where the tokenizer uses one, or a "\\n\\n" separator for the byte tokenizer), and
packed into one stream; sample i is the window stream[i*seq_len : i*seq_len + seq_len + 1] (inputs
and next-token targets). Every target is a real token, so a global batch always holds exactly
`sequences x seq_len` loss tokens, whatever the layout: the loss can be normalised without any
communication. A document may run across two samples, as in GPT and Llama pre-training; its EOS
marks where it ends (attention is not masked at the boundary).

A pre-tokenized stream is a flat numpy file (`.bin`, uint16 or uint32) with a JSON sidecar
(`.bin.json`) that records its dtype, vocabulary size and tokenizer; `ultrascale tokenize` writes
it a chunk at a time, so a corpus larger than memory can be prepared once and memory-mapped.

The validation split is `data.val_source` (any source, tokenized alike) or the last
`data.val_fraction` of the samples, which training then never sees.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from ultrascale.data.corpus import documents
from ultrascale.data.tokenizers import load_tokenizer

CHUNK_TOKENS = 1 << 20  # tokens gathered before they go into the stream as one array


def _dtype(tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32


def token_chunks(source: str, tokenizer, text_key: str = "text") -> Iterator[np.ndarray]:
    """The packed stream of a source, a chunk of about CHUNK_TOKENS tokens at a time."""
    dtype, ids = _dtype(tokenizer), []
    for doc in documents(source, text_key):
        ids.extend(tokenizer.document(doc))
        if len(ids) >= CHUNK_TOKENS:
            yield np.asarray(ids, dtype=dtype)
            ids = []
    if ids:
        yield np.asarray(ids, dtype=dtype)


def tokenize_source(source: str, tokenizer, text_key: str = "text") -> np.ndarray:
    chunks = list(token_chunks(source, tokenizer, text_key))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=_dtype(tokenizer))


def write_tokenized(tokens, out: Path, tokenizer) -> int:
    """Write a token stream (an array, or an iterable of chunks) and its sidecar; returns the
    number of tokens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    count, dtype = 0, np.dtype(_dtype(tokenizer))
    with tmp.open("wb") as f:
        for chunk in chunks:
            chunk = np.asarray(chunk, dtype=dtype)
            chunk.tofile(f)
            count += chunk.size
    tmp.replace(out)
    meta = {"dtype": str(dtype), "num_tokens": count, "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name}
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=1))
    return count


def read_tokenized(path: Path) -> tuple[np.ndarray, dict]:
    meta_path = Path(str(path) + ".json")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} has no sidecar {meta_path.name}; write pre-tokenized data "
                                "with `ultrascale tokenize`.")
    meta = json.loads(meta_path.read_text())
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


class TokenDataset:
    """Samples `first .. first + count - 1` of a token stream cut into seq_len + 1 windows."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, first: int = 0,
                 count: int | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.first = first
        self.num_samples = (len(tokens) - 1) // seq_len - first if count is None else count
        if self.num_samples < 1:
            raise ValueError(f"the data holds {len(tokens)} tokens, too few for one sample of "
                             f"training.seq_len={seq_len}; lower seq_len or add data.")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def split(self, fraction: float) -> tuple["TokenDataset", "TokenDataset"]:
        """(training, validation): the last ceil(fraction x samples) samples held out."""
        held = math.ceil(fraction * self.num_samples)
        if not 1 <= held < self.num_samples:
            raise ValueError(f"data.val_fraction={fraction} of {self.num_samples} samples leaves "
                             "no training or no validation sample; change the fraction or add "
                             "data.")
        keep = self.num_samples - held
        return (TokenDataset(self.tokens, self.seq_len, self.vocab_size, self.first, keep),
                TokenDataset(self.tokens, self.seq_len, self.vocab_size, self.first + keep, held))


def _stream(source: str, tokenizer, text_key: str) -> tuple[np.ndarray, int]:
    if source.endswith(".bin"):
        if not Path(source).is_file():
            raise FileNotFoundError(f"data.source={source!r} does not exist; write it with "
                                    "`ultrascale tokenize INPUT --out FILE.bin`.")
        tokens, meta = read_tokenized(Path(source))
        return tokens, int(meta["vocab_size"])
    return tokenize_source(source, tokenizer, text_key), tokenizer.vocab_size


def load_dataset(source: str, tokenizer_spec: str, seq_len: int, model_vocab: int,
                 text_key: str = "text") -> tuple[TokenDataset, object]:
    """Returns the dataset and the tokenizer (for decoding samples)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    tokens, vocab = _stream(source, tokenizer, text_key)
    if vocab > model_vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab}; "
                         f"set model.vocab_size to at least {vocab}.")
    return TokenDataset(tokens, seq_len, vocab), tokenizer


def load_splits(data, seq_len: int, model_vocab: int
                ) -> tuple[TokenDataset, TokenDataset | None, object]:
    """(training, validation or None, tokenizer) for a `data` config section."""
    train, tokenizer = load_dataset(data.source, data.tokenizer, seq_len, model_vocab,
                                    data.text_key)
    if data.val_source is not None:
        tokens, _ = _stream(data.val_source, tokenizer, data.text_key)
        return train, TokenDataset(tokens, seq_len, train.vocab_size), tokenizer
    if data.val_fraction:
        train, val = train.split(data.val_fraction)
        return train, val, tokenizer
    return train, None, tokenizer
