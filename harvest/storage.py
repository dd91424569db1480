"""Job files on any fsspec filesystem: local disk by default, S3 in production, memory in tests.

Every write is all-or-nothing from a reader's point of view: on local disk a file is written
beside its target and renamed (a shard: linked, see below) into place, and an object store's
PUT (or multipart upload, for large files on S3) is atomic already. So a file that exists is
complete, which is what lets `manifest.json`, written last, mean "done". On local disk that
must hold across a power cut too: the file's data is fsynced before the rename or link (else
it can reach the disk before the data, leaving a complete-looking name over an empty or
partial file) and its folder after (else the new name itself can be lost, and a manifest
written after it survive without it).
What goes where inside a job's folder is `harvest.jobfiles`; this module knows no file names.
On local disk, files are created 0600 and new folders 0700 (`harvest.private_files`): they hold
researchers' prompts and activations, for the service's user alone (researchers download them
through the API's links).

A shard is published create-once (`publish_file`): the first write of a name makes it, and
every later one fails with `FileExistsError` and changes nothing. That is what fences a writer
that was taken over while still alive (a scale-out helper marked Crashed, a rescheduled run's
cut-off process): whichever write of a shard lands first is the shard for good, so a manifest
that hashed it can never be contradicted by a write landing after it. On local disk the staged
file is hard-linked to its name (`os.link` fails if the name exists; a rename would replace
it), on S3 the PUT or the multipart upload's completion carries `If-None-Match: *` (s3fs's
`mode="create"`; AWS S3, MinIO and moto's server answer 412 when the key exists, s3fs raises
`FileExistsError`, and aborts the upload; AWS may answer two creates at the same moment 409
`ConditionalRequestConflict`, an `OSError` the write task retries into a 412). The loser
hands the name to the winner's file (`harvest.shard.writing.write_shard` lists the stored bytes,
never its own), and a retry whose earlier try landed finds its own bytes there. Per-attempt
names with the manifest naming the winner would fence as well, but change the shard names
that the SPEC, the client's downloads, the links and the resume all read, and leave the
losers' copies to sweep; here nothing is renamed and nothing is left over. A store that
ignores the condition (an old S3-compatible server) replaces instead: the manifest's check of
each shard is still there for it (`harvest.shard.writing.stored_records`): a replaced object has
another ETag than the one its record kept (`fingerprint`), and is then hashed again. A shard damaged in
place is deleted before it is written again (`harvest.shard.writing.run_shards`): that delete,
then create, is the one replacement, and only a resume does it.

Every read sees the store as it is now. s3fs answers `ls` (and `exists`, `info`) from a
listings cache once a folder was listed, and fsspec hands one filesystem object to every caller
with the same options, so a long-lived reader (the API's watcher reading manifests and
measuring folders, a retention sweep) would keep answering from its first listing: shard
counts frozen, a manifest written since reported missing. So S3 filesystems opened here keep no listings cache
(`use_listings_cache=False`), and the reads below drop any cached listing of their path first
(`_fresh`), for filesystems handed in by a caller too.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import posixpath
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec.core import url_to_fs

from harvest.private_files import open_private, private_dirs
from harvest.settings import Settings

__all__ = ["Storage", "StorageOptions", "open_storage", "stream_digest", "HASH_CHUNK_BYTES"]

_CREATE_LOCK = threading.Lock()
"""Makes an exists-then-write one step on stores with no create-once write of their own
(fsspec's in-memory store of tests, which lives in one process)."""

_NAME_LOCK = threading.Lock()
"""`Storage.locked` on in-process stores (fsspec's in-memory store of tests)."""

_CONDITIONAL_TRIES = 5
"""Conditional deletes tried before giving up on an object that keeps being replaced."""

HASH_CHUNK_BYTES = 8 << 20
"""Read size of a hashing pass (one buffer, reused)."""


@dataclass(frozen=True)
class StorageOptions:
    """How a store is reached and filled, beyond its URL: handed in by whoever opens it (an
    entry point builds them from its settings with `StorageOptions.of`), never looked up."""

    s3_endpoint_url: str | None = None
    """An S3-compatible server (MinIO, moto) for `s3://` URLs; None is AWS."""
    s3_part_bytes: int = Settings.model_fields["s3_part_bytes"].default
    """Part size of multipart uploads (`HARVEST_S3_PART_BYTES`)."""
    staging_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "harvest-staging")
    """Local folder where shards for a remote store are built (`HARVEST_STAGING_DIR`)."""

    @classmethod
    def of(cls, settings: Settings) -> "StorageOptions":
        return cls(settings.s3_endpoint_url, settings.s3_part_bytes, settings.resolved_staging_dir)

    def connection(self, url: str) -> dict:
        """fsspec's options for `url` (an S3 endpoint for S3-compatible servers)."""
        if not url.startswith("s3://"):
            return {}
        options: dict = {"use_listings_cache": False}  # see the module docstring
        if self.s3_endpoint_url:
            options["client_kwargs"] = {"endpoint_url": self.s3_endpoint_url}
        return options


