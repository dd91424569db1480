"""The one mapping from a Prefect flow run to what a job shows: `run_status(run) -> RunStatus`.

The API (its watcher, its job store), the tests and the benches all read runs through it, so a
Prefect state means the same job status everywhere:

    Scheduled / Pending / Paused   pending (running once it has run: a retry waiting its turn)
    Running                        running
    Completed                      done
    Failed, Crashed                failed (Crashed also sets `crashed`: its host died, and the
                                   API's watcher reschedules it)
    Cancelling, Cancelled          cancelled

A run also says how far its job got: `SHARDS_DONE_LABEL`, a label of the job's own flow run
that the run raises as each shard lands (`flows.progress.RunProgress.report`), announcing each
rise with a `PROGRESS_EVENT` naming the run. The API's watcher reads it with the run's state
(`RunStatus.shards_done`), so progress costs it no storage listing, and the runs, which hold no
job-store credentials, write nothing but Prefect.

Light on purpose: importing it imports nothing of Prefect (the mapping reads the state types
when it first runs), so the API's modules that only name a run's status stay quick to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

__all__ = [
    "RunStatus", "FAILED_MESSAGE", "SHARDS_DONE_LABEL", "PROGRESS_EVENT", "run_status", "job_status", "run_started_at",
    "shards_reported",
]

FAILED_MESSAGE = "The harvest run failed."
"""A failed run's message when Prefect's state carries none."""
SHARDS_DONE_LABEL = "harvest.shards_done"
"""Label of a job's own flow run: the job's shards written and recorded so far (a decimal)."""
PROGRESS_EVENT = "harvest.run.progress"
"""Event a job's run emits after raising its `SHARDS_DONE_LABEL` (resource: the flow run)."""


@dataclass(frozen=True)
class RunStatus:
    """A flow run as a job sees it."""

    status: str
    """pending | running | done | failed | cancelled."""
    message: str | None = None
    """Why it failed (or was cancelled); None otherwise."""
    started_at: datetime | None = None
    """When the run first started running (aware UTC), or None if it never did."""
    crashed: bool = False
    """Its host died under it (Prefect's Crashed; `status` failed): the watcher reschedules it."""
    flow_run_id: str = ""
    state_name: str = ""
    """Prefect's own state name (Late, AwaitingRetry, Crashed…), for logs and operators."""
    ended_at: datetime | None = None
    run_count: int = 0
    shards_done: int | None = None
    """The job's shards recorded so far, as its run last reported them (`SHARDS_DONE_LABEL`);
    None while it has reported none (not started, or a run of an earlier release)."""


def job_status(run: FlowRun) -> str:
    from prefect.client.schemas.objects import StateType

    kind = run.state.type if run.state else StateType.SCHEDULED
    if kind in (StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED):
        return "running" if run.run_count > 0 else "pending"
    return {
        StateType.RUNNING: "running",
        StateType.COMPLETED: "done",
        StateType.FAILED: "failed",
        StateType.CRASHED: "failed",
        StateType.CANCELLING: "cancelled",
        StateType.CANCELLED: "cancelled",
    }[kind]


def run_started_at(run: FlowRun) -> datetime | None:
    """When the run first entered RUNNING, or None if it never did.

    Not `run.start_time` alone: Prefect also stamps a start time on a run cancelled while
    still Scheduled, which would make a job cancelled before its GPU run look started.
    """
    return run.start_time if run.run_count > 0 else None


def shards_reported(labels: dict | None) -> int | None:
    """The run's `SHARDS_DONE_LABEL` as a count; None when absent or not a count."""
    value = (labels or {}).get(SHARDS_DONE_LABEL)
    try:
        return max(0, int(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


def run_status(run: FlowRun) -> RunStatus:
    from prefect.client.schemas.objects import StateType

    status = job_status(run)
    message = run.state.message if run.state and status in ("failed", "cancelled") else None
    return RunStatus(
        status=status,
        message=message or (FAILED_MESSAGE if status == "failed" else None),
        started_at=run_started_at(run),
        crashed=run.state is not None and run.state.type == StateType.CRASHED,
        flow_run_id=str(run.id),
        state_name=run.state.name if run.state else "Scheduled",
        ended_at=run.end_time,
        run_count=run.run_count,
        shards_done=shards_reported(run.labels),
    )
