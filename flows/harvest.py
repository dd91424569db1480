"""The `harvest` flow: one Prefect flow run per job, on the work pool of the model's lane.

Parameters are the job id and the storage URL of its request.json (the API writes it first):
prompts and tensors never go through Prefect. The run

1. reads and resolves the request, tokenizes (a bad request fails here, before any load);
2. loads the model once, in the flow's main thread;
3. writes its shards one task run each, in the main thread too, asking between shards whether
   the run is being cancelled. A worker's cancel is a SIGTERM that Prefect turns into an
   exception in the main thread, so it lands in the middle of a forward pass within ~1-2 s;
   work in `task.map` threads would only be SIGKILLed after a 30 s grace (DESIGN);
4. merges statistics and writes the manifest last, and returns a small summary.

Resume: shards already written and verified (size + sha256 record beside each) are skipped, so
a re-run of the same flow run (the reaper reschedules one whose process died) costs only the
shard that was in flight.

Scale-out (`workers=N`): the shards are cut into N contiguous ranges. This run keeps the
first; the others become flow runs of the lane's deployment (`shard_range=[a, b]`), each
loading the model once. When its own range is done, this run waits for the helpers; a helper
still not started after a grace period (HARVEST_HELPER_GRACE_S, 30 s; the lane is full, e.g.
`large` with limit 1) is cancelled and its range done here, and one that failed has its range
resumed here. So scale-out never deadlocks
on the lane's limit and never loses a shard. Statistics are merged in shard order from the
per-shard float64 partials, so they are identical to a single-worker run.

Failure: any error ends the run Failed with a short message saying why (e.g. `capture_failed:
…`), and no manifest is written. Cancellation ends it Cancelled.
"""

from __future__ import annotations

import json
import os
import time
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled as CancelledState
from prefect.states import Failed

from harvest.engines import load_engine
from harvest.errors import HarvestError
from harvest.manifest import MANIFEST
from harvest.pipeline import Cancelled, JobSummary, Timings, tokenize_job
from harvest.registry import load_registry
from harvest.request import resolve_job
from harvest.shards import PARTS, shard_ranges
from harvest.storage import Storage
from flows.jobs import job_storage, read_request, write_progress
from tasks.shards import ShardWork, finalize_job, harvest_shard

__all__ = ["harvest", "split_ranges", "HELPER_TAG"]

HELPER_TAG = "scale-out-helper"
# A test/demo throttle (seconds slept in the main thread after each shard, and before the model
# loads). It slows real work down so that tests can act "mid-job"; it fakes nothing. Unset = 0.
PAUSE_ENV = "HARVEST_FLOW_SHARD_PAUSE_S"
LOAD_PAUSE_ENV = "HARVEST_FLOW_LOAD_PAUSE_S"
POLL_S = 1.0
# How long a helper may stay scheduled after this run finished its own range before this run
# takes its shards over: a worker needs a poll and a process start (10-20 s on a loaded CPU
# box) to pick it up, and a model load takes far longer than this wait.
HELPER_GRACE_S = float(os.environ.get("HARVEST_HELPER_GRACE_S", 30))


def split_ranges(n_shards: int, workers: int) -> list[list[int]]:
    """`[start, stop)` shard ranges, contiguous, sizes differing by at most one."""
    workers = max(1, min(workers, n_shards))
    base, extra = divmod(n_shards, workers)
    ranges, start = [], 0
    for i in range(workers):
        stop = start + base + (1 if i < extra else 0)
        ranges.append([start, stop])
        start = stop
    return ranges


def _short(exc: BaseException) -> str:
    """A one-line reason for the job's `error` field: the error code and its message."""
    if isinstance(exc, HarvestError):
        text = f"{exc.code}: {exc.message}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 500 else text[:497] + "..."


