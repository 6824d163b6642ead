"""Token streams cut into fixed-length training samples.

Documents are tokenized one at a time, each with its boundaries (`tokenizer.document`: EOS after
it, BOS before it where the tokenizer uses one, or a "\\n\\n" separator for the byte tokenizer), and
packed into one stream; sample i is the window stream[i*seq_len : i*seq_len + seq_len + 1] (inputs
and next-token targets). A document may run across two samples, as in GPT and Llama
pre-training; its EOS marks where it ends.

With `data.document_mask` the stream's document starts are kept too, and each sample carries the
starts of the documents inside it (`Window.begins`): attention then never crosses them (positions
restart at each, models/documents.py), and the target that would cross one (the next document's
first token, predicted from the last of the previous) is IGNORE. Without it every target counts.
Which targets count is known from the data alone, so every rank knows the loss tokens of a global
batch (`loss_tokens`) without communicating; the loss is their mean.

A pre-tokenized stream is a flat numpy file (`.bin`, uint16 or uint32) with a JSON sidecar
(`.bin.json`) that records its dtype, vocabulary size and tokenizer, and the offsets at which its
documents begin (`.bin.docs`, int64); `ultrascale tokenize` writes them a chunk at a time, so a
corpus larger than memory can be prepared once and memory-mapped.

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
from ultrascale.data.windows import NO_BEGINS, Window

CHUNK_TOKENS = 1 << 20  # tokens gathered before they go into the stream as one array


def _dtype(tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32


def document_chunks(source: str, tokenizer, text_key: str = "text"
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The packed stream of a source, a chunk of about CHUNK_TOKENS tokens at a time, with the
    lengths of the (whole) documents in each chunk."""
    dtype, ids, lengths = _dtype(tokenizer), [], []
    for doc in documents(source, text_key):
        doc_ids = tokenizer.document(doc)
        ids.extend(doc_ids)
        lengths.append(len(doc_ids))
        if len(ids) >= CHUNK_TOKENS:
            yield np.asarray(ids, dtype=dtype), np.asarray(lengths, dtype=np.int64)
            ids, lengths = [], []
    if ids:
        yield np.asarray(ids, dtype=dtype), np.asarray(lengths, dtype=np.int64)


def tokenize_documents(source: str, tokenizer, text_key: str = "text"
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The packed stream and the offsets at which its documents begin."""
    chunks = list(document_chunks(source, tokenizer, text_key))
    if not chunks:
        return np.zeros(0, dtype=_dtype(tokenizer)), NO_BEGINS
    lengths = np.concatenate([c[1] for c in chunks])
    return np.concatenate([c[0] for c in chunks]), np.cumsum(lengths) - lengths


def tokenize_source(source: str, tokenizer, text_key: str = "text") -> np.ndarray:
    return tokenize_documents(source, tokenizer, text_key)[0]


def write_tokenized(tokens, out: Path, tokenizer) -> int:
    """Write a token stream (an array, or an iterable of chunks: arrays, or (tokens, document
    lengths) pairs as `document_chunks` gives) and its sidecars; returns the number of
    tokens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, tmp_docs = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".docs.tmp")
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    count, docs, dtype = 0, 0, np.dtype(_dtype(tokenizer))
    with tmp.open("wb") as f, tmp_docs.open("wb") as d:
        for chunk in chunks:
            chunk, lengths = chunk if isinstance(chunk, tuple) else (chunk, None)
            if lengths is not None:
                (count + np.cumsum(lengths) - lengths).astype(np.int64).tofile(d)
                docs += len(lengths)
            chunk = np.asarray(chunk, dtype=dtype)
            chunk.tofile(f)
            count += chunk.size
    tmp.replace(out)
    meta = {"dtype": str(dtype), "num_tokens": count, "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name, "documents": docs or None}
    if docs:
        tmp_docs.replace(_docs_path(out))
    else:
        tmp_docs.unlink()
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=1))
    return count


def _docs_path(path: Path) -> Path:
    return Path(str(path) + ".docs")


def read_tokenized(path: Path) -> tuple[np.ndarray, dict]:
    meta_path = Path(str(path) + ".json")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} has no sidecar {meta_path.name}; write pre-tokenized data "
                                "with `ultrascale tokenize`.")
    meta = json.loads(meta_path.read_text())
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


def read_document_starts(path: Path) -> np.ndarray:
    """The offsets at which a pre-tokenized stream's documents begin (its `.docs` sidecar)."""
    docs = _docs_path(path)
    if not docs.is_file():
        raise FileNotFoundError(f"data.document_mask needs the document boundaries of {path}, "
                                f"which has no {docs.name}: write it again with `ultrascale "
                                "tokenize` (it records them), or set data.document_mask=false.")
    return np.fromfile(docs, dtype=np.int64)


