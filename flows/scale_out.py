"""Scale-out: one job's shards over several flow runs of its lane, and the parent's watch.

The shards are cut into N contiguous ranges (`harvest.placement.split_ranges`). The parent keeps the first; the
others become flow runs of its own deployment, the lane's (`shard_range=[a, b]`), started by
`start_helpers`. When its own range is done, the parent waits for the helpers, but never for
ever (`harvest.placement.helper_action`, `HelperWatch`): a helper not running yet after `HARVEST_HELPER_GRACE_S`
(the lane is full, e.g. `large` with limit 1, or it is stuck Pending or Paused) is cancelled
and its range done here; one that ended without finishing has its range resumed here; one left
Crashed, Cancelling or unreadable for `HARVEST_HELPER_STALL_S` is taken over too. A Running
helper is waited for: if its host dies, Prefect's heartbeat automation marks it Crashed, and
then the rule above applies. Shards already written and verified are skipped, and a shard
is created once (`harvest.storage`): a helper taken over while still alive (Crashed but
running, or started just as it was cancelled) that goes on writing finds the shards its
successor wrote and leaves them as they are, listing their bytes, never its own. So scale-out
never deadlocks on the lane's limit, never loses or doubles a shard, and a manifest's hash of
a shard stays its file's. How many runs (N) is `flows.placement.choose_workers`.

Helpers wait in their parent's work queue, its key's (`flows.key_queues`): they hold slots of
the lane like any run, so they count against the key's share; in the pool's default queue a
key's one big job could take every slot as helpers and hold the next key's job back. The
placement counts that queue's free slots, so a job is split only over runs its key may start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

from prefect import get_run_logger
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled as CancelledState

from flows.progress import RunProgress
from harvest.jobfiles import JobFiles
from harvest.placement import COLLECT, TAKE_OVER, WAIT, helper_action
from harvest.shard.writing import Cancelled
from harvest.settings import Settings
from harvest.timings import Timings

__all__ = ["HelperWatch", "start_helpers", "collect_helpers", "HELPER_TAG", "POLL_S"]

HELPER_TAG = "scale-out-helper"
POLL_S = 1.0

def start_helpers(run: RunProgress, ranges: list[list[int]]) -> list[tuple[list[int], UUID]]:
    """One flow run of this run's deployment per range; idempotent, so a resumed parent
    re-attaches to the helpers it started before instead of starting new ones."""
    from prefect.deployments import run_deployment

    job_id = run.job_id
    tags = [t for t in (current_run.tags or []) if not t.startswith("key:")] + [HELPER_TAG, f"job:{job_id}"]
    # Helpers run with the parent's job variables (e.g. its env), so they behave the same.
    job_variables = run.job_variables
    helpers = []
    for rng in ranges:
        child = run_deployment(
            run.deployment,
            parameters={"job_id": job_id, "request_url": run.files.request_url, "shard_range": rng},
            timeout=0,
            as_subflow=True,
            idempotency_key=f"{job_id}:shards-{rng[0]}-{rng[1]}",
            flow_run_name=f"{job_id}-shards-{rng[0]}-{rng[1]}",
            tags=tags,
            job_variables=job_variables or None,
            work_queue_name=run.work_queue,
        )
        helpers.append((rng, child.id))
    return helpers


def _helper_kind(client, child_id: UUID) -> StateType | None:
    """The helper's state type; None when it cannot be read (counts as unknown)."""
    try:
        state = client.read_flow_run(child_id).state
    except Exception:
        get_run_logger().debug("could not read helper %s", child_id, exc_info=True)
        return None
    return state.type if state else StateType.SCHEDULED


def _cancel_helper(client, child_id: UUID) -> bool:
    """Cancel a helper so that it never starts (or restarts) its range; False when it turned
    out to be running or completed meanwhile (then it keeps its range)."""
    message = "Taken over by the parent run."
    try:
        if client.set_flow_run_state(child_id, CancelledState(message=message)).status == SetStateStatus.ACCEPT:
            return True
        if _helper_kind(client, child_id) in (StateType.RUNNING, StateType.COMPLETED):
            return False
        client.set_flow_run_state(child_id, CancelledState(message=message), force=True)
    except Exception:  # unreachable API: its range is done here anyway, each shard is created once
        get_run_logger().warning("could not cancel helper %s; taking its shards over anyway", child_id, exc_info=True)
    return True


class HelperWatch:
    """A parent's looks at the runs it handed work to (shard ranges here, a corpus refresh's
    parts in `flows.corpus_refresh`): on each look, what to do about one (`helper_action`).

    It remembers each run's last state and since when, and when the grace began: call
    `start_grace()` once the parent has no work of its own left.
    """

    def __init__(self, client, settings: Settings):
        self.client = client
        self.grace_s = settings.helper_grace_s
        self.stall_s = settings.helper_stall_s
        self.grace_ends: float | None = None
        self.seen: dict[UUID, tuple[StateType | None, float]] = {}  # last state seen, and since when

    def start_grace(self) -> None:
        if self.grace_ends is None:
            self.grace_ends = time.monotonic() + self.grace_s

    def look(self, child_id: UUID) -> tuple[str, StateType | None]:
        """`(action, state)`; a TAKE_OVER is already settled: the run is cancelled, so its
        work is the parent's (a run that started meanwhile answers WAIT instead)."""
        kind = _helper_kind(self.client, child_id)
        now = time.monotonic()
        last, since = self.seen.get(child_id, (kind, now))
        self.seen[child_id] = (kind, since if kind == last else now)
        since_grace = now - self.grace_ends if self.grace_ends is not None else float("-inf")
        action = helper_action(kind, since_grace, now - self.seen[child_id][1], stall_s=self.stall_s)
        if action == TAKE_OVER and not _cancel_helper(self.client, child_id):
            return WAIT, kind  # it started just now: look again next round
        return action, kind


def collect_helpers(
    files: JobFiles, run: RunProgress, helpers: list[tuple[list[int], UUID]], settings: Settings,
    do_range: Callable[[range], Timings],
) -> Timings:
    """Wait for the helpers (never for ever: `helper_action`); do here, with `do_range`, any
    range they did not."""
    logger = get_run_logger()
    timings = Timings()
    pending = list(helpers)
    watch = HelperWatch(run.client, settings)
    watch.start_grace()  # this run's own range is done
    while pending:
        for rng, child_id in list(pending):
            if run.cancelling():
                raise Cancelled("cancelled while waiting for helper runs")
            action, kind = watch.look(child_id)
            if action == WAIT:
                continue
            if action == COLLECT:
                helper_timings = files.read_helper_timings(rng)
                if helper_timings is not None:
                    timings.add(Timings.from_dict(helper_timings))
            else:
                what = kind.value if kind else "unknown"
                logger.info("helper %s %s (%s); doing shards %s..%s here", child_id, action, what, rng[0], rng[1] - 1)
                timings.add(do_range(range(*rng)))
            pending.remove((rng, child_id))
        run.report()  # the helpers' shards count as the job's progress too (`flows.progress`)
        if pending:
            time.sleep(POLL_S)
    return timings
