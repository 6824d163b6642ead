"""Tokenizers: bytes (no files needed) or a local Hugging Face `tokenizer.json`."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, nothing to download."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A local tokenizer.json through the `tokenizers` library (never fetched from a hub)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # optional dependency
            raise RuntimeError("data.tokenizer points at a tokenizer.json, which needs the "
                               "`tokenizers` package: pip install tokenizers") from exc
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise FileNotFoundError(
            f"data.tokenizer={spec!r} is neither 'byte' nor an existing tokenizer.json file. "
            "Give the path of a local tokenizer.json, or use data.tokenizer=byte.")
    return JsonTokenizer(spec)
