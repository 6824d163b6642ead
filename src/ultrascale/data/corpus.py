"""Where text comes from: the built-in corpus; text, JSON-lines and Parquet files, or a folder of
them; a folder written by `datasets`' `save_to_disk`. Documents are read one at a time (a
JSON-lines file line by line, Parquet and Arrow files a record batch at a time), so that no file
is ever held whole.

Each document is one text file, one JSON-lines record, or one row of a Parquet file or a saved
dataset (its `data.text_key` field). A `save_to_disk` folder is read with pyarrow alone: its
`state.json` lists its Arrow files in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json")
TABLE_SUFFIXES = (".parquet",)
SOURCE_SUFFIXES = TEXT_SUFFIXES + TABLE_SUFFIXES
BATCH_ROWS = 1024  # rows of a Parquet or Arrow file read at a time
KEY_SETTING = "data.text_key (data.messages_key for chat data)"  # what names a record's field


def builtin_documents() -> Iterator[str]:
    """The text of Python's own `pydoc_data.topics`: ~465 kB of English prose and code that ships
    with every Python, so the default run needs no download."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _pyarrow():
    try:
        import pyarrow
        return pyarrow
    except ImportError:  # optional dependency
        raise RuntimeError("Parquet files and save_to_disk folders need pyarrow: pip install "
                           "pyarrow (or pip install -e '.[data]').") from None


def _column(names: list[str], path: Path, key: str) -> None:
    if key not in names:
        raise ValueError(f"{path} has no {key!r} column (its columns: {', '.join(names)}); set "
                         f"{KEY_SETTING} to the one holding it.")


def _rows(batches, path: Path, text_key: str) -> Iterator[str]:
    for where, value in _values(batches, path, text_key):
        yield document_text(where, text_key, value)


def document_text(where: str, key: str, value: object) -> str:
    """A record's text field as a document: a string, or a clear error (a number, a list or a
    conversation would otherwise be trained on as its Python spelling)."""
    if isinstance(value, str):
        return value
    kind = type(value).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    raise ValueError(not_text(f"{where}: field {key!r} holds {article} {kind}",
                              isinstance(value, (list, dict))))


def not_text(what: str, nested: bool) -> str:
    """The refusal of a text field (or column) that holds no text; `nested`: lists or records,
    a conversation's shape."""
    return (f"{what}, not text; set data.text_key to the field holding each document's text."
            + (" Conversations are data.format=chat (their field: data.messages_key)."
               if nested else ""))


def _values(batches, path: Path, key: str) -> Iterator[tuple[str, object]]:
    """(where, value) of the `key` column's non-null values, row by row."""
    row = 0
    for batch in batches:
        _column(batch.schema.names, path, key)
        for value in batch.column(key).to_pylist():
            row += 1
            if value is not None:
                yield f"{path} row {row}", value


def _table_batches(path: Path, key: str):
    """The record batches of a Parquet or Arrow file (the IPC stream format `datasets` writes;
    the file format too), holding the `key` column."""
    pa = _pyarrow()
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        f = pq.ParquetFile(path)
        _column(f.schema_arrow.names, path, key)
        yield from f.iter_batches(columns=[key], batch_size=BATCH_ROWS)
        return
    import pyarrow.ipc  # noqa: F401  (the submodule)
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        yield from reader


def parquet_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    yield from _rows(_table_batches(path, text_key), path, text_key)


def arrow_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """One Arrow file of a saved dataset."""
    yield from _rows(_table_batches(path, text_key), path, text_key)


def _json_records(path: Path, key: str) -> Iterator[tuple[str, object]]:
    """(where, value) of field `key` of each record of a JSON-lines file."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n} is not valid JSON ({exc.msg}).") from None
            if not isinstance(record, dict) or key not in record:
                fields = (f" (its fields: {', '.join(map(str, record))})"
                          if isinstance(record, dict) else "")
                raise ValueError(f"{path}:{n} has no {key!r} field{fields}; set {KEY_SETTING} "
                                 "to the field that holds it.")
            yield f"{path}:{n}", record[key]


def file_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    if path.suffix in (".jsonl", ".json"):
        for where, value in _json_records(path, text_key):
            if value is not None:  # a record without text, as a table's null
                yield document_text(where, text_key, value)
    elif path.suffix == ".parquet":
        yield from parquet_documents(path, text_key)
    elif path.suffix == ".arrow":
        yield from arrow_documents(path, text_key)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def records(source: str, key: str) -> Iterator[tuple[str, object]]:
    """(where, value) of field `key` of every record of a JSON-lines, Parquet or save_to_disk
    source (chat data: its conversations), in order; plain text files hold no fields."""
    for path in source_files(source):
        if path.suffix in (".jsonl", ".json"):
            yield from _json_records(path, key)
        elif path.suffix in (".parquet", ".arrow"):
            yield from _values(_table_batches(path, key), path, key)
        else:
            raise ValueError(f"{path} is plain text, which holds no {key!r} field: chat data is "
                             "JSON lines, Parquet or a save_to_disk folder of records.")


def saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `save_to_disk` folder in order, or None if it is not one."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{folder} holds a DatasetDict of splits ({', '.join(splits)}): give "
                         f"one, e.g. data.source={folder / (splits[0] if splits else 'train')}.")
    state = folder / "state.json"
    if not state.is_file():
        return None
    files = [folder / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{state} lists {f.name}, which is missing from {folder}.")
    return files


def source_files(source: str) -> list[Path]:
    """The files of data.source, in the order their documents are read."""
    path = Path(source)
    if path.is_dir():
        saved = saved_dataset_files(path)
        if saved is not None:
            return saved
        files = sorted(p for p in path.rglob("*") if p.suffix in SOURCE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"data.source={source!r} is a folder with no .txt, .md, "
                                    ".jsonl or .parquet files, and no save_to_disk dataset.")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(
        f"data.source={source!r} does not exist. Give a text, JSON-lines or Parquet file, a "
        "folder of them, a save_to_disk folder, a .bin from `ultrascale tokenize`, or "
        "data.source=builtin.")


def documents(source: str, text_key: str = "text") -> Iterator[str]:
    if source == "builtin":
        yield from builtin_documents()
        return
    for f in source_files(source):
        yield from file_documents(f, text_key)


def text_size(path: Path, text_key: str = "text") -> tuple[int, int, bool]:
    """(bytes, documents, exact) of one file without tokenizing it: for a text or JSON-lines file
    its size and one document (JSON-lines records' syntax, two bytes at least each, bounds their
    separators: not exact); for a table the UTF-8 bytes of its text column and its rows, exact."""
    if path.suffix not in (".parquet", ".arrow"):
        return path.stat().st_size, 1, path.suffix not in (".jsonl", ".json")
    pa = _pyarrow()
    import pyarrow.compute as pc
    import pyarrow.ipc  # noqa: F401  (the submodules)
    import pyarrow.parquet  # noqa: F401
    total = rows = 0
    batches = (pa.parquet.ParquetFile(path).iter_batches(columns=[text_key],
                                                          batch_size=BATCH_ROWS * 16)
               if path.suffix == ".parquet" else None)
    if batches is None:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
            batches = table.select([text_key]).to_batches()
    for batch in batches:
        col = batch.column(text_key)
        rows += len(col) - col.null_count
        total += pc.sum(pc.binary_length(col.cast(pa.string()))).as_py() or 0
    return total, rows, True
