"""A lane's slots shared between API keys: each key's runs wait in a work queue of its own
(`flows.key_queues`) limited to the lane's `key_run_limit`, so one key's jobs never fill the
pool while another key's job waits.

The sharing test runs on a pool of its own (`lane-share`: limit 2, the session's `small`
worker would take the runs otherwise) with one host of two slots, whose runs fork from a run
starter; its key queues have a limit of 1, as a lane `pool_limit = 2, key_run_limit = 1`
would give them. What it reads is Prefect's own record of each run (state, start and end).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from harvest.settings import get_settings
from harvest.storage import open_storage
from tests.prefect_fixtures import WORKER_ENV, deploy_pool
from tests.slow_engine import slow_shards

POOL = "lane-share"


def _lanes(tmp_path, text: str):
    from harvest.lanes import load_lanes
    from harvest.settings import Settings

    path = tmp_path / f"lanes-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(text)
    return load_lanes(Settings(lanes_file=path))


def test_key_run_limit_defaults_to_one_slot_fewer_than_the_pool(tmp_path):
    lanes = _lanes(
        tmp_path,
        "[lanes.four]\npool_limit = 4\n"
        "[lanes.one]\npool_limit = 1\n"
        "[lanes.open]\nkey_limit = 2\n"
        "[lanes.set]\npool_limit = 4\nkey_run_limit = 3\n",
    )
    assert {name: lane.key_run_limit for name, lane in lanes.items()} == {"four": 3, "one": 1, "open": None, "set": 3}
    with pytest.raises(ValueError, match="key_run_limit"):
        _lanes(tmp_path, "[lanes.xl]\npool_limit = 2\nkey_run_limit = 0\n")


def test_the_shipped_lanes_leave_another_key_a_slot():
    from harvest.lanes import load_lanes

    lanes = load_lanes(get_settings())
    assert (lanes["small"].pool_limit, lanes["small"].key_run_limit) == (3, 2)
    assert (lanes["large"].pool_limit, lanes["large"].key_run_limit) == (1, 1)  # one slot: nothing to share


def test_key_queue_names():
    from flows.key_queues import key_queue_name

    assert key_queue_name("key_3fa29c") == "key_3fa29c"  # an API key's id, as `harvest keys list` shows it
    assert key_queue_name("test") == "key_test" and key_queue_name("default") == "key_default"


def test_a_start_puts_the_run_in_its_keys_queue_with_the_lanes_limit(prefect_deployments):
    """On the declared lane `small`: a key queue left without a limit (as Prefect makes one for
    a run naming a queue that does not exist) gets the lane's `key_run_limit` at the next start,
    and `harvest server`'s deploy step re-applies it after an operator's change. The queue is
    paused so that no worker starts the run."""
    from prefect.client.orchestration import get_client

    from fleet.processes import RUN_COMMAND
    from flows.deploy import apply_sync
    from flows.submit import cancel_harvest_run, start_harvest_run
    from harvest.lanes import load_lanes
    from harvest.settings import get_settings

    key = f"key_share{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_queue(name=key, work_pool_name="small", is_paused=True)
        run_id = start_harvest_run(str(uuid.uuid4()), "file:///nowhere/request.json", "llama-tiny", "small", key,
                                   lane_config=load_lanes(get_settings())["small"])
        try:
            run = client.read_flow_run(run_id)
            queue = client.read_work_queue_by_name(key, work_pool_name="small")
            assert (run.work_queue_name, queue.concurrency_limit) == (key, 2)
            assert run.state.type.value == "SCHEDULED"
            client.update_work_queue(queue.id, concurrency_limit=7)
            apply_sync(load_lanes(get_settings()), run_command=RUN_COMMAND)
            assert client.read_work_queue_by_name(key, work_pool_name="small").concurrency_limit == 2
        finally:
            cancel_harvest_run(run_id)


@pytest.fixture(scope="module")
def share_host(prefect_deployments, lane_workers):
    """Pool `lane-share` (limit 2) with its deployment, and one host of two slots on it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    from fleet.processes import start_worker
    from harvest.warm.protocol import unix_socket_path

    deploy_pool(POOL)
    with get_client(sync_client=True) as client:
        client.update_work_pool(POOL, WorkPoolUpdate(concurrency_limit=2))
    name = f"{POOL}-{uuid.uuid4().hex[:6]}"
    env = {**WORKER_ENV, "HARVEST_SLOTS": json.dumps([[], []])}
    worker = start_worker(
        POOL, lane_workers.api_url, lane_workers.log_dir / f"worker-{name}.log", env, name=name,
        run_starter=unix_socket_path(lane_workers.log_dir, f"runs-{name}"),
    )
    try:
        yield worker
    finally:
        worker.stop()


