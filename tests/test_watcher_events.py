"""The watcher follows Prefect's event stream (`api.runs.PrefectRuns.follow`): a run's end is
in the job store within moments, not at the watcher's next tick.

The API replica here ticks only every 30 s (`HARVEST_WATCH_INTERVAL_S`), against the session's
real Prefect server and lane workers; checked against Prefect's own record of when the run
ended. Without the events, `done` would wait for the tick (up to 30 s after the run's end)."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests import http_calls
from tests.api_fixtures import PRODUCTION_APP, ApiServer

INTERVAL_S = 30


@pytest.fixture(scope="module")
def slow_ticking_api(harvest_home, harvest_stack, tiny):
    server = ApiServer(harvest_home, "slow-ticks", {"HARVEST_WATCH_INTERVAL_S": str(INTERVAL_S)}, app=PRODUCTION_APP).start()
    yield server
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

