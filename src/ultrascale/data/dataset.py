"""Token streams cut into fixed-length training samples.

Documents are tokenized, joined with a separator and packed into one stream; sample i is the
window stream[i*seq_len : i*seq_len + seq_len + 1] (inputs and next-token targets). Every target is
a real token, so a global batch always holds exactly `sequences x seq_len` loss tokens, whatever the
layout: the loss can be normalised without any communication.

A pre-tokenized stream is a flat numpy file (`.bin`, uint16 or uint32) with a JSON sidecar
(`.bin.json`) that records its dtype, vocabulary size and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ultrascale.data.corpus import documents
from ultrascale.data.tokenizers import load_tokenizer

SEPARATOR = "\n\n"


def tokenize_source(source: str, tokenizer, text_key: str = "text") -> np.ndarray:
    ids: list[int] = []
    sep = tokenizer.encode(SEPARATOR)
    for doc in documents(source, text_key):
        ids.extend(tokenizer.encode(doc))
        ids.extend(sep)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    return np.asarray(ids, dtype=dtype)


def write_tokenized(tokens: np.ndarray, out: Path, tokenizer) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tokens.tofile(tmp)
    tmp.replace(out)
    meta = {"dtype": str(tokens.dtype), "num_tokens": int(tokens.size),
            "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name}
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=1))


def read_tokenized(path: Path) -> tuple[np.ndarray, dict]:
    meta_path = Path(str(path) + ".json")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} has no sidecar {meta_path.name}; write pre-tokenized data "
                                "with `ultrascale tokenize`.")
    meta = json.loads(meta_path.read_text())
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


class TokenDataset:
    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"the data holds {len(tokens)} tokens, too few for one sample of "
                             f"training.seq_len={seq_len}; lower seq_len or add data.")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)


def load_dataset(source: str, tokenizer_spec: str, seq_len: int, model_vocab: int,
                 text_key: str = "text") -> tuple[TokenDataset, object]:
    """Returns the dataset and the tokenizer (for decoding samples)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    if source.endswith(".bin"):
        if not Path(source).is_file():
            raise FileNotFoundError(f"data.source={source!r} does not exist; write it with "
                                    "`ultrascale tokenize INPUT --out FILE.bin`.")
        tokens, meta = read_tokenized(Path(source))
        vocab = int(meta["vocab_size"])
    else:
        tokens = tokenize_source(source, tokenizer, text_key)
        vocab = tokenizer.vocab_size
    if vocab > model_vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab}; "
                         f"set model.vocab_size to at least {vocab}.")
    return TokenDataset(tokens, seq_len, vocab), tokenizer
