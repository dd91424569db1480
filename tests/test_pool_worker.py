"""A host's worker takes a run when Prefect says there is one, not at its next poll
(`fleet.pool_worker`).

The worker here polls once a minute (PREFECT_WORKER_QUERY_SECONDS=60), far longer than each
wait this test allows, on a pool of its own (`pool-wake`) with one slot. What it reads is
Prefect's own record of each run (its state history), not the worker's:

- a new run is taken (Pending) within seconds of its creation: Prefect's Scheduled event woke
  the worker;
- with one slot, a second run submitted while the first runs is taken within seconds of the
  first's end: the slot the first run's process let go woke the worker.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from harvest.storage import open_storage
from harvest.settings import get_settings
from tests.prefect_fixtures import WORKER_ENV, deploy_pool

POOL = "pool-wake"
POLL_S = 60
TAKEN_WITHIN_S = 20.0  # a third of one poll: only a wake takes a run this soon


@pytest.fixture(scope="module")
def slow_polling_host(prefect_deployments, lane_workers):
    from prefect.client.orchestration import get_client

    from fleet.processes import start_worker
    from harvest.warm.protocol import unix_socket_path

    deploy_pool(POOL)
    name = f"{POOL}-{uuid.uuid4().hex[:6]}"
    env = {**WORKER_ENV, "HARVEST_SLOTS": json.dumps([[]]), "PREFECT_WORKER_QUERY_SECONDS": str(POLL_S)}
    worker = start_worker(
        POOL, lane_workers.api_url, lane_workers.log_dir / f"worker-{name}.log", env, name=name, limit=1,
        run_starter=unix_socket_path(lane_workers.log_dir, f"runs-{name}"),
    )
    try:
        # Its first poll (at start) is behind it once it has sent its heartbeat.
        deadline = time.monotonic() + 60
        with get_client(sync_client=True) as client:
            while not any(w.name == name for w in client.read_workers_for_work_pool(POOL)):
                assert worker.alive() and time.monotonic() < deadline, "the worker never reached Prefect"
                time.sleep(0.5)
        time.sleep(2.0)
        yield worker
    finally:
        worker.stop()


def _submit_to(pool: str, prompts: int = 1) -> str:
    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest

    job_id = str(uuid.uuid4())
    request = HarvestRequest(model="llama-tiny", prompts=[f"wake prompt {k}" for k in range(prompts)], shard_size=1)
    url = JobFiles.for_job(job_id, open_storage(get_settings())).write_request(request)
    return str(start_harvest_run(job_id, url, "llama-tiny", pool, "key_wake"))


def _submit(prompts: int = 1) -> str:
    return _submit_to(POOL, prompts)


def _history(client, run_id: str) -> dict[str, float]:
    """Each state type's first timestamp in the run's history, as Prefect recorded it."""
    marks: dict[str, float] = {}
    for state in client.read_flow_run_states(run_id):
        marks.setdefault(state.type.value, state.timestamp.timestamp())
    return marks


def _wait_final(client, run_ids: list[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not all(client.read_flow_run(r).state.is_final() for r in run_ids):
        assert time.monotonic() < deadline, {r: client.read_flow_run(r).state.name for r in run_ids}
        time.sleep(0.3)


def test_a_new_run_is_taken_at_once_and_a_freed_slot_takes_the_next(slow_polling_host):
    from prefect.client.orchestration import get_client

    first = _submit(prompts=3)
    second = _submit()  # one slot: it waits for the first run's process to end
    with get_client(sync_client=True) as client:
        _wait_final(client, [first, second])
        runs = {r: client.read_flow_run(r) for r in (first, second)}
        assert all(run.state.is_completed() for run in runs.values()), {r: run.state.name for r, run in runs.items()}
        one, two = _history(client, first), _history(client, second)
    assert one["PENDING"] - one["SCHEDULED"] < TAKEN_WITHIN_S, one
    # The second was due before the first ended, and was taken once its slot came free.
    assert two["PENDING"] >= one["COMPLETED"] - 1.0, (one, two)
    assert two["PENDING"] - one["COMPLETED"] < TAKEN_WITHIN_S, (one, two)
    assert slow_polling_host.alive()


def test_finish_cancel_ends_only_a_run_still_cancelling(prefect_deployments):
    """When a run's process ends on a host, its worker finishes a cancel nobody finished
    (`fleet.pool_worker.finish_cancel`), and leaves every other state alone. Runs on a pool no
    worker polls, their states set as Prefect records them; read back from Prefect."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling, Completed, Pending, Running
    from prefect.utilities.asyncutils import run_coro_as_sync

    from fleet.pool_worker import finish_cancel

    pool = "pool-finish-cancel"
    deploy_pool(pool)
    runs = {}
    # Each taken by a host first (Pending): Prefect cancels a Scheduled run outright.
    for name, state in (("cancelling", Cancelling()), ("running", Running()), ("completed", Completed())):
        runs[name] = _submit_to(pool)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(runs[name], Pending(), force=True)
            client.set_flow_run_state(runs[name], state, force=True)

    async def finish(run_id: str) -> bool:
        async with get_client() as client:
            return await finish_cancel(client, uuid.UUID(run_id))

    assert [run_coro_as_sync(finish(runs[n])) for n in ("cancelling", "running", "completed")] == [True, False, False]
    assert run_coro_as_sync(finish(runs["cancelling"])) is False  # once: it is Cancelled now
    with get_client(sync_client=True) as client:
        states = {n: client.read_flow_run(r).state for n, r in runs.items()}
    assert {n: s.type.value for n, s in states.items()} == {"cancelling": "CANCELLED", "running": "RUNNING", "completed": "COMPLETED"}
    assert states["cancelling"].message == "Cancelled: its process ended before it ran."
