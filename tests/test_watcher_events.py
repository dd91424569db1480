"""The watcher follows Prefect's event stream (`api.runs.PrefectRuns.follow`): a run's end, and
its job's progress as the run reports it, are in the job store within moments, not at the
watcher's next pass over the active jobs.

The API replica here re-reads the active jobs only every 30 s (`HARVEST_WATCH_INTERVAL_S`),
against the session's real Prefect server and lane workers; checked against Prefect's own record
of when the run ended. Without the events, `done` would wait for the pass (up to 30 s after the
run's end), and a job's progress would skip from 0 to its end: each shard the run writes is
reported on the run (its `harvest.shards_done` label) with a `harvest.run.progress` event
(`flows.progress`), and that event is what makes the watcher read it."""

from __future__ import annotations

from datetime import datetime

import pytest

import time

from testbed import http_calls
from tests.api_fixtures import FLOW_ENV_APP, ApiServer
from testbed.flow_env_runs import write_flow_env
from tests.slow_engine import slow_shards

INTERVAL_S = 30
SHARD_S = 1.5


@pytest.fixture(scope="module")
def slow_ticking_api(harvest_home, harvest_stack, tiny):
    """Production's run store (`PrefectRuns`), handing its runs the environment in
    `server.flow_env` (none at first: `testbed.flow_env_runs`)."""
    flow_env = harvest_home / "api" / "slow-ticks-flow-env.json"
    flow_env.parent.mkdir(parents=True, exist_ok=True)
    write_flow_env(flow_env, {})
    server = ApiServer(harvest_home, "slow-ticks", {
        "HARVEST_WATCH_INTERVAL_S": str(INTERVAL_S), "HARVEST_TEST_FLOW_ENV_FILE": str(flow_env),
    }, app=FLOW_ENV_APP).start()
    server.flow_env = flow_env
    yield server
    write_flow_env(flow_env, {})
    server.stop()


def test_a_runs_end_reaches_the_job_at_once_not_at_the_next_tick(slow_ticking_api):
    from prefect.client.orchestration import get_client

    from flows.submit import job_runs_filter

    api, auth = slow_ticking_api.base_url, {"Authorization": f"Bearer {slow_ticking_api.make_key(name='events')}"}
    for n in range(2):  # the second starts long after the submit's own kick has been spent
        job = http_calls.post(f"{api}/harvest", headers=auth, timeout=60,
                              json={"model": "llama-tiny", "prompts": [f"job {n}: the sky is"], "layers": [1]}).json()
        while job["status"] not in ("done", "failed", "cancelled"):
            job = http_calls.get(f"{api}/harvest/{job['job_id']}", params={"wait": 60}, headers=auth, timeout=90).json()
        assert job["status"] == "done", job
        with get_client(sync_client=True) as client:
            (run,) = client.read_flow_runs(flow_run_filter=job_runs_filter(job["job_id"]))
        lag = (datetime.fromisoformat(job["completed_at"].replace("Z", "+00:00")) - run.end_time).total_seconds()
        assert lag < 5, f"job {n}: done {lag:.1f} s after its run ended (the tick is every {INTERVAL_S} s)"


def test_a_jobs_progress_reaches_it_from_its_runs_report_shard_by_shard(slow_ticking_api):
    """Each shard takes 1.5 s more (`tests.slow_engine`): read through the API while the job
    runs, its `shards_done` passes through the counts, long before the watcher's 30 s pass."""
    api, auth = slow_ticking_api.base_url, {"Authorization": f"Bearer {slow_ticking_api.make_key(name='progress')}"}
    n = 4
    write_flow_env(slow_ticking_api.flow_env, slow_shards(SHARD_S))
    try:
        job = http_calls.post(f"{api}/harvest", headers=auth, timeout=60, json={
            "model": "llama-tiny", "prompts": [f"progress {i}: the sky is" for i in range(n)], "shard_size": 1,
            "layers": [1]}).json()
    finally:
        write_flow_env(slow_ticking_api.flow_env, {})  # the next job runs at full speed
    seen: list[int] = []
    deadline = time.monotonic() + 240
    while job["status"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, (job, seen)
        if job["status"] == "running":
            seen.append(job["progress"]["shards_done"])
        time.sleep(0.1)
        job = http_calls.get(f"{api}/harvest/{job['job_id']}", headers=auth, timeout=30).json()
    assert job["status"] == "done", job
    assert job["progress"] == {"shards_done": n, "n_shards": n}
    assert seen == sorted(seen), seen
    # A shard counts once its write is done, and its write runs behind the next shard's forward
    # pass: the count before the last lands as the last forward pass ends, a moment before the
    # run does (whose end gives the last count), so only the counts before it last a shard.
    assert set(range(1, n - 1)) <= set(seen), f"progress read mid-run: {seen}"
    print(f"shards_done read while running: {sorted(set(seen))}")
