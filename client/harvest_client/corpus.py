"""A corpus of prompts from what a researcher has at hand: a list, any iterable of strings, or a
`.jsonl` (a field per line, `column`), `.txt` (one prompt a line) or `.parquet` (`column`)
file at any fsspec URL (a local path, `s3://…`). The same formats `harvest run` reads."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import fsspec

__all__ = ["read_corpus"]


def read_corpus(prompts: str | os.PathLike | Iterable[str], *, column: str = "text") -> list[str]:
    """The prompts in corpus order. Refuses an empty corpus, empty prompts and non-strings
    (the service would refuse them too, but only after the first jobs ran)."""
    if isinstance(prompts, (str, os.PathLike)):
        texts = _read_file(os.fspath(prompts), column)
    else:
        texts = list(prompts)
    if not texts:
        raise ValueError("The corpus holds no prompts.")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise ValueError(f"Prompt {i} is {text!r}: every prompt must be a non-empty string.")
    return texts


def _read_file(url: str, column: str) -> list[str]:
    lower = url.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as handle:
            table = pq.read_table(handle)
        if column not in table.column_names:
            raise ValueError(f"{url} has no column {column!r}; its columns are {table.column_names}.")
        return [str(v) for v in table.column(column).to_pylist() if v is not None]
    if lower.endswith((".jsonl", ".json")):
        texts = []
        with fsspec.open(url, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or column not in record:
                    raise ValueError(f"{url} line {number} has no {column!r} field.")
                texts.append(str(record[column]))
        return texts
    if lower.endswith(".txt"):
        with fsspec.open(url, "rt", encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle if line.strip()]
    raise ValueError(f"{url}: a corpus file must be .jsonl, .txt or .parquet.")
