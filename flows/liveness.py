"""Hosts that die lose nothing: Prefect's own liveness machinery, applied to the lanes' pools.

A flow run whose host dies (power, kernel panic, OOM killer taking the worker with it) stays
RUNNING in Prefect's database for ever: nobody is left to report on it. A pid table cannot
tell either, since a pid means nothing on another host and is reused on this one. Prefect
3.9.1 has the pieces to do it by itself, across hosts (DESIGN, "Prefect 3.9.1"):

- every flow run of a worker host emits a `prefect.flow-run.heartbeat` event every
  `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (`HEARTBEAT_ENV`: the host's worker passes its
  environment on to its flow runs);
- automation "harvest: crash runs whose heartbeats stopped" (proactive) marks a run CRASHED
  when neither a heartbeat nor an end arrives within 2.5 heartbeats of the last one. The API's
  watcher then reschedules it onto another host of the lane within its restart budget, and it
  resumes from its verified shards. (No automation reschedules: that loop must be bounded.)
- automation "harvest: finish cancels whose host is gone" (proactive) ends a run CANCELLED when
  it stays CANCELLING for a minute: normally the run's worker (or the run itself) finishes a
  cancel in ~2 s, at most after a 30 s kill grace; if its host is gone nobody ever does.

Both are applied idempotently by name (`apply_automations`), with the pools and deployments.

    HEARTBEAT_ENV                          environment of a worker host (heartbeats on)
    await apply_automations(pools)         create or update both; returns their names
    apply_automations_sync(pools)          the same, synchronous
    automations(pools, deployment_ids)     the two automations, as Prefect objects (no I/O)

Measured here (tests/test_liveness.py): a SIGKILLed host's run is CRASHED 45-80 s after the
kill; a run cancelled after its host died is CANCELLED ~60 s after the cancel.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.utilities.asyncutils import run_coro_as_sync

__all__ = [
    "HEARTBEAT_S",
    "HEARTBEAT_ENV",
    "CRASH_AFTER_S",
    "CANCEL_AFTER_S",
    "CRASH_AUTOMATION",
    "CANCEL_AUTOMATION",
    "CRASH_MESSAGE",
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
# A live host finishes a cancel in ~2 s, or after Prefect's 30 s kill grace at worst (DESIGN);
# twice that is beyond doubt.
CANCEL_AFTER_S = 60

CRASH_AUTOMATION = "harvest: crash runs whose heartbeats stopped"
CANCEL_AUTOMATION = "harvest: finish cancels whose host is gone"
CRASH_MESSAGE = f"Crashed: its host stopped sending heartbeats (none for {CRASH_AFTER_S} s)."
CANCEL_MESSAGE = "Cancelled by request; its host was gone."

HEARTBEAT = "prefect.flow-run.heartbeat"
CANCELLING = "prefect.flow-run.Cancelling"
ENDS = ["prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"]
TAGS = ["harvest", "liveness"]


def automations(pools: list[str], deployment_ids: list[UUID | str]) -> list[AutomationCore]:
    """The two automations for the runs of `pools` (whose deployments are `deployment_ids`)."""
    # Which runs: heartbeat events carry only the flow, the deployment and the run's tags as
    # related resources, not the work pool (Prefect 3.9.1, `_build_heartbeat_event_template`),
    # while state-change events carry the work pool too. A trigger's `match_related` must hold
    # for every event it counts, heartbeats included, so the crash trigger selects the pools'
    # runs by their deployments; runs of other pools (and in-process subflows, which have no
    # deployment and die with their parent anyway) are never touched.
    by_deployment = {
        "prefect.resource.role": "deployment",
        "prefect.resource.id": [f"prefect.deployment.{d}" for d in deployment_ids],
    }
    # The cancel trigger counts state changes only, which name the work pool: select by pool,
    # so it also covers deployments added after it was applied.
    by_pool = {"prefect.resource.role": "work-pool", "prefect.resource.name": list(pools)}
    # One bucket per flow run (the events' primary resource is `prefect.flow-run.<id>`).
    per_run = {"prefect.resource.id"}

    crash = AutomationCore(
        name=CRASH_AUTOMATION,
        description=(
            f"A run of the pools {', '.join(pools)} whose host stopped sending heartbeats (every "
            f"{HEARTBEAT_S} s) for {CRASH_AFTER_S} s is marked Crashed; the API's watcher reschedules "
            "it within the job's restart budget. Applied by flows.liveness."
        ),
        tags=TAGS,
        trigger=EventTrigger(
            # Each heartbeat both satisfies the window of the previous one and opens a new one
            # (Prefect's documented "same event in after and expect" pattern).
            posture=Posture.Proactive,
            after={HEARTBEAT},
            # An end closes the watch. So does CANCELLING: a run being cancelled is finished by
            # the cancel automation, Cancelled rather than Crashed (a heartbeat after it, from a
            # live host, opens a new window; the cancel's own window is shorter anyway).
            expect={HEARTBEAT, CANCELLING, *ENDS},
            for_each=per_run,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=by_deployment,
            threshold=1,
            within=timedelta(seconds=CRASH_AFTER_S),
        ),
        # Not forced: Prefect refuses to move a run out of a final state, so a late firing can
        # never turn a Completed or Cancelled run into a Crashed one.
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed", message=CRASH_MESSAGE)],
    )
    cancel = AutomationCore(
        name=CANCEL_AUTOMATION,
        description=(
            f"A run of the pools {', '.join(pools)} still Cancelling {CANCEL_AFTER_S} s after the "
            "cancel had no host left to stop it: it is marked Cancelled. Applied by flows.liveness."
        ),
        tags=TAGS,
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={CANCELLING},
            expect=set(ENDS),
            for_each=per_run,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=by_pool,
            threshold=1,
            within=timedelta(seconds=CANCEL_AFTER_S),
        ),
        actions=[ChangeFlowRunState(state=StateType.CANCELLED, name="Cancelled", message=CANCEL_MESSAGE)],
    )
    return [crash, cancel]


async def _deployment_ids(client, pools: list[str]) -> list[UUID]:
    deployments = await client.read_deployments(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=list(pools))))
    return sorted({d.id for d in deployments}, key=str)


async def apply_automations(pools: list[str]) -> list[str]:
    """Create or update both automations for the runs of `pools`, on the server the current
    settings point at; returns their names.

    Idempotent by name: a second call updates them in place (and removes any duplicates of the
    same name), so there is always exactly one of each. Apply it after the deployments: the
    crash automation selects the runs by the deployments of `pools` at the time of the call,
    so a deployment added later on these pools is watched once this is applied again (the
    control plane applies it on every start).
    """
    pools = sorted(set(pools))
    if not pools:
        raise ValueError("apply_automations needs at least one work pool")
    names = []
    async with get_client() as client:
        deployment_ids = await _deployment_ids(client, pools)
        if not deployment_ids:
            raise ValueError(f"no deployments on the work pools {pools}: apply the deployments first")
        for automation in automations(pools, deployment_ids):
            existing = await client.read_automations_by_name(automation.name)
            # read_automations_by_name may match loosely: keep exact names only.
            existing = [a for a in existing if a.name == automation.name]
            if existing:
                keep, *extra = existing
                await client.update_automation(keep.id, automation)
                for duplicate in extra:
                    await client.delete_automation(duplicate.id)
            else:
                await client.create_automation(automation)
            names.append(automation.name)
    return names


def apply_automations_sync(pools: list[str]) -> list[str]:
    return run_coro_as_sync(apply_automations(pools))
