"""Response shapes of the harvest routes (published in `/openapi.json`) and how a job row
becomes the harvest object."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from pydantic import BaseModel

from api.db import aware
from api.links import JobLinks, Signed
from harvest.jobfiles import JobFiles
from harvest.storage import Storage
from harvest.timings import Timings

__all__ = ["Progress", "Result", "Harvest", "HarvestList", "ErrorBody", "render"]


class Progress(BaseModel):
    shards_done: int
    """Shard files written so far."""
    n_shards: int
    """Shard files the job writes in all."""


class Result(BaseModel):
    n_shards: int
    layer_indices: list[int]
    contents: str
    """activations | projections."""
    tokens: int
    """Token positions in the files, start tokens included."""
    bytes_written: int
    timings: Timings
    shard_urls: list[str] | None = None
    """One presigned link per shard, in order (absent once urls_expired)."""
    manifest_url: str | None = None
    stats_url: str | None = None


class Harvest(BaseModel):
    object: str = "harvest"
    job_id: str
    status: str
    """pending | running | done | failed | cancelled."""
    model: str
    lane: str
    n_prompts: int
    layers: list[int]
    shard_size: int
    add_special_tokens: bool
    contents: str
    reserved_tokens: int
    """Tokens held while the job is active (the submit-time estimate)."""
    tokens: int | None
    """Tokens charged, once the job ended."""
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    error: str | None
    progress: Progress
    run_id: str | None = None
    """The Prefect flow run of the job."""
    result: Result | None = None
    urls_expire_at: datetime | None = None
    """When the links stop working: at least `url_expiry_s` less 5 minutes after this read (a
    read may hand out links signed up to 5 minutes earlier, `api.links.REUSE_MAX_S`), or at
    the end of retention."""
    urls_expired: bool | None = None


class HarvestList(BaseModel):
    object: str = "list"
    data: list[Harvest]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    error: ErrorDetail


def _iso(value: datetime | None) -> str | None:
    return None if value is None else aware(value).isoformat()


def render(row: dict, storage: Storage, links: JobLinks | None, *, check_files: bool = False,
           reuse: bool = False) -> dict:
    """The harvest object of a job row, with fresh links when it is done (`links=None`: the
    result's numbers only, as the list gives them); with `reuse`, links signed for an earlier
    read of it are handed out again while fresh enough (`api.links.LinkCache`). The row must be
    one the caller's key may read (`api.store.get_job` with its key).

    Links expire `url_expiry_s` after they are signed, and never after the files' retention ends.
    Past retention (or when the sweep already removed the manifest) the result keeps its
    numbers, drops its links, and the job says `urls_expired: true`.
    """
    status = row["status"]
    body = {
        "object": "harvest",
        "job_id": row["id"],
        "status": status,
        "model": row["model"],
        "lane": row["lane"],
        "n_prompts": row["n_prompts"],
        "layers": list(row["layers"]),
        "shard_size": row["shard_size"],
        "add_special_tokens": row["add_special_tokens"],
        "contents": row["contents"],
        "reserved_tokens": row["reserved_tokens"],
        "tokens": row["tokens"],
        "created_at": _iso(row["created_at"]),
        "started_at": _iso(row["started_at"]),
        "completed_at": _iso(row["completed_at"]),
        "error": row["error"],
        "progress": {"shards_done": row["shards_done"], "n_shards": row["n_shards"]},
        "run_id": row["flow_run_id"],
    }
    if status != "done" or row["result"] is None:
        return body
    result = dict(row["result"])
    body["result"] = result
    if links is None:
        return body
    now = datetime.now(timezone.utc)
    purge_at = aware(row["completed_at"]) + timedelta(days=links.retention_days)
    files = JobFiles.for_job(row["id"], storage)
    if now >= purge_at or (check_files and not files.has_manifest()):
        links.cache.forget(row["id"])
        body["urls_expired"] = True
        return body

    def sign() -> Signed:
        expires = min(int(time.time()) + links.expiry_s, int(purge_at.timestamp()))
        link = lambda name: links.signer.presign(storage, row["id"], name, expires, links.base_url)  # noqa: E731
        return expires, {
            "shard_urls": [link(name) for name in files.shard_names(result["n_shards"])],
            "manifest_url": link(files.MANIFEST),
            "stats_url": link(files.STATS),
        }

    expires, signed = links.cache.links(row["id"], links.base_url, sign) if reuse else sign()
    result.update(signed)
    body["urls_expire_at"] = datetime.fromtimestamp(expires, timezone.utc).isoformat()
    body["urls_expired"] = False
    return body