def _submit(key_id: str, n_shards: int = 1) -> str:
    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest

    job_id = str(uuid.uuid4())
    request = HarvestRequest(model="llama-tiny", prompts=[f"{key_id} prompt {k}" for k in range(n_shards)], shard_size=1)
    url = JobFiles.for_job(job_id, open_storage(get_settings())).write_request(request)
    return start_harvest_run(job_id, url, "llama-tiny", POOL, key_id, env=slow_shards(1))


def test_a_second_key_runs_while_the_first_keys_next_run_waits(share_host):
    from prefect.client.orchestration import get_client
    from prefect.utilities.asyncutils import run_coro_as_sync

    from flows.key_queues import KeyQueues

    async def queues():
        async with get_client() as client:
            for key in ("key_a", "key_b"):
                await KeyQueues().ensure(client, POOL, key, 1)

    run_coro_as_sync(queues())
    # One engine for all (its host loads it once), each shard 1 s more. A's first job has 6
    # shards, so B's run is due and polled for long before it ends, however slow the host is
    # to create runs and fork them (one shard each, B's start raced A's first end in CI).
    first_a, second_a, b = _submit("key_a", 6), _submit("key_a"), _submit("key_b")
    ids = {"first_a": first_a, "second_a": second_a, "b": b}
    held = False  # seen: A's second Scheduled (or Late) while A's first runs
    deadline = time.monotonic() + 150
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = {name: client.read_flow_run(i) for name, i in ids.items()}
            held |= runs["first_a"].state.type.value == "RUNNING" and runs["second_a"].state.type.value == "SCHEDULED"
            if all(r.state.is_final() for r in runs.values()):
                break
            time.sleep(0.3)
        runs = {name: client.read_flow_run(i) for name, i in ids.items()}
        queued_in = {name: r.work_queue_name for name, r in runs.items()}
    assert all(r.state.is_completed() for r in runs.values()), {n: r.state.name for n, r in runs.items()}
    # Pool limit 2, submitted A, A, B: without per-key queues A's two runs took both slots.
    assert runs["b"].start_time < runs["second_a"].start_time, {n: r.start_time for n, r in runs.items()}
    assert queued_in == {"first_a": "key_a", "second_a": "key_a", "b": "key_b"}
    assert runs["second_a"].start_time >= runs["first_a"].end_time  # A's second waited for A's first
    assert held
    print({n: (r.start_time.isoformat(), r.end_time.isoformat()) for n, r in runs.items()})


def test_scale_out_counts_only_the_slots_its_key_may_take(share_host):
    """A parent run's helpers wait in its key's queue: the free slots it splits a job over are
    at most what that queue leaves (here none, a queue of limit 0), whatever the pool has."""
    from prefect.client.orchestration import get_client
    from prefect.utilities.asyncutils import run_coro_as_sync

    from flows.key_queues import KeyQueues
    from flows.placement import lane_free_slots

    async def queue():
        async with get_client() as client:
            await KeyQueues().ensure(client, POOL, "key_full", 0)

    run_coro_as_sync(queue())
    with get_client(sync_client=True) as client:
        pool_only = lane_free_slots(client, POOL)
        keyed = lane_free_slots(client, POOL, "key_full")
    assert pool_only.free >= 1 and pool_only.key_queue_free is None
    assert (keyed.free, keyed.key_queue_free) == (0, 0)
