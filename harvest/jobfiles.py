"""One job's folder on storage: the layout that the API, the flows and the pipeline share.

    <storage>/jobs/<job_id>/request.json              the HarvestRequest, written first (by the API)
    <storage>/jobs/<job_id>/shard_00000.safetensors … one per shard
    <storage>/jobs/<job_id>/_parts/shard_00000.safetensors …
                                                      per-shard statistics partial + size/sha256
                                                      record, written after its shard (resume)
    <storage>/jobs/<job_id>/_parts/timings-00002-00005.json
                                                      a scale-out helper's timings, for its range
    <storage>/jobs/<job_id>/_progress.json            what the flow is doing now (stage, tok/s);
                                                      never written after the manifest
    <storage>/jobs/<job_id>/stats.safetensors
    <storage>/jobs/<job_id>/manifest.json             written last: its presence means "done"

`JobFiles` owns these names; nobody else spells them. A flow is given only the URL of
request.json (`JobFiles.from_request_url`), and the job's folder is that URL's folder, so a
corpus refresh can use the same flow on a dated folder outside `jobs/` (`JobFiles(folder)`).

Progress is counted from the `_parts/` records themselves: right however many flow runs share
the job, one fresh listing per read (`Storage.listdir` never answers from a cached listing, so
a long-lived reader on S3 sees each shard as it lands). Every write goes through `Storage`, so it is atomic: a file
that exists is complete. This module is core: no Prefect, no FastAPI.
"""

from __future__ import annotations

import json
import re
import time

from harvest.request import HarvestRequest
from harvest.shard.layout import PARTS, part_name, shard_name, shard_ranges
from harvest.storage import Storage, StorageOptions

__all__ = [
    "JOBS",
    "REQUEST",
    "PROGRESS",
    "PARTS",
    "STATS",
    "MANIFEST",
    "RESULT_FILE",
    "TIMING_KEYS", "TOKEN_KEYS",
    "JobFiles",
]

JOBS = "jobs"
REQUEST = "request.json"
PROGRESS = "_progress.json"
STATS = "stats.safetensors"
MANIFEST = "manifest.json"
RESULT_FILE = re.compile(r"^(shard_\d{5}\.safetensors|stats\.safetensors|manifest\.json)$")
"""The names a result download link may point at (the shards, the statistics, the manifest)."""
TIMING_KEYS = ("load_s", "forward_s", "save_s", "upload_s")
TOKEN_KEYS = ("real_tokens", "padded_tokens")  # the forward passes' tokens, beside the seconds


def _timings_name(start: int, stop: int) -> str:
    return f"{PARTS}/timings-{start:05d}-{stop:05d}.json"


def _writer_of(manifest: bytes) -> str | None:
    """The `writer` a manifest's bytes record (None when it records none)."""
    return json.loads(manifest).get("writer")


