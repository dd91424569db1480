"""Hosts that die lose nothing: Prefect's own liveness machinery, applied to the lanes' pools.

A flow run whose host dies (power, kernel panic, the OOM killer taking the worker with it)
stays RUNNING in Prefect's database for ever: nobody is left to report on it. A pid table
cannot tell either: a pid means nothing on another host, and is reused on this one. Prefect
3.9.1 has what it takes to tell by itself, across hosts:

- every flow run of a worker host emits a `prefect.flow-run.heartbeat` event every
  `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (`HEARTBEAT_ENV`: a worker passes its own
  environment on to its flow runs);
- "harvest: crash runs whose heartbeats stopped": a run with neither a heartbeat nor an end
  within 2.5 heartbeats of its last one is marked CRASHED;
- "harvest: crash runs whose host never started them": a run still PENDING 3 minutes after a
  worker took it (its host died before the flow process started: no heartbeat to miss) is
  marked CRASHED too;
- "harvest: finish cancels whose host is gone": a run still CANCELLING a minute after the
  cancel is marked CANCELLED. A live host finishes a cancel in ~2 s (30 s at worst, Prefect's
  kill grace); one that is gone never does, and a run may not stay "cancelling" for ever.

The API's watcher reschedules a CRASHED run onto another host of its lane, within the job's
restart budget, where it resumes from its verified shards. No automation reschedules: a run
that crashes for a real bug would loop, so that loop must be bounded, and the watcher bounds it.

All three are Prefect automations, evaluated by the Prefect server (no process of ours has to
stay up for them), applied idempotently by name with the pools and deployments:

    HEARTBEAT_ENV                          the environment of a worker host (heartbeats on)
    await apply_automations(pools)         create or update all three; returns their names
    apply_automations_sync(pools)          the same, synchronous
    automations(pools)                     the three, as Prefect objects (no I/O)

Measured on a real server (tests/test_liveness.py): a run whose host was SIGKILLed is CRASHED
57-70 s after the kill (45-80 s can be: its last heartbeat was 0-30 s before it); a run
cancelled just after its host died is CANCELLED 61-64 s after the cancel; a run still Pending
with no process is CRASHED 181 s after; a 100 s run on a live host completes untouched, and a
cancel on a live host is Cancelled in 0.1 s, by the host.
"""

from __future__ import annotations

from datetime import timedelta

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.utilities.asyncutils import run_coro_as_sync

__all__ = [
    "HEARTBEAT_S",
    "HEARTBEAT_ENV",
    "CRASH_AFTER_S",
    "CANCEL_AFTER_S",
    "PENDING_AFTER_S",
    "CRASH_AUTOMATION",
    "PENDING_AUTOMATION",
    "CANCEL_AUTOMATION",
    "CRASH_MESSAGE",
    "PENDING_MESSAGE",
    "CANCEL_MESSAGE",
    "automations",
    "apply_automations",
    "apply_automations_sync",
]

# Prefect 3.9.1 refuses less: `FlowsSettings.heartbeat_frequency` is validated `ge=30` (a
# smaller value makes every flow run fail to start on a settings error), and the engine clamps
# to MINIMUM_HEARTBEAT_INTERVAL = 30 anyway. The default (180) would make detection take ~8 min.
HEARTBEAT_S = 30
HEARTBEAT_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}

# 2.5 heartbeats: one late or lost heartbeat (a loaded host, a slow event pipeline) never
# crashes a live run, two missed in a row do. A dead host's run is crashed 45-75 s after the
# kill (its last heartbeat was 0-30 s before it) plus the server's evaluation tick.
CRASH_AFTER_S = 75
# A worker sets Pending, then starts the flow-run process, which sets Running once it has
# imported the flow (5-11 s measured here on a loaded CPU box; torch and friends take longer
# on a cold disk). A host that dies in between leaves the run Pending for ever: no process,
# so no heartbeat to miss. Three minutes is far beyond any process start.
PENDING_AFTER_S = 180
# A live host finishes a cancel in ~2 s, or after Prefect's 30 s kill grace at worst;
# twice that is beyond doubt.
CANCEL_AFTER_S = 60

CRASH_AUTOMATION = "harvest: crash runs whose heartbeats stopped"
PENDING_AUTOMATION = "harvest: crash runs whose host never started them"
CANCEL_AUTOMATION = "harvest: finish cancels whose host is gone"
CRASH_MESSAGE = f"Crashed: its host stopped sending heartbeats (none for {CRASH_AFTER_S} s)."
PENDING_MESSAGE = f"Crashed: its host never started it (still Pending after {PENDING_AFTER_S} s)."
CANCEL_MESSAGE = "Cancelled by request; its host was gone."

HEARTBEAT = "prefect.flow-run.heartbeat"
PENDING = "prefect.flow-run.Pending"
RUNNING = "prefect.flow-run.Running"
CANCELLING = "prefect.flow-run.Cancelling"
# States in which no process runs the flow (waiting to start, again): a run there has nothing
# to send heartbeats and no host to lose, so they close a watch as an end does.
PARKED = [
    "prefect.flow-run.Scheduled",
    "prefect.flow-run.AwaitingRetry",
    "prefect.flow-run.AwaitingConcurrencySlot",
    "prefect.flow-run.Late",
    "prefect.flow-run.Paused",
    "prefect.flow-run.Suspended",
]
ENDS = ["prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"]
TAGS = ["harvest", "liveness"]


