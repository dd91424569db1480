"""Downloading a finished job's files: in parallel, resuming partial files, verified.

Each file goes to `<name>.partial` and is renamed to its name only once its sha256 matches the
manifest, so a file with its own name is verified and is never fetched again; a `.partial`
left by a kill or Ctrl-C is continued with an HTTP `Range` request (a server that answers 200
instead of 206 sends the file whole, and it is written afresh). The manifest itself is written
last, after every other file verified: the local folder keeps the service's rule that a
manifest means a complete job.

File names come from the manifest, which the client does not control: a name that would land
outside the job's folder (`..`, an absolute path, any path separator) is refused
(`UnsafeManifest`) before anything is written.

`stats.safetensors` has no sha256 in the manifest (it lists one per shard only): it is
checked by its size (`bytes_written` minus the shards) and by its `count`, which must equal
the token positions the manifest lists minus each prompt's first.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin

import httpx

from harvest_client.errors import UnsafeManifest, VerificationError
from harvest_client.folder import MANIFEST, PARTIAL, STATS, write_atomic

__all__ = ["VerificationError", "UnsafeManifest", "Stopped", "FileSpec", "Downloader", "JobDownload", "download_file",
           "safe_file_name"]

_CHUNK = 1 << 20
_ATTEMPTS = 3


class Stopped(Exception):
    """The harvest is being interrupted: the file stays `.partial`, to be resumed."""


def safe_file_name(name: object, dest: Path) -> str:
    """`name` if it is a plain file name inside `dest`; else `UnsafeManifest`."""
    if (
        not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
        or Path(name).is_absolute() or (dest / name).resolve().parent != dest.resolve()
    ):
        raise UnsafeManifest(f"The manifest names a file {name!r} outside the job's folder {dest}; refused.")
    return name


@dataclass(frozen=True)
class FileSpec:
    name: str
    index: int | None
    """Shard number (its position in `shard_urls`), None for the statistics."""
    size: int
    sha256: str | None


def _sha256_of(path: Path) -> "hashlib._Hash":
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest


def download_file(http: httpx.Client, url: str, dest: Path, spec: FileSpec, on_bytes: Callable[[int], None] = lambda n: None,
                  stop: threading.Event | None = None) -> int:
    """Fetch `url` into `dest` (resuming `dest.partial`), verify it against `spec`, rename it
    into place. Returns the bytes fetched over the network by this call."""
    partial = dest.with_name(dest.name + PARTIAL)
    have = partial.stat().st_size if partial.exists() else 0
    if have > spec.size:  # not this file's beginning: start over
        partial.unlink()
        have = 0
    digest = _sha256_of(partial) if have else hashlib.sha256()
    fetched = 0
    if have < spec.size:
        headers = {"Range": f"bytes={have}-"} if have else {}
        with http.stream("GET", url, headers=headers, timeout=600) as response:
            if response.status_code == 200 and have:  # the server ignored the range
                have, digest = 0, hashlib.sha256()
            elif response.status_code not in (200, 206):
                response.read()
                raise httpx.HTTPStatusError(f"{response.status_code} for {dest.name}", request=response.request, response=response)
            with open(partial, "ab" if have else "wb") as handle:
                for chunk in response.iter_bytes(_CHUNK):
                    if stop is not None and stop.is_set():  # Ctrl-C: keep what came, stop now
                        raise Stopped(dest.name)
                    handle.write(chunk)
                    digest.update(chunk)
                    fetched += len(chunk)
                    on_bytes(len(chunk))
    size = partial.stat().st_size
    if size != spec.size or (spec.sha256 is not None and digest.hexdigest() != spec.sha256):
        partial.unlink()
        raise VerificationError(f"{dest.name}: {size} bytes, sha256 {digest.hexdigest()[:12]}…; "
                                f"the manifest says {spec.size} bytes, sha256 {(spec.sha256 or '-')[:12]}…")
    partial.replace(dest)
    return fetched


def _check_stats(path: Path, expected_count: int, n_layers: int) -> None:
    from safetensors.numpy import load_file

    stats = load_file(str(path))
    if int(stats["count"]) != expected_count or stats["mean"].shape[0] != n_layers:
        path.unlink()
        raise VerificationError(f"{path.name}: count {int(stats['count'])} over {stats['mean'].shape[0]} layers; "
                                f"the manifest implies {expected_count} over {n_layers}.")


@dataclass
class JobDownload:
    """One job's files being fetched into `dest`; `finish()` writes the manifest once all verified."""

    job_id: str
    dest: Path
    manifest_bytes: bytes
    futures: list[Future] = field(default_factory=list)

    @property
    def manifest(self) -> dict:
        return json.loads(self.manifest_bytes)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def finish(self) -> int:
        """Raise the first file error, else write the manifest; returns bytes fetched."""
        fetched = sum(f.result() for f in self.futures)
        manifest = self.manifest
        expected = sum(n - 1 for shard in manifest["shards"] for n in shard["token_counts"] if n > 0)
        _check_stats(self.dest / STATS, expected, len(manifest["layer_indices"]))
        write_atomic(self.dest / MANIFEST, self.manifest_bytes)
        return fetched


