"""A harvest run's view of itself: who it is, whether it is being cancelled, and its progress.

Progress goes four ways, for four readers: the job's progress file (`JobFiles`: stage, counts
and tokens/s, for whoever reads the job's folder), a Prefect progress artifact (the UI), the run's
labels (where it landed: `harvest.slot`, `harvest.devices`, `harvest.workers`, beside Prefect's
own `prefect.worker.name`), and, for the API, the job's shard count on the job's own run
(`report`: the `harvest.shards_done` label, then a `harvest.run.progress` event naming the run;
`flows.run_status`). The API's watcher reads that label with the run's state and wakes on the
event, so a job's `progress` costs it one Prefect read per change, never a listing of the job's
folder; the run, which holds no job-store credentials, writes nothing but Prefect. All of it is
best effort: a display failure never fails a job (a missed event is caught by the watcher's
paged re-read of every active run, `api.watcher`).

The labels and the progress artifact go through a thread of the run's own (`ProgressWriter`),
never the shard loop: a label update is a read-modify-write of the flow run, and on the
embedded SQLite server it collides with the run's own state and event writes often enough that
Prefect's client sleeps through a 503 retry (0.45-1.88 s in 7 of 11 warm 2-prompt jobs through
`make run`; bench/RESULTS.md, "Through make run as shipped", 2026-12-07). A count that the
run's end makes known anyway (its last shard) is not reported: the Completed run's result
carries it. Counts mid-job are written in turn, each on the run for at least `COUNT_SHOWN_S`
before the next replaces it, so a reader following the job sees each one; the shard loop never
waits for them (it once did, and a 4-shard job through `make run` spent seconds of its
corpus time waiting for label writes; bench/RESULTS.md, "make run against harvest run").
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from typing import Callable
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events import emit_event
from prefect.runtime import flow_run as current_run

from flows.placement import WORKERS_LABEL
from flows.run_status import PROGRESS_EVENT, SHARDS_DONE_LABEL
from harvest.jobfiles import JobFiles
from harvest.lanes import deployment_name

__all__ = ["ProgressWriter", "RunProgress", "summary_artifact"]

COUNT_SHOWN_S = 1.0
"""The least time a shard count mid-job stays on the run before the next is written: the API's
watcher reads it within moments of its event, and a client polling the job sees it."""


class ProgressWriter:
    """A flow run's labels and progress artifact, written on a thread of its own, in order, the
    newest value of each winning over one not yet written. Shard counts are not folded: each
    is written in turn as the `SHARDS_DONE_LABEL` label, at least `COUNT_SHOWN_S` after the one
    before, then the progress event naming the run (the label first, so the watcher's read on
    the event finds it).

    `close(after=…)`: nothing more is taken, and counts not yet written are dropped (the run's
    end carries the job's count); what else is pending (the bar at 100 %) is written once
    `after()` is true (the run's state is final) or `DRAIN_WAIT_S` passed, and the thread ends.
    It is not a daemon, so the run's process ends after it: the last writes never delay the
    run's Completed state (on SQLite they collided with it and cost it 0.7 s, median of 10)."""

    DRAIN_WAIT_S = 5.0

    def __init__(
        self, run_id: UUID, artifact_key: str,
        client: Callable[[], AbstractContextManager] = lambda: get_client(sync_client=True),
    ):
        self.run_id = run_id
        self.artifact_key = artifact_key
        self._client = client
        self._pending: dict[str, str] = {}
        self._counts: deque[int] = deque()  # shard counts to write, oldest first
        self._count_written_at = float("-inf")
        self._progress: tuple[float, str] | None = None  # the artifact's percent and text
        self._artifact: UUID | None = None
        self._busy = False
        self._closed = False
        self._after: Callable[[], bool] = lambda: True
        self._changed = threading.Condition()
        # Prefect's settings (its API URL and auth) live in the context: the thread gets a copy.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._write_all,), daemon=False, name="harvest-run-progress")
        self._thread.start()

    def put(self, labels: dict[str, str] | None = None, count: int | None = None, progress: tuple[float, str] | None = None) -> None:
        with self._changed:
            self._pending.update(labels or {})
            if count is not None and not self._closed:
                self._counts.append(count)
            if progress is not None:
                self._progress = progress
            self._changed.notify()

    def _waiting(self) -> bool:
        return bool(self._pending) or bool(self._counts) or self._progress is not None

    def flush(self, timeout: float) -> bool:
        """Wait until everything put so far is written, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._waiting() or self._busy:
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def close(self, after: Callable[[], bool] = lambda: True) -> None:
        with self._changed:
            self._closed, self._after = True, after
            self._counts.clear()
            self._changed.notify()

    def _show(self, percent: float, text: str) -> None:
        """The run's progress artifact (the UI's bar): made on the first call, updated after."""
        if self._artifact is None:
            self._artifact = create_progress_artifact(progress=percent, key=self.artifact_key, description=text)
        else:
            update_progress_artifact(self._artifact, progress=percent, description=text)

    def _write_all(self) -> None:
        with self._client() as client:
            while True:
                with self._changed:
                    while not self._waiting() and not self._closed:
                        self._changed.wait()
                    if self._closed and not self._waiting():
                        return
                    closed = self._closed
                if closed:  # the last writes: once the run's end is recorded
                    deadline = time.monotonic() + self.DRAIN_WAIT_S
                    while not self._after() and time.monotonic() < deadline:
                        time.sleep(0.02)
                with self._changed:
                    # The next count waits until the one before has been shown its while.
                    shown_until = self._count_written_at + COUNT_SHOWN_S
                    while self._counts and not self._closed and time.monotonic() < shown_until:
                        self._changed.wait(shown_until - time.monotonic())
                    count = self._counts.popleft() if self._counts else None
                    labels = {**self._pending, **({SHARDS_DONE_LABEL: str(count)} if count is not None else {})}
                    progress = self._progress
                    self._pending, self._progress, self._busy = {}, None, True
                try:
                    if labels:
                        client.update_flow_run_labels(self.run_id, labels)
                    if count is not None:
                        self._count_written_at = time.monotonic()
                        emit_event(PROGRESS_EVENT, resource={"prefect.resource.id": f"prefect.flow-run.{self.run_id}"},
                                   payload={"shards_done": count})
                    if progress is not None:
                        self._show(*progress)
                except Exception:  # display and progress: the watcher's paged re-read catches up
                    get_run_logger().debug("progress write failed", exc_info=True)
                finally:
                    with self._changed:
                        self._busy = False
                        self._changed.notify_all()


def _run_ended() -> bool:
    """Whether this flow run's state is final, as its engine last set it (the engine's own
    flow run object, which the run context holds)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    state = context.flow_run.state if context is not None and context.flow_run is not None else None
    return state is None or state.is_final()