def automations(pools: list[str]) -> list[AutomationCore]:
    """The three automations for the flow runs of the work pools `pools` (no I/O)."""
    pools = sorted(set(pools))
    # Which runs: those whose events name one of `pools` as their related work pool. State
    # changes get it from the server; heartbeats from the flow-run process itself (the engine
    # builds a heartbeat with the flow, deployment and tags only, and the process's events
    # client adds the run's work queue and work pool, with their names: seen in the stored
    # events, and without it no heartbeat would match and nothing would ever be crashed).
    # A trigger's `match_related` must hold for every event it counts, heartbeats included:
    # runs of other pools, and in-process subflows (no pool; they die with their parent), are
    # never touched. By pool name, not deployment, so deployments added later (`harvest
    # schedule create`) are covered without applying this again.
    of_pools = {"prefect.resource.role": "work-pool", "prefect.resource.name": pools}
    of_runs = {"prefect.resource.id": "prefect.flow-run.*"}
    # One window per flow run: the events' primary resource is `prefect.flow-run.<id>`.
    per_run = {"prefect.resource.id"}
    listed = ", ".join(pools)

    crash = AutomationCore(
        name=CRASH_AUTOMATION,
        description=(
            f"A run of the work pools {listed} whose host stopped sending heartbeats (every "
            f"{HEARTBEAT_S} s) for {CRASH_AFTER_S} s is marked Crashed; the API's watcher reschedules "
            "it within the job's restart budget. Applied by flows.liveness."
        ),
        tags=TAGS,
        trigger=EventTrigger(
            # Each heartbeat both satisfies the window of the one before and opens a new one
            # (Prefect's "same event in after and expect" pattern). Only a heartbeat opens a
            # window, so hosts that send none (heartbeats off) are never crashed by this.
            posture=Posture.Proactive,
            after={HEARTBEAT},
            # An end closes the watch, and so does a state in which no process runs it, and so
            # does CANCELLING: a run being cancelled is left to the cancel automation, to end
            # Cancelled rather than Crashed (a heartbeat after it, from a host still alive,
            # opens a new window, longer than the cancel's).
            expect={HEARTBEAT, CANCELLING, *PARKED, *ENDS},
            for_each=per_run,
            match=of_runs,
            match_related=of_pools,
            threshold=1,
            within=timedelta(seconds=CRASH_AFTER_S),
        ),
        # Not forced: Prefect's orchestration aborts a move to Crashed from a final state, so a
        # late firing can never turn a Completed or Cancelled run into a Crashed one.
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed", message=CRASH_MESSAGE)],
    )
    never_started = AutomationCore(
        name=PENDING_AUTOMATION,
        description=(
            f"A run of the work pools {listed} still Pending {PENDING_AFTER_S} s after a worker took "
            "it: its host died before the flow started (no heartbeat yet to miss). It is marked "
            "Crashed, and the API's watcher reschedules it. Applied by flows.liveness."
        ),
        tags=TAGS,
        trigger=EventTrigger(
            # Running closes the window (or an end, a cancel, or a return to waiting). Not
            # "Submitting", the Pending state a worker sets just before it starts the process:
            # a host can die after it. Heartbeats play no part, so this holds on hosts with
            # heartbeats off too.
            posture=Posture.Proactive,
            after={PENDING},
            expect={RUNNING, CANCELLING, *PARKED, *ENDS},
            for_each=per_run,
            match=of_runs,
            match_related=of_pools,
            threshold=1,
            within=timedelta(seconds=PENDING_AFTER_S),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed", message=PENDING_MESSAGE)],
    )
    cancel = AutomationCore(
        name=CANCEL_AUTOMATION,
        description=(
            f"A run of the work pools {listed} still Cancelling {CANCEL_AFTER_S} s after the cancel "
            "had no host left to stop it: it is marked Cancelled. Applied by flows.liveness."
        ),
        tags=TAGS,
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={CANCELLING},
            expect=set(ENDS),
            for_each=per_run,
            match=of_runs,
            match_related=of_pools,
            threshold=1,
            within=timedelta(seconds=CANCEL_AFTER_S),
        ),
        # Any end within the window closes it, so this only fires for a run nobody finished
        # (Prefect would accept Cancelled over another final state: it is the window that
        # prevents it).
        actions=[ChangeFlowRunState(state=StateType.CANCELLED, name="Cancelled", message=CANCEL_MESSAGE)],
    )
    return [crash, never_started, cancel]


async def apply_automations(pools: list[str]) -> list[str]:
    """Create or update the automations for the flow runs of the work pools `pools`, on the
    server the current settings point at; returns their names.

    Idempotent by name: a second call updates them in place (the pools may change) and removes
    any duplicates of a name, so there is always exactly one of each.
    """
    if not pools:
        raise ValueError("apply_automations needs at least one work pool")
    names = []
    async with get_client() as client:
        for automation in automations(pools):
            # The name filter is exact, but keep exact names only in case it ever is not.
            existing = [a for a in await client.read_automations_by_name(automation.name) if a.name == automation.name]
            if existing:
                keep, *duplicates = existing
                await client.update_automation(keep.id, automation)
                for duplicate in duplicates:
                    await client.delete_automation(duplicate.id)
            else:
                await client.create_automation(automation)
            names.append(automation.name)
    return names


def apply_automations_sync(pools: list[str]) -> list[str]:
    return run_coro_as_sync(apply_automations(pools))