class Downloader:
    """A pool of download threads shared by every job of a harvest.

    `fresh_harvest(job_id)` reads the job again: each read of a done job makes new links, so a
    link refused (expired) during a long download is replaced rather than fatal."""

    def __init__(self, fresh_harvest: Callable[[str], dict], *, workers: int = 8, api_base: str = "",
                 on_bytes: Callable[[int], None] = lambda n: None):
        self.fresh_harvest = fresh_harvest
        self.api_base = api_base
        self.on_bytes = on_bytes
        self.http = httpx.Client(follow_redirects=True, timeout=600)  # links need no key
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="harvest-download")
        self.stop = threading.Event()

    def close(self, cancel: bool = False) -> None:
        """Wait for the queued files, or (`cancel`) drop them and stop those under way
        mid-chunk, leaving their `.partial` files to be resumed."""
        if cancel:
            self.stop.set()
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        self.http.close()

    def _url(self, link: str) -> str:
        return urljoin(self.api_base.rstrip("/") + "/", link)

    def _get(self, link: str) -> bytes:
        response = self.http.get(self._url(link))
        response.raise_for_status()
        return response.content

    def start(self, harvest: dict, dest: Path) -> JobDownload:
        """Fetch the manifest (small) now, and queue every file not yet verified in `dest`."""
        dest.mkdir(parents=True, exist_ok=True)
        result = harvest["result"]
        if harvest.get("urls_expired"):
            raise VerificationError(f"Job {harvest['job_id']}'s files were swept after the retention period; submit it again.")
        manifest_bytes = self._get(result["manifest_url"])
        manifest = json.loads(manifest_bytes)
        shards = manifest["shards"]
        if len(shards) != len(result["shard_urls"]):
            raise VerificationError(f"Job {harvest['job_id']}: {len(result['shard_urls'])} links for {len(shards)} shards.")
        files = [FileSpec(safe_file_name(s["file"], dest), k, s["bytes"], s["sha256"]) for k, s in enumerate(shards)]
        stats_size = manifest["bytes_written"] - sum(s["bytes"] for s in shards)
        files.append(FileSpec(STATS, None, stats_size, None))
        job = JobDownload(harvest["job_id"], dest, manifest_bytes)
        for spec in files:
            if not (dest / spec.name).exists():  # named = verified earlier: never fetched again
                job.futures.append(self.pool.submit(self._fetch, harvest, dest, spec))
        return job

    def _link(self, harvest: dict, spec: FileSpec) -> str:
        result = harvest["result"]
        return result["stats_url"] if spec.index is None else result["shard_urls"][spec.index]

    def _fetch(self, harvest: dict, dest: Path, spec: FileSpec) -> int:
        fetched = 0
        for attempt in range(_ATTEMPTS):
            try:
                return fetched + download_file(self.http, self._url(self._link(harvest, spec)), dest / spec.name, spec, self.on_bytes, self.stop)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in (403, 404) or attempt == _ATTEMPTS - 1:
                    raise
                harvest = self.fresh_harvest(harvest["job_id"])  # an expired link: new ones
            except (httpx.TransportError, VerificationError):
                if attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

