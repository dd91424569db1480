"""The FastAPI app: harvest routes, file links, inline completions and models, one error body.

Every refusal is a `HarvestError` raised anywhere below and turned into
`{"error": {message, type, param, code}}` (plus its headers, e.g. Retry-After) by the one
handler here; pydantic's validation errors become the same 400 naming the field in `param`
(`harvest.errors.invalid_from_pydantic`); an unknown path is 404 `route_not_found`, a method
the path lacks 405 `method_not_allowed` with `Allow`. Anything else is a bug or an outage:
`api.guard` logs it under a request id and answers 500 naming that id (every response
carries `X-Request-ID`). The published OpenAPI document is `api.openapi`'s.
The lifespan migrates the app's job store and runs the single watcher (`api.watcher`).

The app is built by `create_app`, which takes its parts (job store, run store, storage, registry,
inline engines, the per-replica budgets) and builds from the settings whichever it is not given;
routes receive them as typed dependencies (`api.deps`). Tests hand the factory what they swap.

Run it: `python -m api.http_server api.app:create_app --host 127.0.0.1 --port $HARVEST_PORT`
(uvicorn on h11 with the request head bounded: what `harvest api` and `harvest up` run,
`fleet.roles.api_command`).
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.admission import TOKENIZE_ON_CALLER, AdmissionBudget
from api.db import JobStore
from api.errors import MethodNotAllowed, RouteNotFound
from api.fairshare import FairShare
from api.guard import RequestGuard
from api.inline_engines import InlineEngines
from api.lease import Lease, replica_id
from api.links import LinkCache, LinkSigner
from api.metrics import ReplicaMetrics, RequestMetrics
from api.metrics import router as metrics_router
from api.openapi import install as install_openapi
from api.ratelimit import AddressLimiter, EmptyBuckets
from api.responsiveness import respond_quickly
from api.routes.chat import router as chat_router
from api.routes.completions import ResponseBudget
from api.routes.completions import router as completions_router
from api.routes.files import router as files_router
from api.routes.harvest import router as harvest_router
from api.routes.models import router as models_router
from api.runs import PrefectRuns, RunStore
from api.send_timeout import SendTimeout
from api.settings import ApiSettings
from api.watcher import Watcher
from harvest.errors import HarvestError, InvalidRequest, ModelUnavailable, echo, invalid_from_pydantic
from harvest.metrics_export import authorized
from harvest.registry import Registry, load_registry
from harvest.settings import get_settings
from harvest.storage import Storage, open_storage

__all__ = ["create_app", "harvest_error", "RedactLinkQueries"]

log = logging.getLogger("harvest.api")

class RedactLinkQueries(logging.Filter):
    """Drop the query string of file routes from access-log lines: it holds the link's
    signature, and whoever reads the logs must not be able to fetch any job's files."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and args[2].startswith(FILE_ROUTE):
            record.args = (*args[:2], args[2].split("?", 1)[0] + ("?<redacted>" if "?" in args[2] else ""), *args[3:])
        return True


FILE_ROUTE = "/v1/files/"
# uvicorn configures its loggers before it imports this module; the filter joins them.
logging.getLogger("uvicorn.access").addFilter(RedactLinkQueries())

REPLICA = replica_id()
"""This API process's name in the watcher lease (`/health` tells the operator whether it holds it)."""


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings = app.state.settings
    respond_quickly()  # a read's wake-ups preempt bulk work's slices (`api.responsiveness`); before any child starts
    store: JobStore = app.state.store
    await run_in_threadpool(store.migrate)  # before the first request
    watcher = Watcher.from_settings(app.state.runs, app.state.storage, store, settings,
                                    Lease("watcher", REPLICA, settings.watcher_lease_s, store.db))
    app.state.watcher = watcher
    app.state.admission.start()  # its children import while the replica starts (`api.admission_process`)
    await watcher.start()
    try:
        yield
    finally:
        await watcher.stop()
        await run_in_threadpool(app.state.admission.close)


