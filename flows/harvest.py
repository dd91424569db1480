"""The `harvest` flow: one Prefect flow run per job, on the work pool of the model's lane.

Parameters are the job id and the storage URL of its request.json (the API writes it first):
prompts and tensors never go through Prefect. The run

1. reads and resolves the request and tokenizes it (a bad request fails here, before any load);
2. claims a slot of its host (`harvest.placement.place_run`: its GPUs, or a CPU place), lowers
   its CPU priority by its job's size (`harvest.cpu_share.run_nice`), and decides how many
   runs share the job (`flows.placement.choose_workers`), starting the helper runs if more
   than one (`flows.scale_out`);
3. gets its engine (`harvest.warm.client.open_engine`): on a worker host, the warm engine of
   its slot's GPU group, loaded by an earlier job or now, kept for the next;
4. writes its shards, each a forward task in the main thread (where a worker's cancel SIGTERM
   lands within ~1-2 s) and a write task behind the next shard's forward pass, asking between
   shards whether the run is being cancelled (`tasks.shards`);
5. waits for its helpers, doing any range they did not;
6. merges statistics and writes the manifest last (nothing, progress included, is written
   into the job's folder after it), and returns a small summary.

Progress (the job's progress file, a progress artifact, the run's labels, and the job's shard
count on its own run, which is what the API shows) is `flows.progress`. The job's files and
their names are `harvest.jobfiles.JobFiles`. Resume: shards already written and verified
(size + sha256 record beside each) are skipped, so a re-run of the same flow run (rescheduled
after its host died) costs only the shard in flight.

How a run ends is decided in one place, `ending`: done returns the summary; a cancel ends
Cancelled; any error ends Failed with a short reason from the error vocabulary and a
reference (e.g. `engine_failed: … (ref 3f2a…)`, details in the run's log under it), and no
manifest is written.

Each run of the flow (each attempt of a flow run: a rescheduled run's cut-off process may
still be alive beside its successor, both with the same flow run id and the same job folder)
mints its own `writer` token, written into the manifest it writes. A failing attempt removes
only a manifest with its own token (`JobFiles.discard_manifest`, a conditional delete): a
stale attempt failing after its successor finished leaves the successor's manifest, and the
job, done.
"""

from __future__ import annotations

import time
import uuid

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled as CancelledState
from prefect.states import Failed, State

from flows.placement import WORKERS_LABEL, choose_workers
from flows.progress import RunProgress, summary_artifact
from flows.scale_out import collect_helpers, start_helpers
from harvest.cost import bytes_per_token
from harvest.cpu_share import lower_priority, run_nice
from harvest.errors import job_error
from harvest.jobfiles import JobFiles
from harvest.metrics import RUN_START_SECONDS
from harvest.pipeline import tokenize_job
from harvest.shard.writing import Cancelled
from harvest.placement import place_run, split_ranges
from harvest.registry import load_registry
from harvest.request import resolve_job
from harvest.settings import get_settings
from harvest.storage import StorageOptions
from harvest.shard.layout import shard_ranges
from harvest.warm.client import open_engine
from tasks.shards import ShardWork, finalize_job, run_shard_range

__all__ = ["harvest", "ending", "observe_run_start"]


def observe_run_start(lane: str, entered: float) -> None:
    """The run-start latency (`harvest_run_start_seconds`): from when Prefect expected the run
    to start (its creation by the API, or its rescheduling) to its flow code running here,
    i.e. the lane's queue, the worker's poll and the run's start on its host."""
    scheduled = current_run.scheduled_start_time
    if scheduled is not None:
        RUN_START_SECONDS.labels(lane).observe(max(0.0, entered - scheduled.timestamp()))


def ending(
    exc: BaseException, job_id: str, files: JobFiles, run: RunProgress | None, helper: bool, writer: str | None = None,
) -> State:
    """The final state of a run that did not finish: the one place outcomes become states.
    `writer`: this attempt's token; a manifest it did not write is kept."""
    logger = get_run_logger()
    if isinstance(exc, Cancelled):
        logger.warning("job %s cancelled: %s", job_id, exc)
        return CancelledState(message=f"Cancelled: {exc}")
    if isinstance(exc, TerminationSignal):
        # The worker's cancel SIGTERM, surfacing in the main thread mid-shard or mid-load.
        # Prefect 3.9.1 leaves the final state to the worker, which only writes it after a
        # 30 s grace (it keeps polling the dead child's process group), holding the lane's
        # slot meanwhile; so the run records its own cancellation now, then exits.
        if run is not None and run.cancelling():
            run.client.set_flow_run_state(run.id, CancelledState(message="Cancelled by request."), force=True)
        raise exc
    # The job's error names the reference; the details (an engine server's log tail, paths,
    # memory figures) stay in this log, under it.
    message, ref = job_error(exc)
    logger.error("job %s failed (ref %s)", job_id, ref, exc_info=exc)
    if not helper and not files.discard_manifest(writer) and files.has_manifest():
        # A failed attempt leaves no manifest of its own; one that another attempt of this
        # run wrote (its successor, which finished the job) stays.
        logger.warning("job %s: the manifest is another attempt's; kept", job_id)
    return Failed(message=message)