class JobFiles:
    """The files of one job, in the folder `storage` (any fsspec URL)."""

    REQUEST = REQUEST
    PROGRESS = PROGRESS
    PARTS = PARTS
    STATS = STATS
    MANIFEST = MANIFEST
    shard_name = staticmethod(shard_name)
    part_name = staticmethod(part_name)

    def __init__(self, storage: Storage):
        self.storage = storage

    def __repr__(self) -> str:
        return f"JobFiles({self.storage.url!r})"

    # --- where ------------------------------------------------------------------------------
    @staticmethod
    def jobs_folder(storage: Storage) -> Storage:
        """`<storage>/jobs`, the parent of every API job's folder (`storage`: the service's root)."""
        return storage.child(JOBS)

    @classmethod
    def for_job(cls, job_id: str, storage: Storage) -> "JobFiles":
        """The API job `job_id`'s folder, `<storage>/jobs/<job_id>` (storage: the service root)."""
        return cls(cls.jobs_folder(storage).child(job_id))

    @classmethod
    def from_request_url(cls, request_url: str, options: StorageOptions) -> "JobFiles":
        """The job whose request.json is at `request_url` (the flow's parameter), its store
        reached with `options`."""
        folder, _, name = request_url.rstrip("/").rpartition("/")
        if name != REQUEST or not folder:
            raise ValueError(f"request_url must end in /{REQUEST}, not {request_url!r}")
        return cls(Storage(folder, options=options))

    @classmethod
    def job_ids(cls, storage: Storage) -> list[str]:
        """Ids of the job folders under `<storage>/jobs`, sorted."""
        return cls.jobs_folder(storage).listdir()

    @property
    def url(self) -> str:
        """Storage URL of the folder."""
        return self.storage.url

    @property
    def request_url(self) -> str:
        """Storage URL of request.json: the `request_url` parameter of the harvest flow."""
        return f"{self.storage.url}/{REQUEST}"

    @property
    def parts(self) -> Storage:
        """The `_parts/` folder of shard records (and helpers' timings)."""
        return self.storage.child(PARTS)

    @staticmethod
    def shard_names(count: int) -> list[str]:
        """The names of shards 0..count-1, in order."""
        return [shard_name(k) for k in range(count)]

    # --- the request --------------------------------------------------------------------------
    @staticmethod
    def request_document(request: HarvestRequest) -> bytes:
        """request.json's bytes for `request`: what `write_request` writes (pydantic's compact
        JSON, UTF-8)."""
        return request.model_dump_json().encode()

    @classmethod
    def request_document_size(cls, request: HarvestRequest) -> int:
        """`len(request_document(request))`, without a second copy of the prompts: admission
        counts request.json (`harvest.cost.kept_bytes`) in the assessing child, where the
        document of a 48 MB body would be 48 MB of str and 48 MB of bytes more. The same
        document with no prompts, plus each prompt as the same encoder writes a list's strings
        (`pydantic_core.to_json`, one at a time) and the commas between them: the compact JSON
        of a list of n strings is `[` s1 `,` … `,` sn `]`."""
        from pydantic_core import to_json

        empty = len(cls.request_document(request.model_copy(update={"prompts": []})))
        prompts = request.prompts
        return empty + sum(len(to_json(prompt)) for prompt in prompts) + max(len(prompts) - 1, 0)

    def write_request(self, request: HarvestRequest) -> str:
        """Write request.json (first, before the run starts); returns `request_url`."""
        self.storage.write_bytes(REQUEST, self.request_document(request))
        return self.request_url

    def read_request(self) -> HarvestRequest:
        return HarvestRequest.model_validate_json(self.storage.read_bytes(REQUEST))

    # --- progress -----------------------------------------------------------------------------
    def shards_done(self) -> int:
        """Shards written so far, counted from their `_parts/` records (one listing)."""
        return sum(1 for name in self.parts.listdir() if name.endswith(".safetensors"))

    def write_progress(self, **fields) -> None:
        """Replace _progress.json (stage, counts, tokens/s); a monitoring aid, not a source of truth."""
        self.storage.write_bytes(PROGRESS, json.dumps({**fields, "updated_at": time.time()}).encode())

    def read_progress(self) -> dict:
        """`{"shards_done", "n_shards"}` from the shard records and the request, with the
        flow's _progress.json (stage, tokens/s…) merged in when present; the counts win. The
        stage is "done" once the manifest exists: the flow writes nothing after the manifest,
        so the file itself last said "finalizing"."""
        request = self.read_request()
        progress = {"shards_done": self.shards_done(), "n_shards": len(shard_ranges(len(request.prompts), request.shard_size))}
        if self.storage.exists(PROGRESS):
            try:
                extra = json.loads(self.storage.read_bytes(PROGRESS))
            except (ValueError, OSError):
                extra = {}
            progress.update({k: v for k, v in extra.items() if k not in progress})
        if self.has_manifest():
            progress["stage"] = "done"
        return progress

    # --- scale-out helpers' timings ----------------------------------------------------------
    def write_helper_timings(self, shard_range: list[int], timings: dict[str, int | float]) -> None:
        """A helper run's timings for its `[start, stop)` range, for the parent to add up."""
        self.storage.write_bytes(_timings_name(*shard_range), json.dumps(timings).encode())

    def read_helper_timings(self, shard_range: list[int]) -> dict[str, int | float] | None:
        """What `write_helper_timings` wrote for this range, or None."""
        name = _timings_name(*shard_range)
        if not self.storage.exists(name):
            return None
        return json.loads(self.storage.read_bytes(name))

    # --- the result ---------------------------------------------------------------------------
    def has_manifest(self) -> bool:
        """True once the job is done (the manifest is written last)."""
        return self.storage.exists(MANIFEST)

    def read_manifest(self) -> dict:
        return json.loads(self.storage.read_bytes(MANIFEST))

    def write_manifest(self, data: bytes) -> int:
        """Write manifest.json (last), under the lock that `discard_manifest`'s check holds."""
        with self.storage.locked(MANIFEST):
            return self.storage.write_bytes(MANIFEST, data)

    def discard_manifest(self, writer: str | None = None) -> bool:
        """Remove the manifest if `writer` wrote it (its `writer` field; None: a manifest that
        names no writer), as a job that fails leaves none; True if removed. A manifest of
        anyone else is kept: a stale attempt of a rescheduled run, failing after its successor
        finished the job, must not undo that job. Checked and removed as one step
        (`Storage.delete_if`), so a successor's manifest landing meanwhile is kept too."""
        return self.storage.delete_if(MANIFEST, lambda data: _writer_of(data) == writer)

    def read_result(self) -> dict | None:
        """The API's result numbers of a finished job, from its manifest (None when there is none)."""
        if not self.has_manifest():
            return None
        manifest = self.read_manifest()
        timings = manifest.get("timings", {})
        return {
            "n_shards": len(manifest["shards"]),
            "layer_indices": manifest["layer_indices"],
            "contents": manifest["contents"],
            "tokens": manifest["tokens"],
            "bytes_written": manifest["bytes_written"],
            "timings": {**{k: float(timings.get(k, 0.0)) for k in TIMING_KEYS}, **{k: int(timings.get(k, 0)) for k in TOKEN_KEYS}},
        }

    def bytes_kept(self) -> int:
        """Bytes of every file in the folder now, `_parts/` and what a killed write left
        included (`Storage.total_bytes`: a fresh listing): what an ended job holds on the store
        until the retention sweep removes the folder (`api.store.bytes_held`)."""
        return self.storage.total_bytes()

    def delete(self) -> None:
        """Remove the whole folder (retention sweep)."""
        self.storage.delete_all()