async def harvest_error(request: Request, exc: HarvestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


STORE_RETRY_AFTER_S = 5
"""Seconds a client waits after the job store could not be reached (a PostgreSQL restart or
failover takes a few; `bench/pg_restart.py`)."""


async def store_unreachable(request: Request, exc: OperationalError) -> JSONResponse:
    """The job store's connection failed (its server restarting, failing over, or SQLite
    busy past its timeout): the documented 503 with Retry-After, not a 500. Nothing was
    recorded by the failed statement, so the request can be sent again; a submit with an
    `Idempotency-Key` answers the same job if it had been admitted before."""
    log.warning("job store unreachable for %s %s: %s", request.method, request.url.path, type(exc.orig).__name__)
    unavailable = ModelUnavailable("The job store is not reachable right now; send the request again after Retry-After.")
    unavailable.headers["Retry-After"] = str(STORE_RETRY_AFTER_S)
    return await harvest_error(request, unavailable)


async def store_refused_value(request: Request, exc: DataError) -> JSONResponse:
    """The job store refused a value the request carried (PostgreSQL takes no NUL character in
    text; a number past a column's range): the client's input, so a 400, never a 500. The
    routes keep such values from the store where they can (`api.store`); this is the net."""
    log.warning("job store refused a value for %s %s: %s", request.method, echo(request.url.path, quote=False),
                type(exc.orig).__name__)
    return await harvest_error(request, InvalidRequest(
        "The request holds a value the job store cannot keep (a NUL character, or a number out of range)."))


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await harvest_error(request, invalid_from_pydantic(list(exc.errors())))


def _allowed_methods(request: Request) -> list[str]:
    """The methods the published document gives this path, which are exactly the methods its
    routes serve (FastAPI serves no implicit HEAD); Starlette's own 405 names one route's
    methods only, the wrong ones when several routes share a path. Paths outside the document
    (/health, /openapi.json) are GET only."""
    methods: set[str] = set()
    for template, operations in request.app.openapi()["paths"].items():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), request.url.path):
            methods |= {method.upper() for method in operations}
    return sorted(methods or {"GET"})


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The router's own refusals, in the error body like every other."""
    if exc.status_code == 405:
        error: HarvestError = MethodNotAllowed(
            f"{echo(request.method, quote=False)} is not allowed on {echo(request.url.path, quote=False)}.",
            allow=_allowed_methods(request),
        )
    elif exc.status_code == 404:
        # The path comes back cut to `echo`'s bound: a 60,000-character path is no reason
        # for a 60 KB answer.
        error = RouteNotFound(f"There is no route {echo(request.url.path, quote=False)}. "
                              "The API's routes are under /v1 (see /openapi.json).")
    elif exc.status_code < 500:
        error = InvalidRequest(str(exc.detail))
    else:
        error = HarvestError(str(exc.detail))
    return await harvest_error(request, error)


