"""A shard's writing: its forward passes into a staged file (`capture_shard`), its publication
and record (`write_shard`), a run's pass over a range of shards (`ShardPass`, driven by
`run_shards` here or by the flow's tasks), and the records as stored, checked at finalize
(`stored_records`). A shard is created once (`harvest.storage`): of two writes of it (a writer
taken over while still alive and its successor) the first stands, and the other lists that
file instead of its own.

No process holds a whole shard: the engine hands each batch's values to the shard's file,
staged on local disk (`harvest.shard.file`), as soon as they exist, hashed as they are written,
and the write step publishes that file (a hard link on local disk, one multipart upload on S3).
Memory follows `HARVEST_ENGINE_PIECE_BYTES` and `HARVEST_ENGINE_BATCH_TOKENS`, not `shard_size`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from harvest.engines.base import Engine, hand_over
from harvest.metrics import count_forward, count_shard_written
from harvest.request import ResolvedJob
from harvest.shard.file import StagedShard
from harvest.shard.layout import shard_name, shard_ranges
from harvest.shard.record import Part, ShardRecord, read_part, stored_stats, verified_part, write_part
from harvest.stats import RunningStats
from harvest.storage import Storage
from harvest.timings import Timings
from harvest.tokenize import TokenizedPrompt

__all__ = [
    "Cancelled", "CapturedShard", "capture_shard", "write_shard", "ShardPass", "PendingWrite", "run_shards",
    "stored_records", "HASH_THREADS",
]

logger = logging.getLogger(__name__)


class Cancelled(Exception):
    """The job was cancelled between two shards."""


@dataclass
class CapturedShard:
    """Shard k after its forward passes: its file complete on local disk (not yet sealed or
    published), and its statistics partial."""

    k: int
    staged: StagedShard
    stats: RunningStats
    forward_s: float
    padded_tokens: int = 0


def capture_shard(job: ResolvedJob, engine: Engine, tokenized: list[TokenizedPrompt], k: int, storage: Storage) -> CapturedShard:
    """Shard k's forward passes, each batch's values written to the shard's staged file as the
    engine hands them over (`harvest.shard.file`): this process never holds the whole shard."""
    indices = shard_ranges(len(tokenized), job.request.shard_size)[k]
    ids = [tokenized[i].ids for i in indices]
    n_features = job.spec.n_features(job.model.hidden_size)
    staged = StagedShard(storage.staging_path(shard_name(k)), indices, ids, len(job.layers), n_features, job.spec.stored_dtype)
    try:
        capture = hand_over(engine.capture(ids, job.spec, batch_size=job.request.batch_size, sink=staged), staged)
    except BaseException:
        staged.discard()
        raise
    return CapturedShard(k, staged, capture.stats, capture.forward_s, capture.padded_tokens)


def write_shard(job: ResolvedJob, storage: Storage, tokenized: list[TokenizedPrompt], k: int, captured: CapturedShard) -> tuple[ShardRecord, Timings]:
    """Hash and publish shard k's staged file, then its record (whose presence vouches for the
    shard). Safe to call again after a failure (a task's retry): what is done is not redone.

    The file is created once (`Storage.publish_file`). Where shard k exists already, another
    write of it came first (this one was taken over, or took over a writer still alive; or it
    is this write's own earlier try, whose answer was lost): that file stands, and the record
    lists it, its size, sha256 and statistics, never this write's (`_as_stored`)."""
    indices = shard_ranges(len(tokenized), job.request.shard_size)[k]
    timings = Timings()
    started = time.perf_counter()
    size, sha256 = captured.staged.seal()
    record = ShardRecord(
        file=shard_name(k),
        index=k,
        prompt_range=[indices.start, indices.stop - 1],
        token_counts=[len(tokenized[i].ids) for i in indices],
        bytes=size,
        sha256=sha256,
    )
    timings.save_s = time.perf_counter() - started
    started = time.perf_counter()
    staged, stats = captured.staged, captured.stats
    if not staged.published:
        try:
            storage.publish_file(record.file, staged.path)
            count_shard_written(job.model.lane, record.bytes)  # bytes this writer stored: a loser's are not
        except FileExistsError:
            staged.superseded = True
        staged.published = True
    if staged.superseded:
        record, stats = _as_stored(job, storage, record, stats, storage.digest(record.file))
    write_part(storage, record, stats, storage.fingerprint(record.file))
    timings.upload_s = time.perf_counter() - started
    return record, timings


class PendingWrite(Protocol):
    """A shard's write running elsewhere: a thread's `Future`, or a Prefect task's future."""

    def result(self) -> tuple[ShardRecord, Timings]: ...


class ShardPass:
    """One run's pass over some of a job's shards, driven step by step by its caller: `run_shards`
    below, or the flow's tasks (`tasks.shards`), which run each step as a task. The caller
    asks `done(k)` whether shard k is written already, else captures it (`capture_shard`) and
    hands it to `captured`, which waits for the write of the shard before it; then it starts
    the shard's write (`write_shard`) where it likes and gives the pending write to `writing`.
    So shard k is published while shard k+1 runs, at most two shards are staged on local disk
    (one being published, one being filled), a write starts only once the one before it
    succeeded, and a write's error surfaces at the next shard, never later than `close`.
    Nothing here calls the caller back: each step returns what the caller reports.

    forward_s, save_s and upload_s are each the time spent in that step, so with overlap their
    sum exceeds the wall time.
    """

    def __init__(self, job: ResolvedJob, storage: Storage):
        self.job = job
        self.storage = storage
        self.timings = Timings()
        self.skipped = 0
        self._staged: list[StagedShard] = []
        self._pending: PendingWrite | None = None

    def done(self, k: int) -> ShardRecord | None:
        """Shard k's record if it is written and verified already (counted as skipped), else
        None: then it is to be written, and a file of it that its record disowns (damaged in
        place) is removed first, so that its write can create it again."""
        part = verified_part(self.storage, k)
        if part is not None:
            self.skipped += 1
            return part.record
        _remove_disowned(self.storage, k)
        return None

    def captured(self, capture: CapturedShard) -> ShardRecord | None:
        """Shard k's forward passes are done: count them, keep its staged file to remove should
        it never be published, and wait for the write of the shard before it (its error raised
        here); returns that shard's record (None when none was being written)."""
        self._staged.append(capture.staged)
        self.timings.count_forward(capture.forward_s, capture.staged.n_tokens, capture.padded_tokens)
        count_forward(self.job.model.lane, capture.staged.n_tokens, capture.forward_s)
        return self._finish()

    def writing(self, write: PendingWrite) -> None:
        """The write of the shard captured last has started (`close` or the next `captured`
        waits for it)."""
        assert self._pending is None, "the write before it is not finished"
        self._pending = write

    def close(self, *, failed: bool = False) -> ShardRecord | None:
        """Wait for the write in flight and return its record; remove the staged files never
        published. After a failure elsewhere (`failed`) the write still finishes, so a resume
        finds the shard, but its own error no longer matters (None then)."""
        try:
            record = self._finish()
        except Exception:
            if not failed:
                raise
            record = None
        finally:
            for shard in self._staged:  # a shard that was never published leaves no file behind
                shard.discard()
        return record

    def _finish(self) -> ShardRecord | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        record, spent = pending.result()
        self.timings.save_s += spent.save_s
        self.timings.upload_s += spent.upload_s
        return record


class _Here:
    """A write done in the caller's thread, as a finished pending write (`overlap=False`)."""

    def __init__(self, result: tuple[ShardRecord, Timings]):
        self._result = result

    def result(self) -> tuple[ShardRecord, Timings]:
        return self._result


def run_shards(
    job: ResolvedJob,
    storage: Storage,
    engine: Engine,
    shard_ids: Iterable[int] | None = None,
    *,
    tokenized: list[TokenizedPrompt],
    should_stop: Callable[[], bool] = lambda: False,
    on_shard: Callable[[ShardRecord, bool], None] = lambda record, skipped: None,
    overlap: bool = True,
) -> tuple[Timings, int]:
    """Write the given shards (all by default) in this process, each write in a thread of its
    own behind the next shard's forward pass (`ShardPass`; in the caller's thread with
    `overlap=False`, for benchmarks); returns timings and how many were skipped.

    `should_stop` is asked before each shard so a cancel lands between shards, never in the
    middle of a file; `on_shard(record, skipped)` is told of each shard done (the caller's
    progress: `harvest run`'s bar)."""
    n_shards = len(shard_ranges(len(tokenized), job.request.shard_size))
    run = ShardPass(job, storage)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") if overlap else None
    ok = False
    try:
        for k in range(n_shards) if shard_ids is None else shard_ids:
            if should_stop():
                raise Cancelled(f"cancelled before shard {k}")
            if (record := run.done(k)) is not None:
                on_shard(record, True)
                continue
            capture = capture_shard(job, engine, tokenized, k, storage)
            if (record := run.captured(capture)) is not None:
                on_shard(record, False)
            args = (job, storage, tokenized, k, capture)
            run.writing(writer.submit(write_shard, *args) if writer else _Here(write_shard(*args)))
        ok = True
    finally:
        try:
            if (record := run.close(failed=not ok)) is not None:
                on_shard(record, False)
        finally:
            if writer is not None:
                writer.shutdown(wait=False)
    return run.timings, run.skipped


HASH_THREADS = 4
"""Shards checked at once by `stored_records`: enough to keep a disk or an S3 connection pool
busy; memory is one `HASH_CHUNK_BYTES` buffer each where one is hashed."""


def _remove_disowned(storage: Storage, k: int) -> None:
    """Delete shard k's file if its record exists and names other bytes (damaged in place), so
    that the write about to come can create it again; asked only of a shard that failed its
    check. A record-less file is left alone: another write of it is between its file and its
    record, and this one will list that file (`write_shard`)."""
    try:
        record = read_part(storage, k).record
    except FileNotFoundError:
        return
    if storage.exists(record.file) and storage.digest(record.file) != (record.bytes, record.sha256):
        logger.warning("shard %s does not match its record; writing it again", record.file)
        storage.delete(record.file)


def _as_stored(job: ResolvedJob, storage: Storage, record: ShardRecord, partial: RunningStats, digest: tuple[int, str]) -> tuple[ShardRecord, RunningStats]:
    """`record` and its statistics `partial` made those of its file as stored, whose size and
    sha256 are `digest`: unchanged where they match, else the stored size and hash, and the
    statistics read from the stored values (`stored_stats`)."""
    size, sha256 = digest
    if (size, sha256) == (record.bytes, record.sha256):
        return record, partial
    if size != record.bytes:
        raise RuntimeError(f"shard {record.file} holds {size} bytes, its layout {record.bytes}; it is not a write of this shard")
    logger.warning("shard %s was written by another write of it; listing the stored file", record.file)
    n_features = job.spec.n_features(job.model.hidden_size)
    stats = stored_stats(storage, record, len(job.layers), n_features, job.spec.stored_dtype)
    return record.model_copy(update={"bytes": size, "sha256": sha256}), stats


def stored_records(job: ResolvedJob, storage: Storage, n_shards: int) -> tuple[list[ShardRecord], RunningStats]:
    """Every shard's record, its size and sha256 those of the file as stored now, and the
    job's statistics merged over them.

    A shard file never changes once created (`harvest.storage`), and each record names its
    file's bytes (`write_shard`), so the hashes agree. They are checked all the same, so that
    the manifest vouches for what is stored, not for what was meant: a store that ignores
    `If-None-Match` lets a late write replace a shard, and a file can be damaged after its
    record. The check reads no bytes where it need not: each file's fingerprint now
    (`Storage.fingerprint`: a stat on local disk, a HEAD on S3), `HASH_THREADS` at a time,
    against the one its record kept. A file whose fingerprint changed, or that has none, is
    hashed again, streamed (`Storage.digest`); where it is not its record's, its statistics are
    read from the file too.
    """
    parts = []
    for k in range(n_shards):
        part = verified_part(storage, k, check_hash=False)
        if part is None:
            raise RuntimeError(f"shard {k} is missing or does not match its record; the job cannot be finalised")
        parts.append(part)

    def as_stored_now(part: Part) -> tuple[int, str]:
        fingerprint = storage.fingerprint(part.record.file)
        if fingerprint is not None and fingerprint == part.stored_as:
            return part.record.bytes, part.record.sha256
        return storage.digest(part.record.file)

    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="shard-check") as pool:
        digests = list(pool.map(as_stored_now, parts))
    records: list[ShardRecord] = []
    stats = RunningStats(len(job.layers), job.spec.n_features(job.model.hidden_size))
    for part, digest in zip(parts, digests, strict=True):
        record, partial = _as_stored(job, storage, part.record, part.stats, digest)
        records.append(record)
        stats.merge(partial)
    return records, stats