class RunProgress:
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
        me = self._me()
        # Helpers are runs of this run's own deployment, so they land on the pool whose free
        # slots were counted; a run without one (a subflow: a corpus refresh's part done in
        # the refresh's process) uses its lane's.
        self.pool: str = (me.work_pool_name if me else None) or lane
        self.deployment: UUID | str = (me.deployment_id if me else None) or deployment_name(lane)
        self.job_variables = me.job_variables if me else None
        # Its key's work queue (`flows.key_queues`): helpers wait there, and placement counts
        # what that queue leaves free.
        self.work_queue: str | None = me.work_queue_name if me else None
        self.labels = dict(me.labels or {}) if me else {}
        self.started = time.perf_counter()
        self.tokens_done = 0
        self.shards_done = 0
        self.skipped = 0
        self.job_split: bool | None = None
        """None: a helper (its count is not the job's; the parent reports); else whether the
        job is split over helper runs too (`reports_for_job`)."""
        self.reported: int | None = None  # the last count this run reported for its job
        self.writer = ProgressWriter(self.id, f"harvest-progress-{job_id}"[:100].lower()) if self.id is not None else None

    def _me(self):
        """This flow run as Prefect's engine read it when the run began (its context holds it;
        a read of our own would cost the run's start a request), else read now."""
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is not None and context.flow_run is not None and context.flow_run.id == self.id:
            return context.flow_run
        return self.client.read_flow_run(self.id) if self.id is not None else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(after=_run_ended)
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
        if self.writer is None:
            return
        labels = {WORKERS_LABEL: str(workers)}
        for key, value in (self.placement or {}).items():
            labels[f"harvest.{key}"] = "" if value is None else str(value)
        self.writer.put(labels)

    def reports_for_job(self, split: bool) -> None:
        """This run is the job's own (not a helper): its count is the job's progress. `split`:
        helper runs write shards too, so the count is the job folder's records (one listing of
        `_parts/` per report, in this run's process), not this run's own shards."""
        self.job_split = split

    def report(self) -> None:
        """Tell the API how many of the job's shards are written, if that changed and the
        run's end will not say it (its last shard): the job run's `SHARDS_DONE_LABEL`, then a
        `PROGRESS_EVENT` naming the run (`LabelWriter`). A helper reports nothing."""
        if self.writer is None or self.job_split is None:
            return
        try:
            count = self.files.shards_done() if self.job_split else self.shards_done
        except Exception:  # progress is shown late (the watcher's paged re-read), never fails the job
            get_run_logger().debug("progress count failed", exc_info=True)
            return
        if count == self.reported or count >= self.n_shards:
            return
        self.writer.put(count=count)  # written in turn, each shown its while (`ProgressWriter`)
        self.reported = count

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
        self.report()
        if self.writer is not None:
            self.writer.put(progress=(fraction, text))



def summary_artifact(job_id: str, result: dict) -> None:
    """A small table in the UI: what the job wrote and where the time went."""
    rows = [f"| {k} | {v} |" for k, v in result.items() if k != "timings"]
    rows += [f"| {k} | {v} |" for k, v in result["timings"].items()]
    try:
        create_markdown_artifact("| field | value |\n|---|---|\n" + "\n".join(rows), description=f"harvest {job_id}")
    except Exception:  # display only
        get_run_logger().debug("summary artifact failed", exc_info=True)