def create_app(
    *,
    settings: ApiSettings | None = None,
    store: JobStore | None = None,
    runs: RunStore | None = None,
    storage: Storage | None = None,
    registry: Registry | None = None,
    inline_engines: InlineEngines | None = None,
    inline_budget: ResponseBudget | None = None,
    admission: AdmissionBudget | None = None,
    anonymous_limiter: AddressLimiter | None = None,
    fair_share: FairShare | None = None,
    link_cache: LinkCache | None = None,
    link_signer: LinkSigner | None = None,
) -> FastAPI:
    """The API app with these parts; each one not given is built from `settings` (by default
    the process's, from HARVEST_* variables), which the routes read as `api.deps.AppSettings`:

    - `store`: the job store (HARVEST_DATABASE_URL), read by the routes as `api.deps.Store`;
      the lifespan migrates it before the first request;
    - `runs`: the run store (Prefect flow runs on the lanes' deployments);
    - `storage`: the storage root of the job files (HARVEST_STORAGE_URL);
    - `registry`: the served models (HARVEST_MODELS_FILE);
    - `inline_engines`: the inline completions' warm engines (`api.inline_engines.InlineEngines`);
    - `inline_budget`: the bytes of inline responses held at once, and each key's share of them
      (`api.routes.completions.ResponseBudget`); a response not read for `send_timeout_s` is cut
      and its bytes freed (`api.send_timeout`);
    - `admission`: the harvest submits' admission budget (`api.admission`);
    - `anonymous_limiter`: the per-address limit of requests without a valid key (`api.ratelimit`);
    - `fair_share`: each key's share of the replica, in flight and in turn (`api.fairshare`);
    - `link_cache`: the done jobs' links this replica signed, reused a while (`api.links`);
    - `link_signer`: who signs and checks the download links (`api.links.LinkSigner`).
    """
    settings = settings if settings is not None else get_settings(ApiSettings)
    app = FastAPI(
        title="Residual-stream harvesting API",
        version="1.0",
        description="Bulk harvests of residual-stream activations, and inline activations on completions.",
        lifespan=lifespan,
        # A path with a trailing slash (a job id ending in `%2F`) is no route: a 404, not a 307
        # redirect that no client of the SPEC follows and the OpenAPI cannot document.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.store = store if store is not None else JobStore.from_settings(settings)
    app.state.runs = runs if runs is not None else PrefectRuns(settings)
    app.state.storage = storage if storage is not None else open_storage(settings)
    app.state.registry = registry if registry is not None else load_registry(settings)
    # Engines load on a request (or HARVEST_INLINE_PRELOAD's at start-up), not here.
    app.state.inline_engines = (inline_engines if inline_engines is not None
                                 else InlineEngines.in_children(settings))
    if inline_budget is None:
        inline_budget = ResponseBudget.from_settings(settings)
    if admission is None:
        admission = AdmissionBudget.from_settings(settings)
    for name, value in TOKENIZE_ON_CALLER.items():  # no tokenizer pool of one thread per core in the replica
        os.environ.setdefault(name, value)  # either (`api.admission_process`); an operator's own setting is kept
    if anonymous_limiter is None:
        anonymous_limiter = AddressLimiter(settings.rate_anonymous_per_s, settings.rate_anonymous_burst)
    app.state.inline_budget = inline_budget
    app.state.admission = admission
    app.state.anonymous_limiter = anonymous_limiter
    app.state.fair_share = fair_share if fair_share is not None else FairShare.from_settings(settings)
    app.state.link_cache = link_cache if link_cache is not None else LinkCache.from_settings(settings)
    app.state.link_signer = link_signer if link_signer is not None else LinkSigner.from_settings(settings)
    app.state.empty_buckets = EmptyBuckets()  # keys' buckets known empty (`api.ratelimit`)
    app.state.metrics = ReplicaMetrics.from_settings(settings, app.state.store.db, app.state)  # `/metrics` (`api.metrics`)
    app.add_exception_handler(HarvestError, harvest_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(OperationalError, store_unreachable)
    app.add_exception_handler(DataError, store_refused_value)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(RequestGuard)
    app.add_middleware(RequestMetrics)  # counts every answer, the guard's own included
    # Outermost: it finds the connection through the server's own `receive` (`api.send_timeout`).
    app.add_middleware(SendTimeout, timeout_s=settings.send_timeout_s)
    app.include_router(harvest_router)
    app.include_router(files_router)
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(models_router)
    app.include_router(metrics_router)

    @app.get("/health", include_in_schema=False)
    async def health(request: Request) -> dict:
        """Liveness for a load balancer: `{"status": "ok"}` to anyone, researchers' API keys
        included: a tenant learns nothing of the host. The operator, with the metrics token
        (`Authorization: Bearer <HARVEST_METRICS_TOKEN>`, as `/metrics` asks it), also learns
        `replica` (host name and pid) and `watcher` (whether this replica follows Prefect)."""
        if not authorized(request.headers.get("authorization"), request.app.state.metrics.token):
            return {"status": "ok"}
        watcher = getattr(request.app.state, "watcher", None)
        return {"status": "ok", "replica": REPLICA, "watcher": bool(watcher and watcher.lease.holds())}

    install_openapi(app)
    return app