class Storage:
    """A folder of files under one URL prefix."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None, root: str | None = None,
                 options: StorageOptions | None = None):
        self.url = url.rstrip("/")
        self.options = options or StorageOptions()
        if fs is None:
            fs, root = url_to_fs(self.url, **self.options.connection(self.url))
        self.fs = fs
        self.root = root.rstrip("/")

    @property
    def is_local(self) -> bool:
        return "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @property
    def _is_s3(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return "s3" in protocols

    def child(self, prefix: str) -> "Storage":
        """The storage of a sub-folder, e.g. one job's prefix."""
        return Storage(f"{self.url}/{prefix}", self.fs, posixpath.join(self.root, prefix), self.options)

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def write_bytes(self, name: str, data: bytes) -> int:
        """Write a whole file atomically, replacing any earlier version; returns its size."""
        target = self.path(name)
        if self.is_local:
            private_dirs(os.path.dirname(target))
            staging = f"{target}.{uuid.uuid4().hex}.partial"
            try:
                with os.fdopen(open_private(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                _rename_durably(staging, target)
            except BaseException:
                # A disk that filled up must not stay fuller by our half-written file: the
                # write's retry (and everyone else) needs the space back.
                if os.path.exists(staging):
                    os.unlink(staging)
                raise
        elif self._is_s3:
            # s3fs sends a file of two parts or more as one multipart upload (parts in
            # parallel); the object appears only when the upload completes, so still atomic.
            self.fs.pipe_file(target, data, chunksize=self.options.s3_part_bytes)
        else:
            self.fs.pipe_file(target, data)
        return len(data)

    def _fresh(self, path: str) -> str:
        """Forget any cached listing of `path` (and its parents), so the next call asks the store."""
        self.fs.invalidate_cache(path)
        return path

    # -- files staged on local disk (shards written as their values arrive) ---------------

    def staging_path(self, name: str) -> str:
        """A local path to build file `name` in before `publish_file`: beside its target on
        local disk (so publishing is a hard link), else under `HARVEST_STAGING_DIR`."""
        if self.is_local:
            target = self.path(name)
            private_dirs(os.path.dirname(target))
            return f"{target}.{uuid.uuid4().hex}.partial"
        folder = self.options.staging_dir
        private_dirs(folder)
        return str(folder / f"{uuid.uuid4().hex}-{posixpath.basename(name)}.partial")

    def publish_file(self, name: str, local_path: str) -> None:
        """Make the staged file at `local_path` the file `name`, atomically and only if `name`
        does not exist yet, and remove the staged copy. If it exists (another write of it came
        first: see the module docstring) raise `FileExistsError`, the stored file untouched
        and the staged copy removed all the same.

        On local disk a hard link, the file's data flushed before it and the folder after; on
        S3 one multipart upload read from the file part by part (s3fs's `put_file`,
        `HARVEST_S3_PART_BYTES` per part), so memory holds parts, never the file, completed
        only if the key is free; elsewhere (in-memory stores of tests) `write_bytes` after an
        existence check, the two under one lock."""
        target = self.path(name)
        try:
            if self.is_local:
                _fsync_path(local_path)
                os.link(local_path, target)  # never replaces: FileExistsError if taken
                _fsync_path(os.path.dirname(target) or ".")
            elif self._is_s3:
                self.fs.put_file(local_path, target, chunksize=self.options.s3_part_bytes, mode="create")
            else:
                with _CREATE_LOCK:
                    if self.exists(name):
                        raise FileExistsError(f"{target} exists")
                    with open(local_path, "rb") as handle:
                        self.write_bytes(name, handle.read())
        except FileExistsError:
            os.unlink(local_path)  # the name is settled; this copy will never be published
            raise
        os.unlink(local_path)

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def digest(self, name: str) -> tuple[int, str]:
        """Size and sha256 of file `name` as stored now, read `HASH_CHUNK_BYTES` at a time into
        one reused buffer: a shard can be larger than memory."""
        with self.fs.open(self._fresh(self.path(name)), "rb", block_size=HASH_CHUNK_BYTES, cache_type="none") as handle:
            return stream_digest(handle)

    def fingerprint(self, name: str) -> str | None:
        """What names file `name`'s bytes as stored now without reading them: on local disk its
        size, inode and modification time (a replacement is another inode, a write in place
        another time), on S3 its size and ETag (a replacement, or a second upload of the same
        bytes, has another); None on stores with neither, whose files are hashed instead."""
        path = self._fresh(self.path(name))
        if self.is_local:
            st = os.stat(path)
            return f"local:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
        if self._is_s3:
            info = self.fs.info(path)
            return f"s3:{info['size']}:{info['ETag']}"
        return None

    def exists(self, name: str) -> bool:
        return self.fs.exists(self._fresh(self.path(name)))

    def size(self, name: str) -> int:
        return self.fs.size(self._fresh(self.path(name)))

    def delete(self, name: str) -> None:
        if self.exists(name):
            self.fs.rm(self.path(name))

    # -- a file removed only by its own writer (a stale run's failure path) ----------------

    @contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Hold file `name`'s lock while the block runs: a write of `name` made under it never
        lands between `delete_if`'s check and its removal, in any process. On local disk an
        exclusive `flock` of the folder that holds it (a directory opened read-only: no lock
        file to leave behind, and nothing written into the folder by taking it, so a manifest
        stays the folder's last write); in-process stores (tests) a process-wide lock; on S3
        nothing, since `delete_if` is conditional on the object's ETag there and needs no
        writer's help."""
        if self._is_s3:
            yield
            return
        if not self.is_local:
            with _NAME_LOCK:
                yield
            return
        folder = posixpath.dirname(self.path(name))
        private_dirs(folder)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes
            yield
        finally:
            os.close(fd)

    def delete_if(self, name: str, owned: Callable[[bytes], bool]) -> bool:
        """Remove file `name` only if `owned(its bytes)` says it is the caller's, checked and
        removed as one step: a write of `name` that lands after the check is never removed.
        True if removed; False if kept or absent.

        On S3 the removal is a DeleteObject with `If-Match: <the ETag of the bytes checked>`
        (AWS S3 and moto's server answer 412 when the object changed since; the bytes are read
        with the same condition, s3fs's `IfMatch` on its GETs); on a 412 the object now there is
        checked again. On local disk and in-process stores the check and the unlink run under
        `locked(name)`, which the writer of `name` must hold too (local disk has no
        unlink-if-unchanged)."""
        if self._is_s3:
            return self._delete_if_s3(name, owned)
        if not self.exists(name):
            # Nothing to remove, and nothing of the caller's can land meanwhile; no lock taken,
            # so a folder removed by the retention sweep is not made again for a lock file.
            return False
        with self.locked(name):
            try:
                data = self.read_bytes(name)
            except FileNotFoundError:
                return False
            if not owned(data):
                return False
            if self.is_local:
                target = self.path(name)
                os.unlink(target)
                _fsync_path(os.path.dirname(target) or ".")
            else:
                self.fs.rm(self.path(name))
            return True

    def _delete_if_s3(self, name: str, owned: Callable[[bytes], bool]) -> bool:
        from s3fs.utils import FileExpired

        target = self.path(name)
        bucket, key, _ = self.fs.split_path(target)
        for _ in range(_CONDITIONAL_TRIES):
            try:
                # The HEAD's ETag, and GETs conditional on it: the bytes are that version's.
                with self.fs.open(self._fresh(target), "rb", cache_type="none") as handle:
                    etag, data = handle.details["ETag"], handle.read()
            except FileNotFoundError:
                return False
            except FileExpired:
                continue  # replaced between the HEAD and the GET: look again
            if not owned(data):
                return False
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
            except FileNotFoundError:
                return False  # gone already (removed by someone else)
            except OSError as exc:
                if not _condition_failed(exc):
                    raise
                continue  # replaced since the read: the new object is checked in turn
            finally:
                self.fs.invalidate_cache(target)
            return True
        raise OSError(f"{target} kept changing under {_CONDITIONAL_TRIES} conditional deletes; left in place")

    def delete_all(self) -> None:
        """Remove the whole folder (retention sweep, tests)."""
        if self.fs.exists(self._fresh(self.root)):
            self.fs.rm(self.root, recursive=True)

    def total_bytes(self) -> int:
        """Bytes of every file under the folder now, recursively, from a fresh listing: on S3
        one listing of the prefix (its objects' sizes, what the bucket bills), on local disk a
        walk of the folder (files that vanish meanwhile left out). Folders themselves count
        nothing: `du -b` adds their entries' few KiB on local disk, a store has none."""
        if not self.fs.exists(self._fresh(self.root)):
            return 0
        files = self.fs.find(self.root, detail=True)  # s3fs lists a prefix whole, never from its cache
        return sum(int(info.get("size") or 0) for info in files.values() if info.get("type") == "file")

    def listdir(self) -> list[str]:
        """Names in the folder now (never a cached listing)."""
        if not self.fs.exists(self._fresh(self.root)):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))


def stream_digest(handle) -> tuple[int, str]:
    """Size and sha256 of what an open binary file holds from its position on, one
    `HASH_CHUNK_BYTES` buffer at a time."""
    sha = hashlib.sha256()
    size = 0
    buffer = bytearray(HASH_CHUNK_BYTES)
    while n := handle.readinto(buffer):
        sha.update(memoryview(buffer)[:n])
        size += n
    return size, sha.hexdigest()


def _condition_failed(exc: OSError) -> bool:
    """Whether s3fs's error is S3's answer to a failed condition (412, or AWS's 409 for two
    conditional requests at once): s3fs turns both into a bare OSError, the code in its cause."""
    error = getattr(getattr(exc, "__cause__", None), "response", None) or {}
    return error.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _fsync_path(path: str) -> None:
    """Flush a file (or a folder's entries) to the disk; any descriptor of it will do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_durably(source: str, target: str) -> None:
    """Rename a file whose data is already on disk, then flush the folder that holds the new
    name, so the rename survives a crash before anything written after it does."""
    os.replace(source, target)
    _fsync_path(os.path.dirname(target) or ".")


def open_storage(settings: Settings) -> Storage:
    """The service's storage root (HARVEST_STORAGE_URL, default a folder under HARVEST_HOME),
    with the options its settings give."""
    return Storage(settings.resolved_storage_url, options=StorageOptions.of(settings))
