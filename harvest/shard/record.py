"""Shard files and the small record kept beside each one.

Shard k (`harvest.shard.layout.shard_name`) holds prompts `k*shard_size .. (k+1)*shard_size-1`: for
the prompt at global index i, `prompt_{i}` (`[n_layers_kept, n_tokens, n_features]`) and
`tokens_{i}` (int32 `[n_tokens]`, the ids that ran). Its record (`harvest.shard.layout.part_name`)
keeps the shard's exact float64 statistics partial and, in its metadata, the shard's size and
sha256, and the stored file's fingerprint (`Storage.fingerprint`: size, inode and time on
disk, ETag on S3) as it was once published. That record is written after the shard, so a
shard whose record exists and matches is complete: a retry or resume skips it, and the final
merge takes the statistics from the records, and reads a shard again only where its
fingerprint changed (`harvest.shard.writing.stored_records`).
The shard file itself is written as its values arrive (`harvest.shard.file`).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

from pydantic import BaseModel
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from harvest.shard.layout import part_name, shard_name
from harvest.shard.file import shard_layout
from harvest.stats import RunningStats
from harvest.storage import Storage

__all__ = ["ShardRecord", "Part", "write_part", "read_part", "verified_part", "stored_stats"]


class ShardRecord(BaseModel):
    """One shard file, as listed in the manifest."""

    file: str
    """File name under the job's prefix."""
    index: int
    """Shard number k."""
    prompt_range: list[int]
    """`[first, last]` global prompt indices held, inclusive."""
    token_counts: list[int]
    """Tokens per prompt, in prompt order."""
    bytes: int
    """File size."""
    sha256: str
    """Hex digest of the file."""


class Part(NamedTuple):
    """Shard k's record as kept beside it."""

    record: ShardRecord
    stats: RunningStats
    stored_as: str | None = None
    """The file's `Storage.fingerprint` once published (None: a store without one)."""


def write_part(storage: Storage, record: ShardRecord, stats: RunningStats, stored_as: str | None = None) -> None:
    metadata = {"record": record.model_dump_json(), **({"stored_as": stored_as} if stored_as else {})}
    storage.write_bytes(part_name(record.index), save_tensors(stats.state_dict(), metadata=metadata))


def read_part(storage: Storage, k: int) -> Part:
    raw = storage.read_bytes(part_name(k))
    # safetensors keeps string metadata in its JSON header: 8 bytes of length, then the header.
    header_len = int.from_bytes(raw[:8], "little")
    metadata = json.loads(raw[8 : 8 + header_len])["__metadata__"]
    record = ShardRecord.model_validate_json(metadata["record"])
    return Part(record, RunningStats.from_state_dict(load_tensors(raw)), metadata.get("stored_as"))


def verified_part(storage: Storage, k: int, *, check_hash: bool = True) -> Part | None:
    """The record of shard k if the shard on storage is complete and matches it, else None.

    `check_hash=False` checks only the size, for a caller that checks the files itself
    (`harvest.shard.writing.stored_records`, many at once).
    """
    try:
        part = read_part(storage, k)
    except FileNotFoundError:
        return None
    record = part.record
    if not storage.exists(record.file) or storage.size(record.file) != record.bytes:
        return None
    if check_hash and storage.digest(record.file)[1] != record.sha256:
        return None
    return part


def stored_stats(storage: Storage, record: ShardRecord, n_layers: int, n_features: int, dtype: torch.dtype) -> RunningStats:
    """The statistics partial of shard `record.file` as stored now, read one prompt's byte range
    at a time (the layout follows from the record's token counts): for a shard whose file is
    not the one its record's write made."""
    indices = range(record.prompt_range[0], record.prompt_range[1] + 1)
    layout = shard_layout(indices, record.token_counts, n_layers, n_features, dtype)
    stats = RunningStats(n_layers, n_features)
    with storage.fs.open(storage.path(record.file), "rb", cache_type="none") as handle:
        for i, n_tokens in zip(indices, record.token_counts, strict=True):
            start, end = layout.ranges[f"prompt_{i}"]
            handle.seek(start)
            values = torch.frombuffer(bytearray(handle.read(end - start)), dtype=dtype).view(n_layers, n_tokens, n_features)
            stats.update(values[:, 1:])  # as `harvest.capture` counts: never a prompt's first position
    return stats
