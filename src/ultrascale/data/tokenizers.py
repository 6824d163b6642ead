"""Tokenizers: bytes (no files needed), or a local Hugging Face tokenizer: a `tokenizer.json`, or a
model folder holding one with its `tokenizer_config.json` (which names the special tokens). Nothing
is ever downloaded.

`document(text)` gives the ids of one document as it goes into the packed stream: for a Hugging
Face tokenizer that knows its end-of-text token, `[BOS] text EOS` (BOS only where the tokenizer
puts one before every text: Llama's does, Qwen's does not); otherwise the text followed by the
separator "\\n\\n" (the byte tokenizer, a bare tokenizer.json).
"""

from __future__ import annotations

import json

from ultrascale.hf_arch import tokenizer_file

SEPARATOR = "\n\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, nothing to download."""

    name = "byte"
    vocab_size = 256
    bos_id = None
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def document(self, text: str) -> list[int]:
        return self.encode(text + SEPARATOR)

    def prompt(self, text: str) -> list[int]:
        return self.encode(text)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A local Hugging Face tokenizer through the `tokenizers` library (never fetched from a
    hub): `spec` is a tokenizer.json or a folder holding one."""

    def __init__(self, spec: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # optional dependency
            raise RuntimeError("data.tokenizer points at a Hugging Face tokenizer, which needs the "
                               "`tokenizers` package: pip install tokenizers") from exc
        path = tokenizer_file(spec)
        if path is None:
            raise FileNotFoundError(f"data.tokenizer={spec!r} holds no tokenizer.json.")
        self.name = str(spec)
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            f = path.parent / name
            if f.is_file():
                special.update(json.loads(f.read_text()))
        self.eos_id = self._id(_token_text(special.get("eos_token")))
        # BOS where the tokenizer puts one before every text: its config says so (Llama 2), or
        # its post-processor adds it (Llama 3's tokenizer.json).
        bos = self._id(_token_text(special.get("bos_token")))
        with_specials = self._tok.encode("a", add_special_tokens=True).ids
        adds_bos = bos is not None and with_specials[:1] == [bos]
        self.bos_id = bos if special.get("add_bos_token", adds_bos) and bos is not None else None
        self._separator = [] if self.eos_id is not None else self.encode(SEPARATOR)

    def _id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token else None

    def encode(self, text: str) -> list[int]:
        """The text's ids, without special tokens (`document` adds the boundaries)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def document(self, text: str) -> list[int]:
        ids = self.encode(text)
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else self._separator
        return head + ids + tail

    def prompt(self, text: str) -> list[int]:
        """A prompt as documents begin in training: BOS first where the tokenizer uses it."""
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    if tokenizer_file(spec) is None:
        raise FileNotFoundError(
            f"data.tokenizer={spec!r} is neither 'byte', a tokenizer.json file, nor a folder "
            "holding one. Give a local Hugging Face tokenizer (a model folder or its "
            "tokenizer.json), or use data.tokenizer=byte.")
    return HFTokenizer(spec)