@flow(name="harvest", persist_result=False, log_prints=False)
def harvest(job_id: str, request_url: str, workers: int | None = None, shard_range: list[int] | None = None) -> dict:
    """Harvest one job: shards (skipping verified ones), statistics, manifest last.

    job_id: the job's uuid; the manifest records it.
    request_url: storage URL of the job's request.json; the job's files go in its folder.
    workers: split the shards over this many flow runs of the lane (1: this run does all);
        None: as many as the lane's free slots allow (`flows.placement.choose_workers`).
    shard_range: `[start, stop)` for a helper run: write those shards only, no manifest.
    """
    entered = time.time()
    writer = uuid.uuid4().hex  # this attempt's, never another's (see the module docstring)
    logger = get_run_logger()
    settings = get_settings()  # in this flow run's process: its own environment
    files = JobFiles.from_request_url(request_url, StorageOptions.of(settings))
    helper = shard_range is not None
    run: RunProgress | None = None
    engine = None
    try:
        # 1. The request, tokenized.
        job = resolve_job(files.read_request(), load_registry(settings))
        observe_run_start(job.model.lane, entered)
        tokenized = tokenize_job(job)
        ranges = shard_ranges(len(tokenized), job.request.shard_size)
        n_shards = len(ranges)

        # 2. A slot of this host (before anything touches CUDA), and the plan.
        placement = place_run(job.model, settings, on_wait=lambda: files.write_progress(stage="waiting for a slot"))
        tokens_per_shard = [sum(len(tokenized[i].ids) for i in r) for r in ranges]
        if placement:  # a worker host's run, in a process of its own (never a caller's, e.g. a test's)
            # A large job's run leaves a contended CPU to small jobs' runs and to its worker.
            lower_priority(run_nice(sum(tokens_per_shard) * bytes_per_token(job)))
        run = RunProgress(job_id, files, job.model.lane, tokens_per_shard, placement)
        if helper:
            plan = [list(shard_range)]
        else:
            previous = run.labels.get(WORKERS_LABEL)
            plan = split_ranges(n_shards, choose_workers(
                workers, run.pool, n_shards, settings, run.client, previous, logger.info, queue=run.work_queue,
            ))
        own = range(max(0, plan[0][0]), min(n_shards, plan[0][1]))
        if helper:
            run.n_shards = len(own)
        run.label(1 if helper else len(plan))
        if not helper:  # the job's own run: its count is the job's progress (`flows.progress`)
            run.reports_for_job(split=len(plan) > 1)
        if placement:
            logger.info("placed on %s slot %s (devices %s)", placement["host"], placement["slot"], placement["devices"] or "none")
        helpers = start_helpers(run, plan[1:]) if len(plan) > 1 else []

        # 3. The engine: warm on a worker host.
        run.stage("loading")
        engine, load = open_engine(job.model, placement, settings)
        logger.info(
            "%s on %s (%s, %s) in %.2f s; shards %s..%s of %s", job.model.name, load.engine, load.reason,
            "warm" if load.warm else "loaded", load.load_s, own.start, own.stop - 1, n_shards,
        )

        # 4. This run's shards.
        work = ShardWork(job, files, engine, tokenized)

        def do_range(ids: range):
            return run_shard_range(work, ids, should_stop=run.cancelling, on_shard=lambda r, skipped: run.shard_done(r.index, skipped))

        timings = do_range(own)
        timings.load_s = load.load_s
        if helper:
            files.write_helper_timings(plan[0], vars(timings))
            return {"job_id": job_id, "shard_range": plan[0], "timings": timings.as_dict(), "placement": placement}

        # 5. The helpers' ranges.
        if helpers:
            run.stage("waiting for helper runs")
            timings.add(collect_helpers(files, run, helpers, settings, do_range))

        # 6. Statistics, then the manifest, last: nothing is written into the job's folder
        # after it (its presence means "done"; readers derive the "done" stage from it).
        run.stage("finalizing")
        summary = finalize_job(work, load.manifest_entry(engine.versions()), job_id, timings, writer)
        result = {
            **summary.as_dict(), "job_id": job_id, "shards_skipped": run.skipped, "workers": len(plan), "placement": placement,
            "engine": {"name": load.engine, "warm": load.warm, "reason": load.reason},
        }
        summary_artifact(job_id, result)
        return result
    except (Exception, TerminationSignal) as exc:
        return ending(exc, job_id, files, run, helper, writer)
    finally:
        if engine is not None:
            engine.close()  # a warm engine stays loaded in its server for the next job
        if run is not None:
            run.close()
