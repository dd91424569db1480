"""Placement, the Prefect side: what a lane's hosts can take, and where a run landed.

The domain (slot tables, claims, warm slots first, a run's placement, the policy's arithmetic)
is `harvest.placement`; here only what reads or writes Prefect:

- `publish_host` / `forget_host`: `harvest worker` records its slot count in a Prefect Variable
  (`host_variable`), because Prefect's server keeps no per-worker metadata and a parent run must
  add up the slots of its lane's online hosts. A worker without one (a bare `prefect worker`)
  counts as one slot; a worker whose heartbeats stopped (OFFLINE) counts as none.
- `lane_free_slots`: free = min(pool limit, Σ slots of ONLINE workers) − runs of the pool that
  hold or wait for a slot (Pending, Running, Cancelling, and Scheduled runs already due); for a
  run of a key's work queue (`flows.key_queues`), at most that queue's limit − its runs counted
  the same way, since the run's helpers wait in that queue.
- `choose_workers`: the automatic scale-out policy of the `harvest` flow (its docstring says
  it); an explicit `workers` wins, and a rescheduled run keeps the count it chose the first
  time (its `harvest.workers` label), so it re-attaches to the same helpers.
"""

from __future__ import annotations

import hashlib
import re
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterNextScheduledStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterWorkQueueName,
    WorkerFilter,
    WorkerFilterStatus,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from flows.key_queues import KEY_QUEUE_PREFIX
from harvest.placement import auto_workers, free_slots
from harvest.settings import Settings

__all__ = [
    "WORKERS_LABEL",
    "LaneCapacity",
    "host_variable",
    "publish_host",
    "forget_host",
    "lane_free_slots",
    "choose_workers",
]

WORKERS_LABEL = "harvest.workers"
_HOLDING = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]


def host_variable(pool: str, worker: str) -> str:
    """The Prefect Variable holding this worker's slots (names allow only [a-z0-9_-])."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", f"{pool}-{worker}".lower()).strip("-")[:200]
    return f"harvest-host-{slug}-{hashlib.sha1(f'{pool}/{worker}'.encode()).hexdigest()[:8]}"


def _client_for(api_url: str | None):
    """Prefect settings pointing at `api_url` (None: the ambient PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: api_url}) if api_url else nullcontext()


def publish_host(pool: str, worker: str, table: list[list[str]], api_url: str | None = None) -> None:
    """Record (create or replace) how many slots `worker` gives `pool`."""
    value = {"pool": pool, "worker": worker, "slots": len(table), "gpus": [",".join(d) for d in table]}
    name = host_variable(pool, worker)
    with _client_for(api_url), get_client(sync_client=True) as client:
        try:
            client.create_variable(VariableCreate(name=name, value=value, tags=["harvest-host", f"lane:{pool}"]))
        except ObjectAlreadyExists:
            client.update_variable(VariableUpdate(name=name, value=value))


def forget_host(pool: str, worker: str, api_url: str | None = None) -> None:
    """Remove the record (a host leaving; an OFFLINE worker is not counted anyway)."""
    with _client_for(api_url), get_client(sync_client=True) as client:
        try:
            client.delete_variable_by_name(host_variable(pool, worker))
        except ObjectNotFound:
            pass


@dataclass(frozen=True)
class LaneCapacity:
    pool_limit: int | None
    slots_per_host: list[int]
    """One entry per ONLINE worker of the pool."""
    busy: int
    """Runs holding a slot or waiting for one, the caller's own included."""
    free: int
    key_queue_free: int | None = None
    """What the caller's key queue leaves (already counted in `free`); None: no key limit."""

    def describe(self) -> str:
        limit = "no limit" if self.pool_limit is None else f"limit {self.pool_limit}"
        key = "" if self.key_queue_free is None else f", {self.key_queue_free} left to this key"
        return f"{self.free} free of {sum(self.slots_per_host)} slots on {len(self.slots_per_host)} online hosts ({limit}), {self.busy} busy{key}"


def _count(client, pool: str, state: FlowRunFilterState, **flow_run_filter) -> int:
    return client.count_flow_runs(
        flow_run_filter=FlowRunFilter(state=state, **flow_run_filter),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
    )


def _busy(client, pool: str, **flow_run_filter) -> int:
    """Runs of `pool` (narrowed by `flow_run_filter`) holding a slot or due to take one."""
    busy = _count(client, pool, FlowRunFilterState(type=FlowRunFilterStateType(any_=_HOLDING)), **flow_run_filter)
    return busy + _count(
        client, pool, FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
        next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=datetime.now(timezone.utc)), **flow_run_filter,
    )


def lane_free_slots(client, pool: str, queue: str | None = None) -> LaneCapacity:
    """What the lane (work pool `pool`) could start now without anyone waiting: one look.
    queue: the caller's work queue; a key queue's limit bounds what is free too."""
    limit = client.read_work_pool(pool).concurrency_limit
    online = client.read_workers_for_work_pool(pool, worker_filter=WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"])))
    per_host = []
    for worker in online:
        variable = client.read_variable_by_name(host_variable(pool, worker.name))
        slots = variable.value.get("slots") if variable is not None and isinstance(variable.value, dict) else None
        per_host.append(slots if isinstance(slots, int) and slots > 0 else 1)
    busy = _busy(client, pool)
    free = free_slots(limit, per_host, busy)
    key_free = None
    if queue is not None and queue.startswith(KEY_QUEUE_PREFIX):
        key_limit = client.read_work_queue_by_name(queue, work_pool_name=pool).concurrency_limit
        if key_limit is not None:
            key_free = max(0, key_limit - _busy(client, pool, work_queue_name=FlowRunFilterWorkQueueName(any_=[queue])))
            free = min(free, key_free)
    return LaneCapacity(limit, per_host, busy, free, key_free)


def choose_workers(
    explicit: int | None, pool: str, n_shards: int, settings: Settings, client, previous: str | None = None, log=None,
    queue: str | None = None,
) -> int:
    """How many flow runs share a job of `n_shards` on `pool` (the harvest flow's docstring
    gives the policy). previous: the count this run chose before it was rescheduled, if any;
    queue: the calling run's work queue (its key's limit bounds the helpers too)."""
    say = log or (lambda *a: None)
    if explicit is not None:
        return max(1, explicit)
    if previous is not None:
        say("keeping the %s runs chosen before this run was rescheduled", previous)
        return max(1, int(previous))
    if n_shards // settings.scale_out_min_shards < 2:
        return 1  # too small to share, whatever is free: no need to ask Prefect
    try:
        capacity = lane_free_slots(client, pool, queue)
    except Exception as exc:  # an unreadable lane must not fail a job: run it alone
        say("could not read work pool %s (%s: %s); running alone", pool, type(exc).__name__, exc)
        return 1
    n = auto_workers(n_shards, capacity.free, settings.scale_out_min_shards)
    say("automatic scale-out over %d runs: %d shards; pool %s: %s", n, n_shards, pool, capacity.describe())
    return n

