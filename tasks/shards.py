"""The per-shard task and the statistics merge, as thin Prefect tasks over `harvest.pipeline`.

Both run *synchronously in the caller's thread* (a plain call of a Prefect 3 task does), which
is the point: the forward pass stays in the flow's main thread, where a worker's cancel
(SIGTERM) lands within a shard instead of after a 30 s grace (DESIGN, Prefect facts).

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
from harvest.pipeline import JobSummary, Timings, finalize, run_shards
from harvest.request import ResolvedJob
from harvest.storage import Storage
from harvest.tokenize import TokenizedPrompt

__all__ = ["ShardWork", "harvest_shard", "finalize_job"]


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


@task(
    name="harvest-shard",
    task_run_name="shard-{k}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=1,
    retry_condition_fn=_transient,
)
def harvest_shard(work: ShardWork, k: int) -> dict:
    """Write shard k (or skip it if it is already written and verified).

    One retry for a transient error: it costs a second attempt at this shard only, and the
    write is idempotent (atomic overwrite of the same bytes).
    """
    timings, skipped = run_shards(work.job, work.storage, work.engine, [k], tokenized=work.tokenized)
    return {"timings": timings, "skipped": bool(skipped)}


@task(name="merge-stats-and-manifest", cache_policy=NO_CACHE, persist_result=False)
def finalize_job(work: ShardWork, engine_versions: dict[str, str], job_id: str, timings: Timings) -> JobSummary:
    """Merge every shard's statistics partial, write the statistics, then the manifest last."""
    return finalize(work.job, work.storage, engine_versions, job_id, timings=timings, tokenized=work.tokenized)
