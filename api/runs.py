"""The API's one seam to whatever runs jobs: start a run, cancel it, read many runs' states.

Production runs are Prefect flow runs (`PrefectRuns`, through the orchestration layer's
`flows.submit`). The app takes its run store from its factory (`api.app.create_app(runs=...)`),
so a test can hand it a run store of its own at exactly this seam and exercise everything
above it for real.

`read` takes many runs at once: the API's single watcher calls it once per tick for the runs
that tick looks at (those the events named, and a page of its re-read of every active job),
instead of each long-poll waiter polling Prefect. `follow` tells the watcher which run has
changed (its state, or the job's progress it reports: `flows.run_status.PROGRESS_EVENT`), so it
reads that run then instead of waiting for its re-read to come round.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from flows.run_status import PROGRESS_EVENT, RunStatus  # the one mapping of a run to a job's status
from harvest.lanes import load_lanes
from harvest.settings import Settings

__all__ = ["RunStatus", "RunStore", "PrefectRuns"]

log = logging.getLogger("harvest.api.runs")

FOLLOWED_STATES = ("Running", "Completed", "Failed", "Crashed", "Cancelled", "TimedOut")
"""Prefect flow-run states whose event wakes the watcher: every change a job's status shows."""
RUN_RESOURCE = "prefect.flow-run."
"""How an event names its flow run: resource id `prefect.flow-run.<id>`."""
FOLLOW_RETRY_S = 5.0
"""Pause before subscribing again after the event stream broke (the ticks go on meanwhile)."""


class RunStore(Protocol):
    def start(self, job_id: str, request_url: str, model: str, lane: str, key_id: str) -> str:
        """Start the job's run (idempotent per job id); returns the run id."""

    def cancel(self, run_id: str) -> None:
        """Stop the run, also while it is still loading."""

    def cancel_job(self, job_id: str) -> None:
        """Stop every run of the job, found by the job (not a run id): what a start that failed
        after the backend created the run leaves behind. No run: nothing to do."""

    def read(self, run_ids: list[str]) -> dict[str, RunStatus]:
        """States of these runs (runs unknown to the backend are left out)."""

    def reschedule(self, run_id: str) -> None:
        """Put a crashed run back in its lane's queue; it resumes on whichever host takes it."""

    async def follow(self, changed: Callable[[str], None]) -> None:
        """Call `changed(run_id)` whenever that run may have changed (its state, or the
        progress it reports), until cancelled; a backend that pushes nothing returns at once
        (the watcher's paged re-read still reads every run)."""


class PrefectRuns:
    """Job runs as Prefect flow runs on the lane's deployment (the orchestration layer's API)."""

    def __init__(self, settings: Settings) -> None:
        from flows.submit import KeyQueues, share_tls_context

        self.settings = settings  # its lanes file: each key's run limit (re-read when it changes)
        self.key_queues = KeyQueues()  # the key queues this replica made sure of lately
        share_tls_context()  # the replica's Prefect clients (a few a second) build no TLS context each

    def start(self, job_id: str, request_url: str, model: str, lane: str, key_id: str) -> str:
        from flows.submit import start_harvest_run

        return str(start_harvest_run(job_id, request_url, model, lane, key_id,
                                     lane_config=load_lanes(self.settings).get(lane), key_queues=self.key_queues))

    def cancel(self, run_id: str) -> None:
        from flows.submit import cancel_harvest_run

        cancel_harvest_run(run_id)

    def cancel_job(self, job_id: str) -> None:
        from flows.submit import cancel_job_runs

        cancel_job_runs(job_id)

    def reschedule(self, run_id: str) -> None:
        from flows.submit import reschedule_harvest_run

        reschedule_harvest_run(run_id)

    async def follow(self, changed: Callable[[str], None]) -> None:
        """Prefect's own event stream (its `/events/out` websocket, authenticated as every
        client is): each flow-run state event in `FOLLOWED_STATES`, and each progress report of
        a job's run (`PROGRESS_EVENT`), named by the event's resource, its flow run (on
        connecting, the last minute's too: one more read, nothing missed across a short
        reconnect; the watcher's paged re-read catches what a longer break missed)."""
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventFilter, EventNameFilter

        names = [f"prefect.flow-run.{state}" for state in FOLLOWED_STATES] + [PROGRESS_EVENT]
        followed = EventFilter(event=EventNameFilter(name=names))
        while True:
            try:
                async with get_events_subscriber(filter=followed) as events:
                    async for event in events:
                        resource = event.resource.id
                        if resource.startswith(RUN_RESOURCE):
                            changed(resource[len(RUN_RESOURCE):])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Prefect away or restarting: the watcher's ticks still read every run
                log.warning("Prefect's event stream broke (%s); subscribing again in %g s", exc, FOLLOW_RETRY_S)
            await asyncio.sleep(FOLLOW_RETRY_S)

    def read(self, run_ids: list[str]) -> dict[str, RunStatus]:
        from flows.submit import read_harvest_runs

        return read_harvest_runs(run_ids) if run_ids else {}