def _pause(env: str) -> None:
    seconds = float(os.environ.get(env, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


class _Run:
    """This flow run's view of itself: cancellation check and progress reporting."""

    def __init__(self, job_id: str, storage: Storage, n_shards: int, tokens_per_shard: list[int]):
        self.id = current_run.get_id()
        self.job_id = job_id
        self.storage = storage
        self.n_shards = n_shards
        self.tokens_per_shard = tokens_per_shard
        self.client = get_client(sync_client=True)
        self.client.__enter__()
        self.started = time.perf_counter()
        self.tokens_done = 0
        self.shards_done = 0
        self.skipped = 0
        self.artifact: UUID | None = None

    def close(self) -> None:
        self.client.__exit__(None, None, None)

    def cancelling(self) -> bool:
        """True once someone asked to cancel this run (the worker's SIGTERM usually wins)."""
        if self.id is None:
            return False
        try:
            state = self.client.read_flow_run(self.id).state
        except Exception:  # an API hiccup must not fail a GPU job; SIGTERM still works
            return False
        return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)

    def stage(self, stage: str) -> None:
        write_progress(
            self.storage, stage=stage, shards_done=self.shards_done, n_shards=self.n_shards, shards_skipped=self.skipped
        )

    def shard_done(self, k: int, skipped: bool) -> None:
        self.shards_done += 1
        if skipped:
            self.skipped += 1
        else:
            self.tokens_done += self.tokens_per_shard[k]
        rate = self.tokens_done / max(time.perf_counter() - self.started, 1e-6)
        fraction = 100.0 * self.shards_done / max(self.n_shards, 1)
        text = f"{self.shards_done}/{self.n_shards} shards, {rate:,.0f} tokens/s"
        write_progress(
            self.storage,
            stage="forward",
            shards_done=self.shards_done,
            n_shards=self.n_shards,
            shards_skipped=self.skipped,
            tokens_per_s=round(rate, 1),
        )
        if self.id is None:
            return
        try:
            if self.artifact is None:
                self.artifact = create_progress_artifact(
                    progress=fraction, key=f"harvest-progress-{self.job_id}"[:100].lower(), description=text
                )
            else:
                update_progress_artifact(self.artifact, progress=fraction, description=text)
        except Exception:  # progress display is best effort
            get_run_logger().debug("progress artifact update failed", exc_info=True)


def _run_range(work: ShardWork, run: _Run, ids: range, pause_s: float) -> Timings:
    timings = Timings()
    for k in ids:
        if run.cancelling():
            raise Cancelled(f"cancelled before shard {k}")
        result = harvest_shard(work, k)
        timings.add(result["timings"])
        run.shard_done(k, result["skipped"])
        if pause_s:
            time.sleep(pause_s)
    return timings


def _timings_name(rng: list[int]) -> str:
    return f"{PARTS}/timings-{rng[0]:05d}-{rng[1]:05d}.json"


def _start_helpers(run: "_Run", request_url: str, lane: str, ranges: list[list[int]]) -> list[tuple[list[int], UUID]]:
    """One flow run of the lane's deployment per range; idempotent, so a resumed parent
    re-attaches to the helpers it started before instead of starting new ones."""
    from prefect.deployments import run_deployment

    job_id = run.job_id
    tags = [t for t in (current_run.tags or []) if not t.startswith("key:")] + [HELPER_TAG, f"job:{job_id}"]
    # Helpers run with the parent's job variables (e.g. its env), so they behave the same.
    job_variables = run.client.read_flow_run(run.id).job_variables if run.id else None
    helpers = []
    for i, rng in enumerate(ranges, start=1):
        child = run_deployment(
            f"harvest/harvest-{lane}",
            parameters={"job_id": job_id, "request_url": request_url, "shard_range": rng},
            timeout=0,
            as_subflow=True,
            idempotency_key=f"{job_id}:shards-{rng[0]}-{rng[1]}",
            flow_run_name=f"{job_id}-shards-{rng[0]}-{rng[1]}",
            tags=tags,
            job_variables=job_variables or None,
        )
        helpers.append((rng, child.id))
    return helpers


def _collect_helpers(work: ShardWork, run: _Run, helpers: list[tuple[list[int], UUID]], pause_s: float) -> Timings:
    """Wait for the helpers; take over any range that did not start or did not finish."""
    logger = get_run_logger()
    timings = Timings()
    pending = list(helpers)
    grace_ends = time.monotonic() + HELPER_GRACE_S
    while pending:
        for rng, child_id in list(pending):
            if run.cancelling():
                raise Cancelled("cancelled while waiting for helper runs")
            state = run.client.read_flow_run(child_id).state
            kind = state.type if state else StateType.SCHEDULED
            if kind == StateType.SCHEDULED:
                if time.monotonic() < grace_ends:
                    continue
                # Still not started: the lane is full. Cancel it (only accepted while it has not
                # started) and do its shards here rather than wait for a slot we hold.
                result = run.client.set_flow_run_state(child_id, CancelledState(message="taken over by the parent run"))
                if result.status.value != "ACCEPT":
                    continue
                kind = StateType.CANCELLED
            if kind == StateType.COMPLETED:
                if work.storage.exists(_timings_name(rng)):
                    timings.add(Timings(**json.loads(work.storage.read_bytes(_timings_name(rng)))))
            elif kind in (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED):
                logger.info("helper %s ended %s; doing shards %s..%s here", child_id, kind.value, rng[0], rng[1] - 1)
                timings.add(_run_range(work, run, range(*rng), pause_s))
            else:
                continue  # PENDING, RUNNING, CANCELLING, PAUSED: still theirs
            pending.remove((rng, child_id))
        if pending:
            time.sleep(POLL_S)
    return timings


def _summary_artifact(job_id: str, result: dict) -> None:
    """A small table in the UI: what the job wrote and where the time went."""
    rows = [f"| {k} | {v} |" for k, v in result.items() if k != "timings"]
    rows += [f"| {k} | {v} |" for k, v in result["timings"].items()]
    try:
        create_markdown_artifact("| field | value |\n|---|---|\n" + "\n".join(rows), description=f"harvest {job_id}")
    except Exception:  # display only
        get_run_logger().debug("summary artifact failed", exc_info=True)


@flow(name="harvest", persist_result=False, log_prints=False)
def harvest(job_id: str, request_url: str, workers: int = 1, shard_range: list[int] | None = None) -> dict:
    """Harvest one job: shards (skipping verified ones), statistics, manifest last.

    job_id: the job's uuid; the manifest records it.
    request_url: storage URL of the job's request.json; the job's files go in its folder.
    workers: split the shards over this many flow runs of the lane (1: this run does all).
    shard_range: `[start, stop)` for a helper run: write those shards only, no manifest.
    """
    logger = get_run_logger()
    storage = job_storage(request_url)
    run: _Run | None = None
    try:
        job = resolve_job(read_request(storage), load_registry())
        tokenized = tokenize_job(job)
        ranges = shard_ranges(len(tokenized), job.request.shard_size)
        n_shards = len(ranges)
        helper = shard_range is not None
        plan = [list(shard_range)] if helper else split_ranges(n_shards, workers)
        own = range(max(0, plan[0][0]), min(n_shards, plan[0][1]))
        tokens_per_shard = [sum(len(tokenized[i].ids) for i in r) for r in ranges]
        run = _Run(job_id, storage, len(own) if helper else n_shards, tokens_per_shard)
        helpers = _start_helpers(run, request_url, job.model.lane, plan[1:]) if len(plan) > 1 else []

        run.stage("loading")
        _pause(LOAD_PAUSE_ENV)
        started = time.perf_counter()
        engine = load_engine(job.model)
        load_s = time.perf_counter() - started
        logger.info("loaded %s on %s in %.1f s; shards %s..%s of %s", job.model.name, engine.name, load_s, own.start, own.stop - 1, n_shards)

        work = ShardWork(job, storage, engine, tokenized)
        pause_s = float(os.environ.get(PAUSE_ENV, "0") or 0)
        timings = _run_range(work, run, own, pause_s)
        timings.load_s = load_s
        if helper:
            storage.write_bytes(_timings_name(plan[0]), json.dumps(vars(timings)).encode())
            return {"job_id": job_id, "shard_range": plan[0], "timings": timings.as_dict()}
        if helpers:
            run.stage("waiting for helper runs")
            timings.add(_collect_helpers(work, run, helpers, pause_s))

        run.stage("finalizing")
        summary: JobSummary = finalize_job(work, engine.versions(), job_id, timings)
        run.stage("done")
        result = {**summary.as_dict(), "job_id": job_id, "shards_skipped": run.skipped, "workers": len(plan)}
        _summary_artifact(job_id, result)
        return result
    except Cancelled as exc:
        logger.warning("job %s cancelled: %s", job_id, exc)
        return CancelledState(message=f"Cancelled: {exc}")
    except TerminationSignal:
        # The worker's cancel SIGTERM, surfacing in the main thread mid-shard or mid-load.
        # Prefect 3.9.1 leaves the final state to the worker, which only writes it after a
        # 30 s grace (it keeps polling the dead child's process group), holding the lane's
        # slot meanwhile; so the run records its own cancellation now, then exits.
        if run is not None and run.cancelling():
            run.client.set_flow_run_state(run.id, CancelledState(message="Cancelled by request."), force=True)
        raise
    except Exception as exc:
        logger.exception("job %s failed", job_id)
        if not shard_range and storage.exists(MANIFEST):
            storage.delete(MANIFEST)  # a failed job leaves no manifest
        return Failed(message=_short(exc))
    finally:
        if run is not None:
            run.close()