class TokenDataset:
    """Samples `first .. first + count - 1` of a token stream cut into seq_len + 1 windows;
    `doc_starts` (the stream offsets at which documents begin, sorted) when documents are
    masked."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, first: int = 0,
                 count: int | None = None, doc_starts: np.ndarray | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.first = first
        self.doc_starts = doc_starts
        self.num_samples = (len(tokens) - 1) // seq_len - first if count is None else count
        if self.num_samples < 1:
            raise ValueError(f"the data holds {len(tokens)} tokens, too few for one sample of "
                             f"training.seq_len={seq_len}; lower seq_len or add data.")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def _begins_between(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For windows beginning at stream offsets `starts`: the range of doc_starts inside
        each, at offsets 1..seq_len of it."""
        lo = np.searchsorted(self.doc_starts, starts + 1)
        return lo, np.searchsorted(self.doc_starts, starts + self.seq_len + 1)

    def window(self, i: int) -> Window:
        if self.doc_starts is None:
            return Window(self.sample(i))
        start = (self.first + i) * self.seq_len
        lo, hi = self._begins_between(np.asarray(start))
        return Window(self.sample(i), np.asarray(self.doc_starts[lo:hi] - start, np.int64))

    def loss_tokens(self, indices: list[int]) -> int:
        """Targets that count in these samples: all but those across a document boundary."""
        total = len(indices) * self.seq_len
        if self.doc_starts is None or not len(indices):
            return total
        lo, hi = self._begins_between((self.first + np.asarray(indices)) * self.seq_len)
        return total - int((hi - lo).sum())

    def split(self, fraction: float) -> tuple["TokenDataset", "TokenDataset"]:
        """(training, validation): the last ceil(fraction x samples) samples held out."""
        held = math.ceil(fraction * self.num_samples)
        if not 1 <= held < self.num_samples:
            raise ValueError(f"data.val_fraction={fraction} of {self.num_samples} samples leaves "
                             "no training or no validation sample; change the fraction or add "
                             "data.")
        keep = self.num_samples - held
        return (TokenDataset(self.tokens, self.seq_len, self.vocab_size, self.first, keep,
                             self.doc_starts),
                TokenDataset(self.tokens, self.seq_len, self.vocab_size, self.first + keep, held,
                             self.doc_starts))


def _stream(source: str, tokenizer, text_key: str, document_mask: bool = False
            ) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(tokens, vocabulary size, document starts or None without document masking)."""
    if source.endswith(".bin"):
        if not Path(source).is_file():
            raise FileNotFoundError(f"data.source={source!r} does not exist; write it with "
                                    "`ultrascale tokenize INPUT --out FILE.bin`.")
        tokens, meta = read_tokenized(Path(source))
        starts = read_document_starts(Path(source)) if document_mask else None
        return tokens, int(meta["vocab_size"]), starts
    tokens, starts = tokenize_documents(source, tokenizer, text_key)
    return tokens, tokenizer.vocab_size, starts if document_mask else None


def load_dataset(source: str, tokenizer_spec: str, seq_len: int, model_vocab: int,
                 text_key: str = "text", document_mask: bool = False
                 ) -> tuple[TokenDataset, object]:
    """Returns the dataset and the tokenizer (for decoding samples)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    tokens, vocab, starts = _stream(source, tokenizer, text_key, document_mask)
    if vocab > model_vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab}; "
                         f"set model.vocab_size to at least {vocab}.")
    return TokenDataset(tokens, seq_len, vocab, doc_starts=starts), tokenizer


def load_splits(data, seq_len: int, model_vocab: int) -> tuple[object, object | None, object]:
    """(training, validation or None, tokenizer) for a `data` config section: a TokenDataset of
    text, or of conversations (data.format=chat) a ChatDataset (data/chat.py)."""
    if data.format == "chat":
        from ultrascale.data.chat import load_chat_splits
        return load_chat_splits(data, seq_len, model_vocab)
    mask = bool(data.document_mask)
    train, tokenizer = load_dataset(data.source, data.tokenizer, seq_len, model_vocab,
                                    data.text_key, mask)
    if data.val_source is not None:
        tokens, _, starts = _stream(data.val_source, tokenizer, data.text_key, mask)
        return train, TokenDataset(tokens, seq_len, train.vocab_size, doc_starts=starts), \
            tokenizer
    if data.val_fraction:
        train, val = train.split(data.val_fraction)
        return train, val, tokenizer
    return train, None, tokenizer
