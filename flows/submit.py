"""Starting, cancelling and reading harvest flow runs: all the API needs to know about Prefect.

The API calls these by name and never sees deployments, pools or Prefect state types:

    await astart_harvest_run(job_id, request_url, model, lane, key_id)  -> flow_run_id (str)
    await acancel_harvest_run(flow_run_id)                              -> job status after it
    await acancel_job_runs(job_id)                                      every run tagged job-id:<id> stopped
    await areschedule_harvest_run(flow_run_id)                          crashed → scheduled again
    await aread_harvest_run(flow_run_id)                                -> RunStatus
    start_harvest_run / cancel_harvest_run / read_harvest_run / reschedule_harvest_run / cancel_job_runs
                                                                        the same, synchronous

`share_tls_context()` makes the process's Prefect clients share one TLS context
(`flows.prefect_clients`): the API's run store calls it once.

Each sync function is the async one run to completion (safe to call from inside an event loop
too: Prefect's helper then runs it on another thread).

`start` creates the flow run of deployment `harvest/harvest-<lane>` with parameters
`{"job_id", "request_url"}` only (prompts never go into Prefect's database), named after the
job, tagged `job-id:<job_id>`, `model:<m>`, `lane:<lane>`, `key:<key_id>`, with idempotency
key = job id: a second call for the same job (e.g. an API restarted mid-submit) returns the
same run. The run waits in its key's work queue of the lane's pool (`flows.key_queues`), made
first if need be, so a key holds at most the lane's `key_run_limit` slots at once. The
`job-id:` tag (scale-out helpers inherit it; their own `job:` tag marks helpers only) finds a
job's runs when the start failed after Prefect created the run and its id never came back:
`cancel_job_runs`.

Overload: starting a run is bounded in time (`START_BOUND_S`). Prefect's client retries a 503
or 429 from its server (an embedded SQLite server under load answers `create_flow_run` with
503) with growing back-offs, by default for over a minute; here it retries at most
`START_RETRIES` times and the whole start gives up after `START_BOUND_S` with
`RunStartTimeout`, so the API answers its own 503 with Retry-After instead of holding a client.
A start that gave up may still have created its run: the API cancels the job's runs by the
`job-id:` tag (`cancel_job_runs`), so nothing is left half-made.

A run's job status is `flows.run_status`'s one mapping (`run_status`), read here for one run
or many (`read_harvest_runs`, a page of 200 per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import anyio
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterTags
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.states import AwaitingRetry, Cancelling
from prefect.utilities.asyncutils import run_coro_as_sync

from flows.key_queues import KeyQueues
from flows.run_status import RunStatus, job_status, run_started_at, run_status
from flows.prefect_clients import share_tls_context
from harvest.lanes import Lane, deployment_name

__all__ = [
    "START_BOUND_S",
    "START_RETRIES",
    "RunStartTimeout",
    "RunStatus",
    "deployment_name",
    "job_runs_filter",
    "job_status",
    "run_started_at",
    "share_tls_context",
    "astart_harvest_run",
    "acancel_harvest_run",
    "aread_harvest_run",
    "areschedule_harvest_run",
    "reschedule_harvest_run",
    "start_harvest_run",
    "cancel_harvest_run",
    "acancel_job_runs",
    "cancel_job_runs",
    "read_harvest_run",
    "aread_harvest_runs",
    "read_harvest_runs",
    "run_status",
]

JOB_TAG = "job-id:"
"""Tag prefix of every run of a job (the job's own and, inherited, its helpers')."""
FINAL = (StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED)
NOT_STARTED = (StateType.SCHEDULED, StateType.PAUSED)
START_BOUND_S = 10.0
"""Longest a run start may take (reading the deployment and creating the run, retries included)."""
START_RETRIES = 5
"""Retries of one Prefect request during a start. The control plane's server asks for short
waits on a 503 (`fleet.prefect_server`: 0.2 s, doubling every 2 more), so 5 span about 2 s of a
SQLite write collision; against a server that asks for longer, `START_BOUND_S` still ends the
start (2 retries, before, gave up on collisions of under half a second)."""


class RunStartTimeout(TimeoutError):
    """Prefect did not create the run within `START_BOUND_S` (overloaded, or away)."""


async def astart_harvest_run(
    job_id: str, request_url: str, model: str, lane: str, key_id: str, *, lane_config: Lane | None = None,
    key_queues: KeyQueues | None = None, workers: int | None = None, env: dict[str, str] | None = None,
) -> str:
    """Create the job's flow run on its lane (returns at once, ~0.1 s); returns the flow run id.
    Bounded: `RunStartTimeout` after `START_BOUND_S` (see the module docstring).

    workers: split the job over this many flow runs of the lane (scale-out); None lets the run
    decide from the lane's free slots (`flows.placement`), as for every job the API submits.
    env: extra environment of the flow-run process (tests and operators; the API passes none).
    lane_config: the lane's declaration (`harvest.lanes`), whose per-key run limit the key's
        queue keeps; None for a pool that no lane declares (tests' own pools): no limit.
    key_queues: the key queues this starter checked lately (an API replica keeps one); None
        checks the key's queue now.
    """
    key_queues = key_queues or KeyQueues()
    parameters: dict = {"job_id": job_id, "request_url": request_url}
    if workers is not None:
        parameters["workers"] = workers
    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: START_RETRIES}), anyio.fail_after(START_BOUND_S):
            async with get_client() as client:
                deployment = await client.read_deployment_by_name(deployment_name(lane))
                queue = await key_queues.ensure(
                    client, deployment.work_pool_name or lane, key_id,
                    lane_config.key_run_limit if lane_config else None, enforce=lane_config is not None,
                )
                run = await client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters=parameters,
                    name=job_id,
                    tags=[f"{JOB_TAG}{job_id}", f"model:{model}", f"lane:{lane}", f"key:{key_id}"],
                    idempotency_key=job_id,
                    job_variables={"env": env} if env else None,
                    work_queue_name=queue,
                )
    except TimeoutError as exc:
        raise RunStartTimeout(f"Prefect did not create the run of job {job_id} within {START_BOUND_S:g} s.") from exc
    return str(run.id)


async def _cancel_one(client, run: FlowRun) -> FlowRun:
    kind = run.state.type if run.state else StateType.SCHEDULED
    if kind in FINAL or kind == StateType.CANCELLING:
        return run
    if kind in NOT_STARTED:
        # Proposed, not forced: a worker may claim the run (PENDING) between our read and this
        # write, and a forced CANCELLED over its PENDING would let the process it starts run
        # anyway (Prefect allows CANCELLED -> RUNNING). Prefect's own rule decides in the same
        # transaction: a run still SCHEDULED with no process becomes CANCELLED outright; one a
        # worker has claimed becomes CANCELLING, and its worker stops it.
        await client.set_flow_run_state(run.id, Cancelling(message="Cancelled before it started."))
    else:
        # PENDING or RUNNING: the worker sees CANCELLING, SIGTERMs the process (the flow's
        # main thread stops within ~2 s, model loading included) and marks it Cancelled. A
        # CANCELLING run whose host is gone is finished by Prefect (`flows.liveness`).
        await client.set_flow_run_state(run.id, Cancelling(message="Cancelled by request."), force=True)
    return await client.read_flow_run(run.id)


async def acancel_harvest_run(flow_run_id: str | UUID) -> str:
    """Stop a job's run (and its scale-out helpers); returns the job status afterwards.

    Idempotent: a run already ended is left alone and its status returned (the API decides
    whether that is a 409).
    """
    async with get_client() as client:
        run = await _cancel_one(client, await client.read_flow_run(UUID(str(flow_run_id))))
        job_id = (run.parameters or {}).get("job_id")
        if job_id:
            helpers = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job_id}", "scale-out-helper"]))
            )
            for helper in helpers:
                await _cancel_one(client, helper)
    return job_status(run)


def job_runs_filter(job_id: str) -> FlowRunFilter:
    """Every flow run of a job: its run and its scale-out helpers, by the job's tag."""
    return FlowRunFilter(tags=FlowRunFilterTags(all_=[f"{JOB_TAG}{job_id}"]))


async def acancel_job_runs(job_id: str) -> int:
    """Stop every run tagged `job-id:<job_id>` (the job's run and its scale-out helpers);
    returns how many were found. Runs already ended are left alone."""
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=job_runs_filter(job_id))
        for run in runs:
            await _cancel_one(client, run)
    return len(runs)


