"""Reading a prompt corpus: JSONL (a `text` field), plain text (one prompt a line) or parquet.

Any fsspec URL works (a local path, `s3://…`), so the scheduled corpus refresh reads the same
way as `harvest run`.
"""

from __future__ import annotations

import json

import fsspec

from harvest.errors import InvalidRequest

__all__ = ["read_prompts"]


def read_prompts(url: str, *, column: str = "text") -> list[str]:
    """The prompts of a corpus file, in file order. Refuses empty files and missing columns."""
    lower = url.lower()
    try:
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fsspec.open(url, "rb") as handle:
                table = pq.read_table(handle)
            if column not in table.column_names:
                raise InvalidRequest(f"{url} has no column {column!r}; its columns are {table.column_names}.", param="column")
            prompts = [str(v) for v in table.column(column).to_pylist() if v is not None]
        elif lower.endswith((".jsonl", ".json")):
            prompts = []
            with fsspec.open(url, "rt", encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise InvalidRequest(f"{url} line {number} is not JSON: {exc.msg}.", param="prompts") from None
                    if not isinstance(record, dict) or column not in record:
                        raise InvalidRequest(f"{url} line {number} has no {column!r} field.", param="prompts")
                    prompts.append(str(record[column]))
        elif lower.endswith(".txt"):
            with fsspec.open(url, "rt", encoding="utf-8") as handle:
                prompts = [line.rstrip("\n") for line in handle if line.strip()]
        else:
            raise InvalidRequest(f"{url}: the corpus must be .jsonl, .txt or .parquet.", param="prompts")
    except FileNotFoundError:
        raise InvalidRequest(f"{url} does not exist.", param="prompts") from None
    if not prompts:
        raise InvalidRequest(f"{url} holds no prompts.", param="prompts")
    return prompts
