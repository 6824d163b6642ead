"""Where text comes from: the built-in corpus, text / JSON-lines files, or a folder of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json")


def builtin_documents() -> Iterator[str]:
    """The text of Python's own `pydoc_data.topics`: ~465 kB of English prose and code that ships
    with every Python, so the default run needs no download."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def file_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n} is not valid JSON ({exc.msg}).") from None
                if not isinstance(record, dict) or text_key not in record:
                    raise ValueError(f"{path}:{n} has no {text_key!r} field; set data.text_key "
                                     "to the field that holds the text.")
                yield str(record[text_key])
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def documents(source: str, text_key: str = "text") -> Iterator[str]:
    if source == "builtin":
        yield from builtin_documents()
        return
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"data.source={source!r} is a folder with no .txt, .md or "
                                    ".jsonl files.")
        for f in files:
            yield from file_documents(f, text_key)
    elif path.is_file():
        yield from file_documents(path, text_key)
    else:
        raise FileNotFoundError(
            f"data.source={source!r} does not exist. Give a text/JSON-lines file, a folder of "
            "them, a .bin from `ultrascale tokenize`, or data.source=builtin.")
