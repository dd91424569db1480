"""Where a job's files are, and what a job's progress is: the layout the API and flows share.

    <storage>/jobs/<job_id>/request.json        the HarvestRequest body, written by the API first
    <storage>/jobs/<job_id>/shard_00000.safetensors ...
    <storage>/jobs/<job_id>/_parts/…            per-shard statistics + size/sha256 (resume)
    <storage>/jobs/<job_id>/_progress.json      what the flow is doing now (stage, shards, tok/s)
    <storage>/jobs/<job_id>/stats.safetensors
    <storage>/jobs/<job_id>/manifest.json       written last: its presence means "done"

The flow is given only the URL of request.json; the job's prefix is that URL's folder, so a
corpus refresh can use the same flow for a dated prefix outside `jobs/`.
"""

from __future__ import annotations

import json
import math
import time

from harvest.request import HarvestRequest
from harvest.shards import PARTS
from harvest.storage import Storage, open_storage

__all__ = [
    "REQUEST",
    "PROGRESS",
    "job_prefix",
    "job_url",
    "request_url",
    "job_storage",
    "write_request",
    "read_request",
    "n_shards_of",
    "read_progress",
    "write_progress",
]

REQUEST = "request.json"
PROGRESS = "_progress.json"


def job_prefix(job_id: str) -> str:
    return f"jobs/{job_id}"


def job_url(job_id: str, storage: Storage | None = None) -> str:
    """Storage URL of a job's folder (under HARVEST_STORAGE_URL by default)."""
    return (storage or open_storage()).child(job_prefix(job_id)).url


def request_url(job_id: str, storage: Storage | None = None) -> str:
    """Storage URL of a job's request.json: the `request_url` flow parameter."""
    return f"{job_url(job_id, storage)}/{REQUEST}"


def job_storage(request_url: str) -> Storage:
    """The job's folder, from the URL of its request.json."""
    folder, _, name = request_url.rstrip("/").rpartition("/")
    if name != REQUEST or not folder:
        raise ValueError(f"request_url must end in /{REQUEST}, not {request_url!r}")
    return Storage(folder)


def write_request(job_id: str, request: HarvestRequest, storage: Storage | None = None) -> str:
    """Write request.json for a job (what the API does before starting the run); returns its URL."""
    folder = (storage or open_storage()).child(job_prefix(job_id))
    folder.write_bytes(REQUEST, request.model_dump_json().encode())
    return f"{folder.url}/{REQUEST}"


def read_request(storage: Storage) -> HarvestRequest:
    return HarvestRequest.model_validate_json(storage.read_bytes(REQUEST))


def n_shards_of(request: HarvestRequest) -> int:
    return math.ceil(len(request.prompts) / request.shard_size)


def write_progress(storage: Storage, **fields) -> None:
    """Replace _progress.json (atomic write); a monitoring aid, not a source of truth."""
    storage.write_bytes(PROGRESS, json.dumps({**fields, "updated_at": time.time()}).encode())


def read_progress(storage: Storage) -> dict:
    """`{"shards_done", "n_shards"}` counted from the shard records themselves.

    Counting `_parts/` is right however many workers share the job, and costs one listing;
    the flow's `_progress.json` (stage, tokens/s) is merged in when present.
    """
    request = read_request(storage)
    done = sum(1 for name in storage.child(PARTS).listdir() if name.endswith(".safetensors"))
    progress = {"shards_done": done, "n_shards": n_shards_of(request)}
    if storage.exists(PROGRESS):
        try:
            extra = json.loads(storage.read_bytes(PROGRESS))
        except (ValueError, OSError):
            extra = {}
        progress.update({k: v for k, v in extra.items() if k not in progress})
    return progress
