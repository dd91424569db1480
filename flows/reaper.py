"""The reaper: finishes what a dead worker left behind on this host.

Two Prefect behaviours need it (DESIGN, measured on 3.9.1):

- A run being cancelled after its worker died stays CANCELLING for ever: nobody is left to
  kill its process. The reaper kills `infrastructure_pid` and forces the state to Cancelled.
- A run whose worker and flow process died together (a lost machine, an OOM kill of the
  process tree) stays RUNNING for ever. The reaper forces it back to Scheduled
  (`AwaitingRetry`), so any worker of its pool picks it up again; the same flow run id runs
  again and resumes, skipping shards already written and verified. After `max_restarts`
  restarts it is marked Crashed instead.

Process workers record `infrastructure_pid` as `<hostname>:<pid>`, so the reaper can only judge
runs of its own host: run one per machine (`harvest up` does, every few seconds).

    await reap_once()           one pass; returns what it did (the tests call this)
    run_forever(stop_event)     a pass every HARVEST_REAPER_INTERVAL_S (default 5 s)
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timezone

import psutil
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.states import AwaitingRetry, Cancelled, Crashed

__all__ = ["Action", "reap_once", "reap_once_sync", "run_forever", "local_pid"]

POOLS = ("small", "large")


@dataclass(frozen=True)
class Action:
    flow_run_id: str
    name: str
    what: str
    """"cancelled" (stuck CANCELLING), "rescheduled" or "crashed" (lost RUNNING)."""


def local_pid(run: FlowRun) -> int | None:
    """The run's process id if it ran on this host, else None."""
    pid = run.infrastructure_pid
    if not pid:
        return None
    host, _, number = str(pid).rpartition(":")
    if host and host != socket.gethostname():
        return None
    try:
        return int(number)
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _orphaned(pid: int) -> bool:
    """True when the flow process's worker is gone (it was re-parented away from a worker)."""
    try:
        parent = psutil.Process(pid).parent()
        return parent is None or "worker" not in " ".join(parent.cmdline())
    except psutil.NoSuchProcess:
        return True


def _kill(pid: int) -> None:
    """SIGTERM the process (Prefect turns it into a clean stop), SIGKILL after 3 s."""
    try:
        proc = psutil.Process(pid)
        tree = [proc, *proc.children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs([proc], timeout=3)
        for p in tree:
            if p.is_running():
                p.kill()
        psutil.wait_procs(tree, timeout=3)
    except psutil.NoSuchProcess:
        pass


def _age_s(run: FlowRun) -> float:
    stamp = run.state.timestamp if run.state else None
    if stamp is None:
        return 0.0
    return (datetime.now(timezone.utc) - stamp).total_seconds()


async def _runs(client, kinds: list[StateType], pools: tuple[str, ...]) -> list[FlowRun]:
    return await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=kinds))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=list(pools))),
    )


async def reap_once(
    pools: tuple[str, ...] = POOLS, *, stuck_after_s: float | None = None, max_restarts: int | None = None
) -> list[Action]:
    """One pass over this host's runs of `pools`.

    stuck_after_s: a CANCELLING run whose worker is still alive is left to the worker for this
      long (its own grace is 30 s) before the reaper steps in (HARVEST_REAPER_STUCK_S, 45).
    max_restarts: how often a lost RUNNING run is rescheduled before it is marked Crashed
      (HARVEST_REAPER_MAX_RESTARTS, 3).
    """
    stuck_after_s = float(os.environ.get("HARVEST_REAPER_STUCK_S", 45)) if stuck_after_s is None else stuck_after_s
    max_restarts = int(os.environ.get("HARVEST_REAPER_MAX_RESTARTS", 3)) if max_restarts is None else max_restarts
    actions: list[Action] = []
    async with get_client() as client:
        for run in await _runs(client, [StateType.CANCELLING], pools):
            pid = local_pid(run)
            if pid is None and run.infrastructure_pid:
                continue  # another host's run: its own reaper decides
            if pid is not None and _alive(pid) and not _orphaned(pid) and _age_s(run) < stuck_after_s:
                continue  # its worker is on it
            if pid is not None and _alive(pid):
                _kill(pid)
            await client.set_flow_run_state(run.id, Cancelled(message="Cancelled by request."), force=True)
            actions.append(Action(str(run.id), run.name, "cancelled"))

        for run in await _runs(client, [StateType.RUNNING], pools):
            pid = local_pid(run)
            if pid is None or _alive(pid):
                continue
            # Re-read: the process may have ended normally between the listing and now.
            fresh = await client.read_flow_run(run.id)
            if fresh.state is None or fresh.state.type != StateType.RUNNING or fresh.state.id != run.state.id:
                continue
            if fresh.run_count > max_restarts:
                await client.set_flow_run_state(
                    run.id, Crashed(message=f"The harvest process died {fresh.run_count} times; giving up."), force=True
                )
                actions.append(Action(str(run.id), run.name, "crashed"))
                continue
            await client.set_flow_run_state(
                run.id,
                AwaitingRetry(message="Its worker died; rescheduled to resume on another worker."),
                force=True,
            )
            actions.append(Action(str(run.id), run.name, "rescheduled"))
    return actions


def reap_once_sync(**kwargs) -> list[Action]:
    return asyncio.run(reap_once(**kwargs))


def run_forever(stop: threading.Event, pools: tuple[str, ...] = POOLS, log=print, api_url: str | None = None) -> None:
    """Reap every HARVEST_REAPER_INTERVAL_S seconds until `stop` is set (a thread of `harvest up`).

    api_url: the Prefect API (default: PREFECT_API_URL); given explicitly because Prefect's
    settings context does not follow into a new thread.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    interval = float(os.environ.get("HARVEST_REAPER_INTERVAL_S", 5))
    while not stop.wait(interval):
        try:
            with temporary_settings({PREFECT_API_URL: api_url} if api_url else {}):
                actions = asyncio.run(reap_once(pools))
            for action in actions:
                log(f"reaper: {action.what} flow run {action.name} ({action.flow_run_id})")
        except Exception as exc:  # the server may be restarting; try again next round
            log(f"reaper: pass failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    run_forever(threading.Event())
