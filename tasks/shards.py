"""The per-shard tasks and the statistics merge, as thin Prefect tasks over `harvest.pipeline`.

A shard is two task runs: `forward-k` runs *synchronously in the flow's main thread* (a plain
call of a Prefect 3 task does), which is the point: a worker's cancel (SIGTERM) lands within a
shard instead of after Prefect's 30 s grace. `write-k` is submitted to the
flow's task runner, so the shard's encode, hash and upload run while the next shard's forward
pass does, with Prefect's retries on storage errors. Between the two, the shard is a file
staged on local disk (`harvest.shard.writing.CapturedShard`), never its values in memory.

Arguments travel in `ShardWork`, a plain object that Prefect does not look into: the engine,
the tokenized prompts, the resolved job and its folder (`JobFiles`) are never hashed for cache
keys, serialized or sent to the Prefect API. Task runs record only the shard number (in their
name).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from harvest.engines.base import Engine
from harvest.errors import HarvestError
from harvest.jobfiles import JobFiles
from harvest.pipeline import JobSummary, finalize
from harvest.shard.writing import Cancelled, CapturedShard, ShardPass, capture_shard, write_shard
from harvest.request import ResolvedJob
from harvest.shard.record import ShardRecord
from harvest.storage import Storage
from harvest.timings import Timings
from harvest.tokenize import TokenizedPrompt

__all__ = ["ShardWork", "Captured", "forward_shard", "write_shard_task", "run_shard_range", "finalize_job"]


class ShardWork:
    """What every shard of one job needs; deliberately not a dataclass (Prefect walks those)."""

    def __init__(self, job: ResolvedJob, files: JobFiles, engine: Engine | None, tokenized: list[TokenizedPrompt]):
        self.job = job
        self.files = files
        self.engine = engine
        self.tokenized = tokenized

    @property
    def storage(self) -> Storage:
        """The job's folder, as the pipeline takes it."""
        return self.files.storage


def _transient(task, task_run, state) -> bool:
    """Retry storage or runtime hiccups, not the service's own refusals (a capture that
    missed a layer fails the same way twice)."""
    try:
        state.result()
    except HarvestError:
        return False
    except Exception:
        return True
    return False


class Captured:
    """A shard's forward-pass output between its two tasks (a plain box Prefect leaves alone)."""

    def __init__(self, capture: CapturedShard):
        self.capture = capture


@task(
    name="forward-shard",
    task_run_name="forward-{k}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_condition_fn=_transient,
)
def forward_shard(work: ShardWork, k: int) -> Captured:
    """Shard k's forward passes, in the flow's main thread (a cancel lands within the shard).

    One retry for a transient error (a lost engine server is already asked again by
    `harvest.warm.client`); a refusal of the service's own (`HarvestError`) fails at once.
    """
    return Captured(capture_shard(work.job, work.engine, work.tokenized, k, work.storage))


@task(
    name="write-shard",
    task_run_name="write-{k}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=[1, 4],
    retry_condition_fn=_transient,
)
def write_shard_task(work: ShardWork, k: int, captured: Captured) -> tuple[ShardRecord, Timings]:
    """Hash and publish shard k's staged file and write its record, behind the next shard's
    forward pass (`harvest.shard.writing.ShardPass`). Retried twice on a storage error: the file
    is created once and a retry redoes only what did not finish (one whose earlier upload
    landed unanswered finds its own file there and keeps it: `harvest.shard.writing.write_shard`)."""
    return write_shard(work.job, work.storage, work.tokenized, k, captured.capture)


def run_shard_range(work: ShardWork, ids: range, *, should_stop, on_shard) -> Timings:
    """The shards `ids` of the job, one forward task and one write task each, each write
    submitted to the flow's task runner so it overlaps the next forward pass; the core keeps
    the pass's state (`harvest.shard.writing.ShardPass`) and is never called back.

    `should_stop()` is asked before each shard (a cancel lands between shards);
    `on_shard(record, skipped)` is told of each shard done (the run's progress)."""
    run = ShardPass(work.job, work.storage)
    ok = False
    try:
        for k in ids:
            if should_stop():
                raise Cancelled(f"cancelled before shard {k}")
            if (record := run.done(k)) is not None:
                on_shard(record, True)
                continue
            captured = forward_shard(work, k)
            if (record := run.captured(captured.capture)) is not None:
                on_shard(record, False)
            run.writing(write_shard_task.submit(work, k, captured))
        ok = True
    finally:
        if (record := run.close(failed=not ok)) is not None:
            on_shard(record, False)
    return run.timings


@task(
    name="merge-stats-and-manifest",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=[1, 4],
    retry_condition_fn=_transient,
)
def finalize_job(work: ShardWork, engine_entry: dict[str, str], job_id: str, timings: Timings, writer: str | None = None) -> JobSummary:
    """Merge every shard's statistics partial, write the statistics, then the manifest last.

    Retried twice on a storage error, as a shard's write is: the merge reads the shards'
    partials again and both files are whole-object writes, so a retry redoes them alike (a
    manifest whose PUT landed unanswered is written again, the same but for its timings).
    Without it one statistics or manifest write failing past botocore's attempts failed a job
    whose shards were all written (tests/test_faults_finalize.py). `writer`: the flow
    attempt's token, recorded in the manifest (`harvest.manifest.Manifest.writer`)."""
    timings = timings.model_copy()  # a retry starts from the shards' timings again
    return finalize(work.job, work.storage, engine_entry, job_id, timings=timings, tokenized=work.tokenized, writer=writer)
