"""Which prompts each shard holds, and the names of a shard and of its record in a job's folder
(`harvest.jobfiles` lays out the rest of the folder)."""

from __future__ import annotations

__all__ = ["PARTS", "shard_name", "part_name", "shard_ranges"]

PARTS = "_parts"
"""The folder of the shards' records, beside the shards."""


def shard_name(k: int) -> str:
    """`shard_{k:05d}.safetensors`: prompts `k*shard_size .. (k+1)*shard_size-1`."""
    return f"shard_{k:05d}.safetensors"


def part_name(k: int) -> str:
    """Shard k's record (statistics partial, size, sha256), beside the shards in `_parts/`."""
    return f"{PARTS}/{shard_name(k)}"


def shard_ranges(n_prompts: int, shard_size: int) -> list[range]:
    """The prompts each shard file of a job of `n_prompts` holds, in order: `shard_size` each,
    the last one the rest. The one place a shard size becomes shards."""
    return [range(start, min(start + shard_size, n_prompts)) for start in range(0, n_prompts, shard_size)]
