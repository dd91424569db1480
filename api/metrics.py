"""An API replica's `/metrics`: its requests, the job store's jobs, its processes' memory.

- `RequestMetrics` (outermost ASGI middleware) counts every answer by method, route *template*
  (`/v1/harvest/{job_id}`, never the raw path: one series per route, not per job) and status,
  with its latency until the last byte; a path no route serves counts as `unmatched`.
- `JobCounts` reads the job store at scrape time: jobs by lane and status, and the queue
  depth per lane (jobs admitted whose run has not started). Every replica reports the same
  store, so dashboards take `max` over replicas, never `sum`.
- `LongPolls` reads the replica's watcher at scrape time: the `?wait=` reads it holds open and
  the slots it has for them (HARVEST_LONGPOLL_MAX_WAITERS); waiters that meet the slots mean
  clients are being declined. Each replica has its own: dashboards `sum` over replicas.
- Memory of the replica and its children by kind (`replica_processes`): the replica, its
  assessing children (`api.admission_process`), its inline engines
  (`api.inline_process`), the bounds README "Memory of each process" names.
- Engine loads of its inline engines, counted in those children, reach this `/metrics` when
  the replica runs with a counts directory (`harvest api` gives it one:
  `harvest.metrics_export`); without one (a test's bare uvicorn) it shows its own process's counts.

`GET /metrics` answers only the metrics token (`Authorization: Bearer <HARVEST_METRICS_TOKEN>`,
`harvest.metrics_export.metrics_token`); anything else is 401, researchers' API keys included.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.db import jobs, reading
from api.errors import Unauthorized
from harvest.lanes import load_lanes
from harvest.settings import Settings
from harvest.metrics import HTTP_REQUESTS, HTTP_SECONDS, JOBS, LONGPOLL_SLOTS, LONGPOLL_WAITERS, MULTIPROC_ENV, QUEUE_DEPTH
from harvest.metrics_export import authorized, exposition, host_registry, metrics_token, process_tree

__all__ = ["RequestMetrics", "JobCounts", "LongPolls", "ReplicaMetrics", "replica_processes", "router", "STATUSES"]

STATUSES = ("pending", "running", "done", "failed", "cancelled")
UNMATCHED = "unmatched"

router = APIRouter()


class RequestMetrics:
    """Pure ASGI middleware: `harvest_http_requests_total` and
    `harvest_http_request_duration_seconds` for every HTTP answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes every handler is answered 500 outside us

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            # The router put the matched route into the scope (FastAPI's `scope["route"]`).
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            HTTP_REQUESTS.labels(scope["method"], route, str(status)).inc()
            HTTP_SECONDS.labels(scope["method"], route).observe(time.perf_counter() - started)


class JobCounts:
    """`harvest_jobs{lane,status}` and `harvest_queue_depth{lane}` from the job store, one
    grouped count per scrape (on the app's job store: `engine`); every declared lane and status
    is reported, 0 included."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings  # its lanes file, re-read when it changes

    def collect(self):
        counts: dict[tuple[str, str], int] = {}
        with reading(self.engine) as conn:
            query = select(jobs.c.lane, jobs.c.status, func.count()).group_by(jobs.c.lane, jobs.c.status)
            for lane, status, n in conn.execute(query):
                counts[(lane, status)] = n
        lanes = sorted(set(load_lanes(self.settings)) | {lane for lane, _ in counts})
        by_status = GaugeMetricFamily(JOBS, "Jobs in the job store by lane and status.", labels=["lane", "status"])
        queued = GaugeMetricFamily(QUEUE_DEPTH, "Jobs admitted whose run has not started yet (pending), by lane.", labels=["lane"])
        for lane in lanes:
            for status in sorted(set(STATUSES) | {s for (l, s) in counts if l == lane}):
                by_status.add_metric([lane, status], counts.get((lane, status), 0))
            queued.add_metric([lane], counts.get((lane, "pending"), 0))
        yield by_status
        yield queued


class LongPolls:
    """`harvest_longpoll_waiters` and `harvest_longpoll_slots` of this replica, from its
    watcher (`api.watcher`) at scrape time; both 0 before the lifespan has made the watcher."""

    def __init__(self, state):
        self.state = state  # the app's state: the watcher is put there by the lifespan, after this is made

    def collect(self):
        watcher = getattr(self.state, "watcher", None)
        waiting = GaugeMetricFamily(LONGPOLL_WAITERS, "Long-poll (?wait=) reads this replica holds open now.")
        waiting.add_metric([], watcher.waiting if watcher is not None else 0)
        slots = GaugeMetricFamily(LONGPOLL_SLOTS, "Long-poll reads this replica may hold open at once; more are declined.")
        slots.add_metric([], watcher.max_waiters if watcher is not None else 0)
        yield waiting
        yield slots


_CHILD_KINDS = (("api.admission_process", "assessing_child"), ("api.inline_process", "inline_engine"))


def replica_processes():
    """This replica and its children, each with its kind (`harvest_process_*{process}`)."""
    me = psutil.Process()
    for process in process_tree(me):
        if process.pid == me.pid:
            yield "api", process
            continue
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        yield next((kind for module, kind in _CHILD_KINDS if module in command), "other"), process


class ReplicaMetrics:
    """What `/metrics` of this replica serves, and the token it asks for."""

    def __init__(self, registry: CollectorRegistry, token: str):
        self.registry = registry
        self.token = token

    @classmethod
    def from_settings(cls, settings, engine: Engine, state) -> "ReplicaMetrics":
        """`/metrics` with the job counts of the store of `engine` and the long-polls of the
        watcher on `state` (the app's). The counts
        directory is prometheus_client's own variable, set by the role that started this
        replica before anything imported prometheus_client."""
        directory = os.environ.get(MULTIPROC_ENV)
        registry = host_registry(Path(directory) if directory else None, replica_processes, [JobCounts(engine, settings), LongPolls(state)])
        return cls(registry, metrics_token(settings))


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus' text format; the metrics token only (module docstring)."""
    state: ReplicaMetrics = request.app.state.metrics
    if not authorized(request.headers.get("authorization"), state.token):
        raise Unauthorized(
            "/metrics needs the metrics token (HARVEST_METRICS_TOKEN, or the replica's <HARVEST_HOME>/metrics-token) "
            "as 'Authorization: Bearer TOKEN'; API keys do not open it."
        )
    body, content_type = exposition(state.registry)
    return Response(body, media_type=content_type)
