"""The GPU lanes, as data: `infra/lanes.toml` (or the file `HARVEST_LANES_FILE` names).

A lane is a fleet of worker hosts serving the same class of models: its Prefect work pool has
the lane's name and its deployment is `harvest-<lane>` (made by `harvest server`), the registry checks
that every model names a declared lane (`harvest.registry`), and the API caps jobs per key and
service-wide per lane (in its job store) and refuses shards too big for the lane's hosts
(`harvest.cost`). Within the pool each key's runs wait in a work queue of their own, limited to
`key_run_limit` runs at once (the key queues of the orchestration layer), so one key never holds every slot of the
lane. Nothing else spells a lane: adding one is a config edit plus `harvest server`.
"""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, model_validator

from harvest.settings import Settings

__all__ = ["Lane", "load_lanes", "deployment_name", "default_key_run_limit"]

NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class Lane(BaseModel, frozen=True):
    """One lane's operational numbers."""

    name: str
    pool_limit: int | None = Field(default=None, ge=0)
    """Flow runs at once in the lane's work pool; None is no limit."""
    key_limit: int = Field(default=1, ge=0)
    """Default concurrent jobs per API key in this lane (a key may have its own)."""
    capacity: int = Field(default=64, ge=0)
    """Jobs queued or running across the service; more are refused with harvest_capacity_exceeded."""
    gpus_per_run: int = Field(default=1, ge=1)
    """GPUs one flow run of this lane uses."""
    max_shard_bytes: int | None = Field(default=None, ge=1)
    """Most bytes of one shard file: what a worker host's disk (where a shard is staged) or
    one object of the store holds. A submit whose shards would be bigger is refused at
    admission naming the largest shard_size that fits (`harvest.cost`); None is no limit."""
    key_run_limit: int | None = Field(default=None, ge=1)
    """Flow runs of one API key at once in the lane's pool (its work queue's limit); a key's
    further runs wait in its queue while other keys' runs take the free slots. Left out:
    `default_key_run_limit`."""
    description: str = ""

    @model_validator(mode="before")
    @classmethod
    def _default_key_run_limit(cls, data: dict) -> dict:
        if isinstance(data, dict) and data.get("key_run_limit") is None:
            data = {**data, "key_run_limit": default_key_run_limit(data.get("pool_limit"))}
        return data

    @property
    def deployment(self) -> str:
        return deployment_name(self.name)


def default_key_run_limit(pool_limit: int | None) -> int | None:
    """One slot fewer than the pool: whatever one key sends, another key's run finds a slot,
    and a lone key still uses all but one. A pool of one slot cannot be shared (1), and a pool
    without a limit needs no share (None)."""
    if pool_limit is None:
        return None
    return max(pool_limit - 1, 1)


def deployment_name(lane: str) -> str:
    """The Prefect deployment (flow/name) that runs this lane's harvest jobs."""
    return f"harvest/harvest-{lane}"


def _parse(path: Path) -> dict[str, Lane]:
    try:
        tables = tomllib.loads(path.read_text()).get("lanes", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the lanes file {path}: {exc}") from exc
    if not tables:
        raise ValueError(f"{path} declares no lanes ([lanes.<name>] tables)")
    lanes = {}
    for name, table in tables.items():
        if not NAME.match(name):
            raise ValueError(f"{path}: lane name {name!r} must be lowercase letters, digits and '-'")
        try:
            lanes[name] = Lane(name=name, **table)
        except ValidationError as exc:
            raise ValueError(f"{path}: lane {name}: {exc.errors()[0]['loc'][0]} {exc.errors()[0]['msg']}") from exc
    return lanes


@lru_cache(maxsize=8)
def _cached(path: Path, mtime: float) -> dict[str, Lane]:
    return _parse(path)


def load_lanes(settings: Settings) -> dict[str, Lane]:
    """The lanes `settings.lanes_file` declares, by name (re-read when the file changes)."""
    path = settings.lanes_file
    try:
        mtime = path.stat().st_mtime
    except OSError as exc:
        raise ValueError(f"cannot read the lanes file {path}: {exc}") from exc
    return _cached(path, mtime)
