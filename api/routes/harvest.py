"""The bulk harvest routes: submit, read (with long-poll), cancel, list.

The route is a thin facade: take a place in the replica's admission budget (`api.admission`)
before reading the body, have a child process parse it and learn what the job costs
(`api.admission_process`), cheapest facts first (`harvest.cost`: refused with a 400 before any tokenizer runs when the prompts'
characters already say it is too big), admit under the caps (job store), write the request
next to the job's files, start the lane's run (run store), and answer the harvest object.
Status changes come from the watcher. The reads' blocking calls run in their key's turn of the
replica (`api.fairshare`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api.admission import Admission, declared_bytes, read_body_within
from api.auth import ApiKey
from api.deps import MAX_BODY_BYTES, AppSettings, Files, JobWatcher, Links, Models, Runs, Store
from api.idempotency import HEADER as IDEMPOTENCY_HEADER
from api.idempotency import submit_once
from api.openapi import KEYED, errors, request_body
from api.ratelimit import ReadKey, ReadShare, SubmitKey
from api.runs import RunStore
from api.schemas import Harvest, HarvestList, render
from api.settings import ApiSettings
from api.store import admit, attach_run, cancel_job, fail_job, get_job, list_jobs, run_stopped
from api.watcher import Watcher
from harvest.errors import ModelUnavailable
from harvest.jobfiles import JobFiles
from harvest.lanes import load_lanes
from harvest.request import HarvestRequest
from harvest.storage import Storage

__all__ = ["router"]

TERMINAL = ("done", "failed", "cancelled")
# A waiter re-reads its job at least this often, so a change announced while this replica's
# LISTEN connection was being re-opened still answers (`api.notify`).
REREAD_S = 5.0
# When a client may try again after a run start gave up (Prefect overloaded or away).
START_RETRY_AFTER_S = 5

log = logging.getLogger("harvest.api")

router = APIRouter(prefix="/v1", tags=["harvest"])


def _submit(
    key: ApiKey, request: HarvestRequest, job: dict, storage: Storage, runs: RunStore, settings: ApiSettings, engine: Engine,
) -> dict:
    """Admit the prepared job under the caps (in the job store of `engine`), write its request,
    start its run."""
    quota = settings.storage_quota_bytes if key.storage_quota is None else key.storage_quota
    admit(key, job, declared=load_lanes(settings)[job["lane"]], storage_quota=quota,
          retention_days=settings.retention_days, engine=engine)
    try:
        # The request goes to storage (never into Prefect parameters), then the run starts. It
        # names the layers admission resolved ("quartiles", a default), so the run captures
        # exactly the layers the job was admitted and charged for, and says; its bytes are the
        # ones admission counted against the storage quota (`api.admission_process.assess`).
        JobFiles.for_job(job["id"], storage).write_request(request.model_copy(update={"layers": job["layers"]}))
        run_id = runs.start(job["id"], job["request_url"], job["model"], job["lane"], key.id)
    except Exception as exc:
        # The backend may have created the run before failing (an answer lost on the way
        # back): the job is failed and charged nothing, and its runs are cancelled by the job's
        # tag, here or, if the backend is away, by the watcher (`stop_run`).
        log.error("job %s: its run could not be started", job["id"], exc_info=exc)
        fail_job(job["id"], "The harvest could not be started; it was charged nothing. Submit it again.", stop_run=True,
                 engine=engine)
        _stop_runs(job["id"], runs, engine)
        unavailable = ModelUnavailable(
            f"The harvest app for {job['model']} is not reachable right now. Job {job['id']} was recorded as failed "
            "and charged nothing; show us this id if it persists."
        )
        unavailable.headers["Retry-After"] = str(START_RETRY_AFTER_S)  # the start gave up within its bound
        raise unavailable from exc
    attach_run(job["id"], run_id, engine)
    row = get_job(job["id"], engine=engine)
    if row["status"] == "cancelled":  # cancelled while its run was starting
        runs.cancel(run_id)
    return row


def _stop_runs(job_id: str, runs: RunStore, engine: Engine) -> None:
    try:
        runs.cancel_job(job_id)
    except Exception:  # the watcher tries again (`stop_run` stays set)
        log.warning("job %s: could not cancel its runs yet; the watcher will", job_id, exc_info=True)
    else:
        run_stopped(job_id, engine)


_FOLLOW = {
    202: {
        "description": "The harvest, pending.",
        # Where a client (or a fuzzer's stateful phase) goes next with the job id it got.
        "links": {
            "readHarvest": {"operationId": "readHarvest", "parameters": {"job_id": "$response.body#/job_id"}},
            "cancelHarvest": {"operationId": "cancelHarvest", "parameters": {"job_id": "$response.body#/job_id"}},
        },
    }
}


@router.post(
    "/harvest",
    status_code=202,
    response_model=Harvest,
    operation_id="submitHarvest",
    responses={**_FOLLOW, **errors(400, 401, 408, 409, 429, 503)},
    openapi_extra=request_body(HarvestRequest),
)
async def submit_harvest(
    request: Request, budget: Admission, registry: Models, storage: Files, runs: Runs, watcher: JobWatcher,
    links: Links, settings: AppSettings, store: Store, key: SubmitKey,
):
    """Submit a harvest: 202 with the harvest object, status pending."""
    async with budget.hold(key.id, declared_bytes(request, MAX_BODY_BYTES)):
        body = await read_body_within(request, settings.admission_read_s)
        async with budget.work():
            # Parsed and counted by one of the budget's child processes: seconds of CPU for a
            # large body, never the event loop's, and on a busy host not the replica's share.
            harvest_request, fields = await budget.assess(body, registry)
            del body  # the parsed prompts are all that is kept
        job_id = str(uuid.uuid4())
        job = {"id": job_id, "request_url": JobFiles.for_job(job_id, storage).request_url, **fields}
        # With an Idempotency-Key, a repeat of the same request answers the job it made first.
        idempotency_key = request.headers.get(IDEMPOTENCY_HEADER)
        row = await run_in_threadpool(
            partial(submit_once, engine=store.db, window_s=settings.idempotency_window_s),
            key.id, idempotency_key, harvest_request,
            lambda: _submit(key, harvest_request, job, storage, runs, settings, store.db),
        )
    watcher.kick(row.get("flow_run_id"))  # read its run at once, not when the watcher's re-read comes round
    return JSONResponse(render(row, storage, links), status_code=202)


@router.get(
    "/harvest/{job_id}", response_model=Harvest, operation_id="readHarvest",
    responses=errors(400, 401, 404, 429), openapi_extra=KEYED,
)
async def read_harvest(
    job_id: str,
    storage: Files,
    watcher: JobWatcher,
    links: Links,
    store: Store,
    share: ReadShare,
    key: ReadKey,
    wait: Annotated[float, Query(ge=0, le=60, description="Seconds to hold the request until the status changes.")] = 0,
):
    """Read a harvest; with `wait`, answer when its status changes or after `wait` seconds."""
    row = await share.run(get_job, job_id, key.id, engine=store.db)
    headers: dict[str, str] = {}
    status = row["status"]
    if wait > 0 and status not in TERMINAL:
        if not watcher.try_enter(key.id):
            headers = {"X-Acs-Longpoll": "declined", "Retry-After": "3"}
        else:
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + wait
                # Waiting is not work: the key's waiters have their share of the watcher instead.
                with share.aside(), watcher.subscription(job_id) as changed:
                    row = await share.run(get_job, job_id, key.id, engine=store.db)  # after subscribing: nothing slips by
                    while row["status"] == status and (remaining := deadline - loop.time()) > 0:
                        try:
                            await asyncio.wait_for(changed.wait(), min(remaining, REREAD_S))
                        except asyncio.TimeoutError:
                            pass
                        changed.clear()
                        row = await share.run(get_job, job_id, key.id, engine=store.db)
            finally:
                watcher.leave(key.id)
    # The row was read under this key: only then may the replica's signed links be reused.
    body = await share.run(render, row, storage, links, check_files=True, reuse=True)
    return JSONResponse(body, headers=headers)


def _cancel(job_id: str, key: ApiKey, watcher: Watcher, runs: RunStore, engine: Engine) -> dict:
    row = get_job(job_id, key.id, engine=engine)
    if row["status"] in ("pending", "running"):
        try:
            watcher.refresh(row)  # charge by what the run is doing now, not a tick ago
        except Exception:
            pass  # the backend is away: decide by what the store knows
    row, cancelled_now = cancel_job(job_id, key.id, engine)
    if cancelled_now and row["flow_run_id"]:
        try:
            runs.cancel(row["flow_run_id"])
        except Exception:  # the job is cancelled and charged; Prefect finishes a cancel whose host is gone
            log.exception("could not stop run %s of cancelled job %s", row["flow_run_id"], job_id)
    if cancelled_now:
        # What it left counts from now on: measured at once if its run is over (one that had not
        # started is Cancelled outright), else its admitted bytes until the watcher measures it.
        try:
            watcher.settle([row])
        except Exception:  # the backend is away: the watcher's ticks measure it
            log.warning("job %s: its files could not be measured yet; the watcher will", job_id, exc_info=True)
    return row


@router.delete(
    "/harvest/{job_id}", response_model=Harvest, operation_id="cancelHarvest",
    responses=errors(401, 404, 409, 429), openapi_extra=KEYED,
)
async def cancel_harvest(
    job_id: str, storage: Files, runs: Runs, watcher: JobWatcher, links: Links, store: Store, share: ReadShare,
    key: ReadKey,
):
    """Cancel a pending or running harvest (200 with it); done or failed → 409."""
    row = await share.run(_cancel, job_id, key, watcher, runs, store.db)
    return JSONResponse(render(row, storage, links))


@router.get(
    "/harvest", response_model=HarvestList, operation_id="listHarvests",
    responses=errors(400, 401, 404, 429), openapi_extra=KEYED,
)
async def list_harvests(
    storage: Files,
    store: Store,
    share: ReadShare,
    key: ReadKey,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs per page.")] = 20,
    after: Annotated[str | None, Query(description="The last job_id of the previous page.")] = None,
):
    """The caller's harvests, newest first, `limit` per page (page on with `after`); without
    download links (read a job for its links)."""
    page = await share.run(_list_page, key.id, limit, after, storage, store.db)
    return JSONResponse(page)


def _list_page(key_id: str, limit: int, after: str | None, storage: Storage, engine: Engine) -> dict:
    """One page of the list, built in a worker thread: no links are signed for it (a page of
    done jobs could otherwise need 100 × 4,096 signatures), so its cost is one query and
    `limit` small objects."""
    rows, has_more = list_jobs(key_id, limit=limit, after=after, engine=engine)
    data = [render(r, storage, None) for r in rows]
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["job_id"] if data else None,
        "last_id": data[-1]["job_id"] if data else None,
    }
