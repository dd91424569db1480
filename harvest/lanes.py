"""The GPU lanes, as data: `infra/lanes.toml` (or the file `HARVEST_LANES_FILE` names).

A lane is a fleet of worker hosts serving the same class of models: its Prefect work pool has
the lane's name and its deployment is `harvest-<lane>` (`flows.deploy`), the registry checks
that every model names a declared lane (`harvest.registry`), and the API caps jobs per key and
service-wide per lane (`api.store`) and refuses shards too big for the lane's hosts
(`harvest.cost`). Nothing else spells a lane: adding one is a config edit plus `harvest server`.
"""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from harvest.settings import Settings, get_settings

__all__ = ["Lane", "load_lanes", "deployment_name"]

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
    description: str = ""

    @property
    def deployment(self) -> str:
        return deployment_name(self.name)


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


def load_lanes(settings: Settings | None = None) -> dict[str, Lane]:
    """The declared lanes by name (re-read when the file changes)."""
    path = (settings or get_settings()).lanes_file
    try:
        mtime = path.stat().st_mtime
    except OSError as exc:
        raise ValueError(f"cannot read the lanes file {path}: {exc}") from exc
    return _cached(path, mtime)
