"""The API's single watcher: follows the runs of all active jobs and wakes long-poll waiters.

Once per `watch_interval_s` it reads the states of every active job's run in one call to the
run backend (one Prefect query for all jobs, however many clients wait), records changes in
the job store (which charges ended jobs, exactly once), counts written shards for progress,
and wakes the waiters of each job whose status changed. A `?wait=` reader never talks to
Prefect; it sleeps on an asyncio event until the watcher (or a cancel) sets it.

On a fresh API process the first tick is the re-attachment: active jobs read `pending` until
it has read their runs; a job admitted by a process that died before starting its run gets
its run started here (idempotent per job id, so a run that did start is found, not doubled).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from contextlib import contextmanager

from api.runs import Runs, RunState
from api.store import BOOT_ID, active_jobs, apply_state, attach_run, fail_job, set_progress
from harvest.manifest import MANIFEST
from harvest.storage import Storage

__all__ = ["Watcher", "read_result"]

log = logging.getLogger("harvest.api.watcher")


def read_result(storage: Storage, job_id: str) -> dict | None:
    """The result numbers of a finished job, from its manifest (None when there is none)."""
    files = storage.child(f"jobs/{job_id}")
    if not files.exists(MANIFEST):
        return None
    manifest = json.loads(files.read_bytes(MANIFEST))
    timings = manifest.get("timings", {})
    return {
        "n_shards": len(manifest["shards"]),
        "layer_indices": manifest["layer_indices"],
        "contents": manifest["contents"],
        "tokens": manifest["tokens"],
        "bytes_written": manifest["bytes_written"],
        "timings": {k: float(timings.get(k, 0.0)) for k in ("load_s", "forward_s", "save_s", "upload_s")},
    }


def _shards_done(storage: Storage, job_id: str) -> int:
    return sum(1 for name in storage.child(f"jobs/{job_id}/_parts").listdir() if name.endswith(".safetensors"))


class Watcher:
    """One per API process (started by the app's lifespan)."""

    def __init__(self, runs: Runs, storage: Storage, interval: float, max_waiters: int):
        self.runs = runs
        self.storage = storage
        self.interval = interval
        self.max_waiters = max_waiters
        self.waiting = 0
        self.ticks = 0
        self.run_reads = 0
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._kick: asyncio.Event | None = None

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="harvest-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                changed = await asyncio.to_thread(self.tick)
                for job_id in changed:
                    self.notify(job_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # Prefect or the database briefly away: try again next tick
                log.exception("watcher tick failed")
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()

    def kick(self) -> None:
        """Run the next tick now (after a submit, so a fast run is seen quickly)."""
        if self._loop is not None and self._kick is not None:
            self._loop.call_soon_threadsafe(self._kick.set)

    # --- one pass over all active jobs --------------------------------------------------
    def tick(self) -> list[str]:
        """Read every active job's run once; returns the jobs whose status changed."""
        self.ticks += 1
        changed: list[str] = []
        rows = active_jobs()
        for row in rows:
            if row["flow_run_id"] is None and row["attached_by"] != BOOT_ID:
                changed += self._restart_orphan(row)
        with_runs = [r for r in rows if r["flow_run_id"]]
        if not with_runs:
            return changed
        self.run_reads += 1
        states = self.runs.read([r["flow_run_id"] for r in with_runs])
        for row in with_runs:
            state = states.get(row["flow_run_id"])
            if state is None:
                continue
            try:
                result = read_result(self.storage, row["id"]) if state.status == "done" else None
                moved = apply_state(row["id"], state, result=result)
                if state.status == "running" and set_progress(row["id"], _shards_done(self.storage, row["id"])):
                    moved = True
            except Exception:  # storage briefly away: this job waits for the next tick, the others go on
                log.exception("could not follow job %s", row["id"])
                continue
            if moved:
                changed.append(row["id"])
        return changed

    def _restart_orphan(self, row: dict) -> list[str]:
        """A job admitted by an API process that died before starting its run."""
        try:
            run_id = self.runs.start(row["id"], row["request_url"], row["model"], row["lane"], row["key_id"])
        except Exception as exc:
            log.exception("could not start the run of job %s", row["id"])
            fail_job(row["id"], f"The harvest could not be started: {exc}")
            return [row["id"]]
        attach_run(row["id"], run_id)
        row["flow_run_id"] = run_id
        return []

    def refresh(self, row: dict) -> bool:
        """Read one job's run now (before a cancel decides what to charge)."""
        if not row["flow_run_id"] or row["attached_by"] != BOOT_ID:
            return False
        state: RunState | None = self.runs.read([row["flow_run_id"]]).get(row["flow_run_id"])
        if state is None:
            return False
        result = read_result(self.storage, row["id"]) if state.status == "done" else None
        return apply_state(row["id"], state, result=result)

    # --- long-poll waiters ----------------------------------------------------------------
    def notify(self, job_id: str) -> None:
        """Wake the waiters of a job (call from the event loop)."""
        for event in self._events.get(job_id, ()):
            event.set()

    def notify_threadsafe(self, job_id: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.notify, job_id)

    def try_enter(self) -> bool:
        """Take a waiter slot, or False when `max_waiters` are already held."""
        if self.waiting >= self.max_waiters:
            return False
        self.waiting += 1
        return True

    def leave(self) -> None:
        self.waiting -= 1

    @contextmanager
    def subscription(self, job_id: str):
        """An event set whenever the job is notified; subscribe before reading the job, so a
        change between the read and the wait cannot be missed."""
        event = asyncio.Event()
        self._events[job_id].add(event)
        try:
            yield event
        finally:
            self._events[job_id].discard(event)
            if not self._events[job_id]:
                del self._events[job_id]