async def aread_harvest_run(flow_run_id: str | UUID) -> RunStatus:
    async with get_client() as client:
        return run_status(await client.read_flow_run(UUID(str(flow_run_id))))


READ_PAGE = 200
"""Runs read per request: the Prefect server's page limit."""


async def aread_harvest_runs(flow_run_ids: list[str]) -> dict[str, RunStatus]:
    """Many runs' statuses, one request per page of `READ_PAGE` (the API's watcher reads every
    active run at once); runs Prefect does not know are left out."""
    found: dict[str, RunStatus] = {}
    async with get_client() as client:
        for start in range(0, len(flow_run_ids), READ_PAGE):
            page = [UUID(str(r)) for r in flow_run_ids[start:start + READ_PAGE]]
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=page)), limit=READ_PAGE)
            found.update((str(run.id), run_status(run)) for run in runs)
    return found


async def areschedule_harvest_run(flow_run_id: str | UUID) -> None:
    """A crashed run (its host died) back to Scheduled: any worker of its pool picks it up, and
    the same flow run resumes, skipping the shards already written and verified."""
    async with get_client() as client:
        await client.set_flow_run_state(
            UUID(str(flow_run_id)),
            AwaitingRetry(message="Its host died; rescheduled to resume on another host of the lane."),
            force=True,
        )


def start_harvest_run(
    job_id: str, request_url: str, model: str, lane: str, key_id: str, *, lane_config: Lane | None = None,
    key_queues: KeyQueues | None = None, workers: int | None = None, env: dict[str, str] | None = None,
) -> str:
    return run_coro_as_sync(astart_harvest_run(job_id, request_url, model, lane, key_id, lane_config=lane_config,
                                               key_queues=key_queues, workers=workers, env=env))


def cancel_harvest_run(flow_run_id: str | UUID) -> str:
    return run_coro_as_sync(acancel_harvest_run(flow_run_id))


def cancel_job_runs(job_id: str) -> int:
    return run_coro_as_sync(acancel_job_runs(job_id))


def read_harvest_run(flow_run_id: str | UUID) -> RunStatus:
    return run_coro_as_sync(aread_harvest_run(flow_run_id))


def read_harvest_runs(flow_run_ids: list[str]) -> dict[str, RunStatus]:
    return run_coro_as_sync(aread_harvest_runs(flow_run_ids))


def reschedule_harvest_run(flow_run_id: str | UUID) -> None:
    run_coro_as_sync(areschedule_harvest_run(flow_run_id))
