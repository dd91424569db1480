"""What the service counts for Prometheus: every metric it exports, named here and nowhere else.

The objects below are updated where the thing happens (a shard's forward pass and its write in
`harvest.pipeline`, an engine load in `harvest.engines.choice`, a flow run's start in
`flows.harvest`, a request in `api.metrics`); the figures read at scrape time (the job store's
jobs, each process's memory) are computed by their exporters under the names declared here.
A role's `/metrics` reads them all (`harvest.metrics_export`; RUNBOOK "Metrics" has the table).

Why prometheus_client's multiprocess mode: the work happens in processes that no scrape can
reach. A worker host's flow runs are forked from its run starter, one short-lived process per
job, and its engine servers are detached processes that outlive them; the API's inline
engines and assessing children are processes of their own too. Each role gives its process tree
one directory (`PROMETHEUS_MULTIPROC_DIR`, set before any of them imports prometheus_client,
which picks its value class at import); every process then writes its counters to its own
memory-mapped file there (no lock across processes, no socket, nothing lost when a run exits
before a scrape), and the role's exporter sums the files. Without the variable (a test's
in-process app, `harvest run`) the same objects count in memory, in the default registry.
The alternatives were worse: a push gateway keeps a dead run's last value for ever and is one
more service; a socket to the exporter loses what a run counted while the exporter restarts.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = [
    "MULTIPROC_ENV",
    "HTTP_REQUESTS",
    "HTTP_SECONDS",
    "TOKENS",
    "FORWARD_SECONDS",
    "SHARD_BYTES",
    "RUN_START_SECONDS",
    "ENGINE_LOADS",
    "WATCHER_TICK_SECONDS",
    "WATCHER_LEASE_RENEWALS",
    "ENGINE_LOAD_SECONDS",
    "JOBS",
    "QUEUE_DEPTH",
    "PROCESS_RESIDENT_BYTES",
    "PROCESS_MAX_RESIDENT_BYTES",
    "PROCESSES",
    "count_forward",
    "count_shard_written",
    "observe_engine_load",
]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's variable: the directory a role's processes write their counts to."""

# Seconds: from a millisecond read to a 60 s long-poll (`?wait=60`) and a streamed completion.
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Seconds: a forked run starts in well under a second; a worker's poll adds up to its interval;
# a lane with no free slot queues for minutes.
_START_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600)
# Seconds: llama-tiny loads in ~0.5 s; an 8B model from local disk in tens of seconds; 405B in minutes.
_LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

HTTP_REQUESTS = Counter(
    "harvest_http_requests", "API requests answered, by method, route template and status.",
    ["method", "route", "status"],
)
HTTP_SECONDS = Histogram(
    "harvest_http_request_duration_seconds",
    "API request latency until the response's last byte (long-polls and streamed completions included), by method and route template.",
    ["method", "route"], buckets=_REQUEST_BUCKETS,
)
TOKENS = Counter(
    "harvest_tokens", "Prompt tokens run through forward passes (filler not counted), by lane.", ["lane"],
)
FORWARD_SECONDS = Counter(
    "harvest_forward_seconds", "Seconds spent in shards' forward passes, by lane.", ["lane"],
)
SHARD_BYTES = Counter(
    "harvest_shard_bytes_written", "Bytes of shard files published to storage, by lane.", ["lane"],
)
RUN_START_SECONDS = Histogram(
    "harvest_run_start_seconds",
    "Seconds from a flow run's scheduled start (its creation by the API, or its rescheduling) to its flow code running on a worker host, by lane.",
    ["lane"], buckets=_START_BUCKETS,
)
# Seconds: a tick reads one page of runs and the runs events named: milliseconds when idle; it
# must stay well under the watcher lease's TTL (5 s), which its own thread renews.
_TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WATCHER_TICK_SECONDS = Histogram(
    "harvest_watcher_tick_seconds",
    "Seconds each tick of the API's watcher took (`api.watcher`, on the API process holding its lease): its cost stays flat as jobs grow.",
    buckets=_TICK_BUCKETS,
)
WATCHER_LEASE_RENEWALS = Counter(
    "harvest_watcher_lease_renewals",
    "The watcher lease's renewal attempts of this API process, by outcome: held (taken or renewed), "
    "elsewhere (another API process holds it), lost (this one held it and no longer does), error (the job store did not answer).",
    ["outcome"],
)
ENGINE_LOADS = Counter(
    "harvest_engine_loads", "Engine loads (a model loaded into an engine server, inline engine or one-off run), by lane, model and engine.",
    ["lane", "model", "engine"],
)
ENGINE_LOAD_SECONDS = Histogram(
    "harvest_engine_load_seconds", "Seconds an engine load took, by lane, model and engine.",
    ["lane", "model", "engine"], buckets=_LOAD_BUCKETS,
)

# Read at scrape time by their exporters (no object holds them between scrapes).
JOBS = "harvest_jobs"
"""Gauge {lane, status}: jobs in the job store (pending, running, done, failed, cancelled);
every API process reports the same store."""
QUEUE_DEPTH = "harvest_queue_depth"
"""Gauge {lane}: jobs admitted whose run has not started yet (status pending)."""
LONGPOLL_WAITERS = "harvest_longpoll_waiters"
"""Gauge: the `?wait=` reads one API process holds open now."""
LONGPOLL_SLOTS = "harvest_longpoll_slots"
"""Gauge: the `?wait=` reads one API process may hold open at once; past it they are declined."""
PROCESS_RESIDENT_BYTES = "harvest_process_resident_bytes"
"""Gauge {process}: resident memory summed over a host's processes of one kind."""
PROCESS_MAX_RESIDENT_BYTES = "harvest_process_max_resident_bytes"
"""Gauge {process}: the largest resident memory of one process of that kind (what the
README's per-process bounds are about)."""
PROCESSES = "harvest_processes"
"""Gauge {process}: how many processes of that kind the host runs now."""


def count_forward(lane: str, tokens: int, seconds: float) -> None:
    """One shard's forward passes: its prompts' tokens and the time they took."""
    TOKENS.labels(lane).inc(tokens)
    FORWARD_SECONDS.labels(lane).inc(seconds)


def count_shard_written(lane: str, size: int) -> None:
    """One shard file published (its size as stored)."""
    SHARD_BYTES.labels(lane).inc(size)


def observe_engine_load(lane: str, model: str, engine: str, seconds: float) -> None:
    ENGINE_LOADS.labels(lane, model, engine).inc()
    ENGINE_LOAD_SECONDS.labels(lane, model, engine).observe(seconds)
