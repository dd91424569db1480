"""A host's Prefect process worker that takes a run as soon as Prefect says there is one.

`prefect worker start --type process` asks its pool for scheduled runs every
`PREFECT_WORKER_QUERY_SECONDS`: a new run waited for the next poll, 0.63 s (median) of a warm
small job's 3.8 s through `make run` at a 1 s poll (bench/RESULTS.md, "Through make run as
shipped", 2026-12-07). Polling faster costs the Prefect server per host per second, so this
worker keeps a slow poll (`fleet.processes.WORKER_QUERY_S`, 5 s: it still finds every run,
whatever happens to events) and is woken by Prefect's own event stream (`/events/out`,
authenticated as every client is):

- a run of its pool was scheduled (`prefect.flow-run.Scheduled`, a new run;
  `AwaitingRetry`, one rescheduled after its host died): it may take it;
- a run of its pool ended (Completed, Failed, Cancelled, Crashed): a slot of the run's key
  queue may have come free for a run that waited;
- this worker let a run's slot go (its process exited, or a submit failed): a run that waited
  for this host's `--limit` may start. A run's process outlives its Completed state by 1.5-1.8 s
  (Prefect's flow heartbeat thread sleeps in whole seconds before it is joined, then the
  interpreter exits), so without this wake the next job on a one-slot host waited for the
  poll after that too.

A run cancelled while its process starts could stay Cancelling until `flows.liveness` gave up
on it (60 s): Prefect's engine, finding its run Cancelling before it ran, exits, and neither the
worker's cancellation observer (it leaves runs that have started to the run's own) nor the
run's (its process not yet registered when the event came) finishes the cancel. 6 of 22
cancels sent within 0.2 s of a start took 63-65 s so. So when a run's process ends on this
host and its run is still Cancelling, this worker finishes the cancel: nothing of the run is
left to stop (`finish_cancel`).

A wake is one more `get_and_submit_flow_runs`, Prefect's own poll-and-submit. Wakes that come
while one runs are folded into one more after it. Two polls that see the same run submit it
once: the worker skips a run it is already submitting, and Prefect's `Pending` proposal lets
only one worker (or one poll) take a run.

`python -m fleet.pool_worker --pool P [--name N] [--limit K] [--with-healthcheck]`: the same
flags as `prefect worker start` for what the roles use (`fleet.processes.start_worker`), and
the same worker: Prefect's `ProcessWorker`, its signal handling and its health check.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

__all__ = ["WAKE_STATES", "wakes_pool", "finish_cancel", "run_worker", "main"]

log = logging.getLogger("harvest.pool_worker")

WAKE_STATES = ("Scheduled", "AwaitingRetry", "Completed", "Failed", "Cancelled", "Crashed")
"""Flow-run state events that may leave a run of the pool for this worker to take."""
RESUBSCRIBE_S = 2.0
"""Pause before subscribing again when the event stream broke (the poll goes on meanwhile)."""


def wakes_pool(event, pool: str) -> bool:
    """Whether a flow-run event concerns a run of `pool` (its related work-pool resource)."""
    return any(
        related.get("prefect.resource.role") == "work-pool" and related.get("prefect.resource.name") == pool
        for related in event.related
    )


async def _listen(pool: str, wake: asyncio.Event) -> None:
    from prefect.events.clients import get_events_subscriber
    from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter
    from prefect.events.schemas.events import ResourceSpecification

    # The server sends only this pool's runs' events (a fleet's other lanes cost it nothing here).
    followed = EventFilter(
        event=EventNameFilter(name=[f"prefect.flow-run.{state}" for state in WAKE_STATES]),
        any_resource=EventAnyResourceFilter(
            labels=ResourceSpecification({"prefect.resource.role": "work-pool", "prefect.resource.name": pool})
        ),
    )
    while True:
        try:
            async with get_events_subscriber(filter=followed) as events:
                async for event in events:
                    if wakes_pool(event, pool):
                        wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server away or restarting: the poll still finds every run
            log.warning("Prefect's event stream broke (%s); subscribing again in %g s", exc, RESUBSCRIBE_S)
        await asyncio.sleep(RESUBSCRIBE_S)


async def _take_on_wake(worker, wake: asyncio.Event) -> None:
    while True:
        await wake.wait()
        wake.clear()  # a wake from now on means one more poll after this one
        try:
            await worker.get_and_submit_flow_runs()
        except Exception as exc:  # as a failed poll: the next wake or poll tries again
            log.warning("a woken poll failed: %s", exc)


async def finish_cancel(client, flow_run_id) -> bool:
    """Mark the run Cancelled if it is still Cancelling, now that its process on this host has
    ended; returns whether it did. A proposal, not forced: a run that moved on meanwhile (say
    Cancelled by Prefect's own cancellation) keeps its state."""
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelled

    run = await client.read_flow_run(flow_run_id)
    if run.state is None or run.state.type != StateType.CANCELLING:
        return False
    result = await client.set_flow_run_state(flow_run_id, Cancelled(message="Cancelled: its process ended before it ran."))
    return result.status == SetStateStatus.ACCEPT


async def run_worker(pool: str, name: str | None, limit: int | None, with_healthcheck: bool) -> None:
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS
    from prefect.utilities.processutils import setup_signal_handlers_worker
    from prefect.workers.process import ProcessWorker

    setup_signal_handlers_worker(os.getpid(), "the process worker", print)
    worker = ProcessWorker(
        name=name, work_pool_name=pool, limit=limit, prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
    )
    wake = asyncio.Event()
    release = worker._release_limit_slot  # Prefect's one place a slot of --limit is let go

    def release_and_wake(flow_run_id):
        release(flow_run_id)
        wake.set()

    worker._release_limit_slot = release_and_wake
    run_process = worker.run  # ProcessWorker.run: returns once the run's process has ended

    async def run_then_finish_cancel(flow_run, configuration, task_status=None):
        try:
            return await run_process(flow_run, configuration, task_status)
        finally:
            try:
                if await finish_cancel(worker.client, flow_run.id):
                    log.info("flow run %s: its process ended while it was Cancelling; marked Cancelled", flow_run.id)
            except Exception as exc:  # Prefect away: flows.liveness still finishes it
                log.warning("flow run %s: could not finish its cancel: %s", flow_run.id, exc)

    worker.run = run_then_finish_cancel
    woken = [asyncio.create_task(_listen(pool, wake)), asyncio.create_task(_take_on_wake(worker, wake))]
    try:
        await worker.start(with_healthcheck=with_healthcheck)
    finally:
        for task in woken:
            task.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fleet.pool_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--name")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--with-healthcheck", action="store_true")
    args = parser.parse_args(argv)
    try:
        asyncio.run(run_worker(args.pool, args.name, args.limit, args.with_healthcheck))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"Worker {args.name!r} stopped!")


if __name__ == "__main__":
    main()
