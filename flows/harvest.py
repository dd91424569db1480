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

The job's files and their names are `harvest.jobfiles.JobFiles`. Resume: shards already
written and verified (size + sha256 record beside each) are skipped, so a re-run of the same
flow run (rescheduled after its host died) costs only the shard that was in flight.

Placement (`flows.placement`, `harvest.placement`): on a worker host (`harvest worker`), the
run first claims one of the host's slots (its GPUs, or a CPU place), waiting while all are
held, and sets CUDA_VISIBLE_DEVICES to that slot's GPUs before anything touches CUDA; a model
whose `tensor_parallel_size` needs more GPUs than a slot has fails here, saying so. What the
run got (slot, devices, the GPUs torch sees) goes into its labels (`harvest.slot`,
`harvest.devices`, beside Prefect's `prefect.worker.name`), its progress file and its summary.

How many runs share a job (`workers`): given, it is that many. Left out (None, what the API
sends), it is chosen here, once, when the parent starts: this run plus one per *free slot* of
its work pool (the lane's), but never so many that a run gets fewer than
`HARVEST_SCALE_OUT_MIN_SHARDS` shards (8): N = max(1, min(1 + free, n_shards // 8)). Free
slots = min(the pool's concurrency limit, the slots of its online hosts) minus the pool's runs
that hold or wait for one (this run included). So a job of 16 shards on a lane with two idle
one-slot hosts runs on both, a small job or a busy lane runs alone, and nobody's queued job
waits behind a helper. A rescheduled run keeps the count it chose (its `harvest.workers`
label), so it re-attaches to the same helpers.

Scale-out (N runs): the shards are cut into N contiguous ranges. This run keeps the first; the
others become flow runs of its own deployment, the lane's (`shard_range=[a, b]`), each loading
the model once. When its own range is done, this run waits for the helpers, but never for ever
(`helper_action`, `HelperWatch`): a helper not running yet after `HARVEST_HELPER_GRACE_S` (the
lane is full, e.g. `large` with limit 1, or it is stuck Pending or Paused) is cancelled and its
range done here; one that ended without finishing has its range resumed here; one left
Crashed, Cancelling or unreadable for `HARVEST_HELPER_STALL_S` is taken over too. A Running
helper is waited for: if its host dies, Prefect's heartbeat automation marks it Crashed, and
then the rule above applies. Shards already written and verified are skipped, and a shard
written twice (a helper that started just as it was taken over) is the same bytes written
atomically, so scale-out never deadlocks on the lane's limit and never loses or doubles a
shard. Statistics are merged in shard order from the per-shard float64 partials, so they are
identical to a single-worker run.

Failure: any error ends the run Failed with a short message saying why (e.g. `capture_failed:
…`), and no manifest is written. Cancellation ends it Cancelled.
"""

from __future__ import annotations

import time
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled as CancelledState
from prefect.states import Failed

from flows.placement import WORKERS_LABEL, choose_workers, place_run
from harvest.engines import load_engine
from harvest.errors import HarvestError
from harvest.jobfiles import JobFiles
from harvest.lanes import deployment_name
from harvest.pipeline import Cancelled, JobSummary, Timings, tokenize_job
from harvest.registry import load_registry
from harvest.request import resolve_job
from harvest.settings import Settings, get_settings
from harvest.shards import shard_ranges
from tasks.shards import ShardWork, finalize_job, harvest_shard

__all__ = [
    "harvest",
    "split_ranges",
    "helper_action",
    "HelperWatch",
    "HELPER_TAG",
    "POLL_S",
    "WAIT",
    "COLLECT",
    "RECOMPUTE",
    "TAKE_OVER",
]

HELPER_TAG = "scale-out-helper"
POLL_S = 1.0

# What the parent does about one helper on one look (`helper_action`).
WAIT = "wait"  # leave the range to the helper for now
COLLECT = "collect"  # it completed: add its timings
RECOMPUTE = "recompute"  # it ended without finishing: do (the rest of) its range here
TAKE_OVER = "take_over"  # cancel it (forcing where refused), then do its range here

_NOT_STARTED = (StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED)


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


def helper_action(kind: StateType | None, since_grace_s: float, unchanged_s: float, *, stall_s: float) -> str:
    """What the parent does about a helper in state `kind` (None: unknown or unreadable).

    since_grace_s: seconds since the grace ended (negative while it lasts); the grace starts
    when the parent's own range is done. unchanged_s: seconds since the parent last saw this
    helper's state change. Every state but Running leads to an end within a bounded time.
    """
    if kind == StateType.COMPLETED:
        return COLLECT
    if kind in (StateType.FAILED, StateType.CANCELLED):
        return RECOMPUTE
    if kind == StateType.RUNNING:
        # Waited for as long as it runs: a helper whose host died stops sending heartbeats and
        # Prefect's heartbeat automation (`flows.liveness`) marks it Crashed, the branch below.
        return WAIT
    if kind in _NOT_STARTED:
        # Not started (lane full, stuck Pending on a worker that never started it, Paused):
        # after the grace this run, its model loaded, is faster than any helper still to load.
        return TAKE_OVER if since_grace_s >= 0 else WAIT
    # Crashed (a reschedule may still show as Scheduled), Cancelling (whose worker may be
    # gone), or unknown: take over once nothing has changed for `stall_s`.
    return TAKE_OVER if unchanged_s >= stall_s else WAIT


def _short(exc: BaseException) -> str:
    """A one-line reason for the job's `error` field: the error code and its message."""
    if isinstance(exc, HarvestError):
        text = f"{exc.code}: {exc.message}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 500 else text[:497] + "..."


class _Run:
    """This flow run's view of itself: where it runs, cancellation check, progress reporting."""

    def __init__(self, job_id: str, files: JobFiles, lane: str, tokens_per_shard: list[int], placement: dict | None):
        self.id = current_run.get_id()
        self.placement = placement
        self.job_id = job_id
        self.files = files
        self.n_shards = len(tokens_per_shard)  # this run's own share, once the plan is made
        self.tokens_per_shard = tokens_per_shard
        self.client = get_client(sync_client=True)
        self.client.__enter__()
        me = self.client.read_flow_run(self.id) if self.id is not None else None
        # Helpers are runs of this run's own deployment, so they land on the pool whose free
        # slots were counted; a run without one (a subflow: a corpus refresh's part done in
        # the refresh's process) uses its lane's.
        self.pool: str = (me.work_pool_name if me else None) or lane
        self.deployment: UUID | str = (me.deployment_id if me else None) or deployment_name(lane)
        self.job_variables = me.job_variables if me else None
        self.labels = dict(me.labels or {}) if me else {}
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
        self.files.write_progress(
            stage=stage, shards_done=self.shards_done, n_shards=self.n_shards, shards_skipped=self.skipped, placement=self.placement
        )

    def label(self, workers: int) -> None:
        """Where this run landed and how many runs share the job, as labels of the flow run
        (the UI shows them; `choose_workers` reads `harvest.workers` back on a reschedule)."""
        if self.id is None:
            return
        labels = {WORKERS_LABEL: str(workers)}
        for key, value in (self.placement or {}).items():
            labels[f"harvest.{key}"] = "" if value is None else str(value)
        try:
            self.client.update_flow_run_labels(self.id, labels)
        except Exception:  # display and resume aid; the job goes on without it
            get_run_logger().warning("could not label flow run %s", self.id, exc_info=True)

    def shard_done(self, k: int, skipped: bool) -> None:
        self.shards_done += 1
        if skipped:
            self.skipped += 1
        else:
            self.tokens_done += self.tokens_per_shard[k]
        rate = self.tokens_done / max(time.perf_counter() - self.started, 1e-6)
        fraction = 100.0 * self.shards_done / max(self.n_shards, 1)
        text = f"{self.shards_done}/{self.n_shards} shards, {rate:,.0f} tokens/s"
        self.files.write_progress(
            stage="forward",
            shards_done=self.shards_done,
            n_shards=self.n_shards,
            shards_skipped=self.skipped,
            tokens_per_s=round(rate, 1),
            placement=self.placement,
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
            time.sleep(pause_s)  # the test/demo throttle (Settings.flow_shard_pause_s)
    return timings


def _start_helpers(run: _Run, ranges: list[list[int]]) -> list[tuple[list[int], UUID]]:
    """One flow run of this run's deployment per range; idempotent, so a resumed parent
    re-attaches to the helpers it started before instead of starting new ones."""
    from prefect.deployments import run_deployment

    job_id = run.job_id
    tags = [t for t in (current_run.tags or []) if not t.startswith("key:")] + [HELPER_TAG, f"job:{job_id}"]
    # Helpers run with the parent's job variables (e.g. its env), so they behave the same.
    job_variables = run.job_variables
    helpers = []
    for rng in ranges:
        child = run_deployment(
            run.deployment,
            parameters={"job_id": job_id, "request_url": run.files.request_url, "shard_range": rng},
            timeout=0,
            as_subflow=True,
            idempotency_key=f"{job_id}:shards-{rng[0]}-{rng[1]}",
            flow_run_name=f"{job_id}-shards-{rng[0]}-{rng[1]}",
            tags=tags,
            job_variables=job_variables or None,
        )
        helpers.append((rng, child.id))
    return helpers


def _helper_kind(client, child_id: UUID) -> StateType | None:
    """The helper's state type; None when it cannot be read (counts as unknown)."""
    try:
        state = client.read_flow_run(child_id).state
    except Exception:
        get_run_logger().debug("could not read helper %s", child_id, exc_info=True)
        return None
    return state.type if state else StateType.SCHEDULED


def _cancel_helper(client, child_id: UUID) -> bool:
    """Cancel a helper so that it never starts (or restarts) its range; False when it turned
    out to be running or completed meanwhile (then it keeps its range)."""
    message = "Taken over by the parent run."
    try:
        if client.set_flow_run_state(child_id, CancelledState(message=message)).status == SetStateStatus.ACCEPT:
            return True
        if _helper_kind(client, child_id) in (StateType.RUNNING, StateType.COMPLETED):
            return False
        client.set_flow_run_state(child_id, CancelledState(message=message), force=True)
    except Exception:  # unreachable API: its range is done here anyway, the writes are idempotent
        get_run_logger().warning("could not cancel helper %s; taking its shards over anyway", child_id, exc_info=True)
    return True


class HelperWatch:
    """A parent's looks at the runs it handed work to (shard ranges here, a corpus refresh's
    parts in `flows.corpus_refresh`): on each look, what to do about one (`helper_action`).

    It remembers each run's last state and since when, and when the grace began: call
    `start_grace()` once the parent has no work of its own left.
    """

    def __init__(self, client, settings: Settings):
        self.client = client
        self.grace_s = settings.helper_grace_s
        self.stall_s = settings.helper_stall_s
        self.grace_ends: float | None = None
        self.seen: dict[UUID, tuple[StateType | None, float]] = {}  # last state seen, and since when

    def start_grace(self) -> None:
        if self.grace_ends is None:
            self.grace_ends = time.monotonic() + self.grace_s

    def look(self, child_id: UUID) -> tuple[str, StateType | None]:
        """`(action, state)`; a TAKE_OVER is already settled: the run is cancelled, so its
        work is the parent's (a run that started meanwhile answers WAIT instead)."""
        kind = _helper_kind(self.client, child_id)
        now = time.monotonic()
        last, since = self.seen.get(child_id, (kind, now))
        self.seen[child_id] = (kind, since if kind == last else now)
        since_grace = now - self.grace_ends if self.grace_ends is not None else float("-inf")
        action = helper_action(kind, since_grace, now - self.seen[child_id][1], stall_s=self.stall_s)
        if action == TAKE_OVER and not _cancel_helper(self.client, child_id):
            return WAIT, kind  # it started just now: look again next round
        return action, kind


def _collect_helpers(
    work: ShardWork, run: _Run, helpers: list[tuple[list[int], UUID]], pause_s: float, settings: Settings
) -> Timings:
    """Wait for the helpers (never for ever: `helper_action`); do here any range they did not."""
    logger = get_run_logger()
    timings = Timings()
    pending = list(helpers)
    watch = HelperWatch(run.client, settings)
    watch.start_grace()  # this run's own range is done
    while pending:
        for rng, child_id in list(pending):
            if run.cancelling():
                raise Cancelled("cancelled while waiting for helper runs")
            action, kind = watch.look(child_id)
            if action == WAIT:
                continue
            if action == COLLECT:
                helper_timings = work.files.read_helper_timings(rng)
                if helper_timings is not None:
                    timings.add(Timings(**helper_timings))
            else:
                what = kind.value if kind else "unknown"
                logger.info("helper %s %s (%s); doing shards %s..%s here", child_id, action, what, rng[0], rng[1] - 1)
                timings.add(_run_range(work, run, range(*rng), pause_s))
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
def harvest(job_id: str, request_url: str, workers: int | None = None, shard_range: list[int] | None = None) -> dict:
    """Harvest one job: shards (skipping verified ones), statistics, manifest last.

    job_id: the job's uuid; the manifest records it.
    request_url: storage URL of the job's request.json; the job's files go in its folder.
    workers: split the shards over this many flow runs of the lane (1: this run does all);
        None: as many as the lane's free slots allow (the module docstring's policy).
    shard_range: `[start, stop)` for a helper run: write those shards only, no manifest.
    """
    logger = get_run_logger()
    settings = get_settings()  # in this flow run's process: its own environment
    files = JobFiles.from_request_url(request_url)
    run: _Run | None = None
    try:
        job = resolve_job(files.read_request(), load_registry())
        tokenized = tokenize_job(job)
        ranges = shard_ranges(len(tokenized), job.request.shard_size)
        n_shards = len(ranges)
        helper = shard_range is not None
        # Before anything touches CUDA: this host's slot, and CUDA_VISIBLE_DEVICES with it.
        placement = place_run(job.model, settings, on_wait=lambda: files.write_progress(stage="waiting for a slot"))
        tokens_per_shard = [sum(len(tokenized[i].ids) for i in r) for r in ranges]
        run = _Run(job_id, files, job.model.lane, tokens_per_shard, placement)
        if helper:
            plan = [list(shard_range)]
        else:
            previous = run.labels.get(WORKERS_LABEL)
            plan = split_ranges(n_shards, choose_workers(workers, run.pool, n_shards, settings, run.client, previous, logger.info))
        own = range(max(0, plan[0][0]), min(n_shards, plan[0][1]))
        if helper:
            run.n_shards = len(own)
        run.label(1 if helper else len(plan))
        if placement:
            logger.info("placed on %s slot %s (devices %s)", placement["host"], placement["slot"], placement["devices"] or "none")
        helpers = _start_helpers(run, plan[1:]) if len(plan) > 1 else []

        run.stage("loading")
        if settings.flow_load_pause_s:
            time.sleep(settings.flow_load_pause_s)  # the test/demo throttle
        started = time.perf_counter()
        engine = load_engine(job.model)
        load_s = time.perf_counter() - started
        logger.info("loaded %s on %s in %.1f s; shards %s..%s of %s", job.model.name, engine.name, load_s, own.start, own.stop - 1, n_shards)

        work = ShardWork(job, files, engine, tokenized)
        timings = _run_range(work, run, own, settings.flow_shard_pause_s)
        timings.load_s = load_s
        if helper:
            files.write_helper_timings(plan[0], vars(timings))
            return {"job_id": job_id, "shard_range": plan[0], "timings": timings.as_dict(), "placement": placement}
        if helpers:
            run.stage("waiting for helper runs")
            timings.add(_collect_helpers(work, run, helpers, settings.flow_shard_pause_s, settings))

        run.stage("finalizing")
        summary: JobSummary = finalize_job(work, engine.versions(), job_id, timings)
        run.stage("done")
        result = {
            **summary.as_dict(), "job_id": job_id, "shards_skipped": run.skipped, "workers": len(plan), "placement": placement,
        }
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
        if not shard_range:
            files.discard_manifest()  # a failed job leaves no manifest
        return Failed(message=_short(exc))
    finally:
        if run is not None:
            run.close()
