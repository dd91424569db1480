"""An overloaded Prefect never holds a submit for long: the run start is bounded
(`flows.submit.START_BOUND_S`), and past it the API answers 503 with Retry-After, the job
recorded failed and charged nothing, no run left behind.

The API's Prefect is the session's real server behind `tests.fault_proxy`, which swallows every
`create_flow_run` (reads the request, answers nothing for 30 s, then drops the connection: a
server too busy to answer). Before the bound, Prefect's client retried such a call with growing
back-offs for minutes inside the submit.
"""

from __future__ import annotations

import time

import pytest

from testbed import http_calls
from tests.api_fixtures import PRODUCTION_APP, ApiServer
from tests.fault_proxy import FaultProxy


@pytest.fixture(scope="module")
def stalled_prefect(harvest_stack):
    proxy = FaultProxy(harvest_stack.server.ui_url).start()
    proxy.add("POST", "/create_flow_run", "hang", count=100, hold_s=30)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def overloaded_api(harvest_home, harvest_stack, stalled_prefect, tiny):
    server = ApiServer(harvest_home, "overload", {
        "PREFECT_API_URL": f"{stalled_prefect.url}/api",
    }, app=PRODUCTION_APP).start()
    yield server
    server.stop()


def test_a_submit_to_an_overloaded_prefect_answers_503_with_retry_after_within_the_bound(overloaded_api, stalled_prefect):
    from prefect.client.orchestration import get_client

    from flows.submit import START_BOUND_S, job_runs_filter

    auth = {"Authorization": f"Bearer {overloaded_api.make_key(name='overload')}"}
    # A first submit, refused for its model, brings the replica's assessing children up (their
    # imports take tens of seconds on a loaded machine): the bound below is the run start's.
    refused = http_calls.post(f"{overloaded_api.base_url}/harvest", headers=auth, timeout=300,
                              json={"model": "no-such-model", "prompts": ["The sky is"], "layers": [1]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_found", refused.text
    started = time.monotonic()
    answer = http_calls.post(f"{overloaded_api.base_url}/harvest", headers=auth, timeout=300,
                             json={"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]})
    elapsed = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "harvest_unavailable"
    assert int(answer.headers["Retry-After"]) > 0
    # The bound, plus the submit's own work on this loaded box (tokenizing, the job store, the
    # cancel by tag); unbounded, Prefect's client kept it for minutes (5 retries of 30 s here).
    assert elapsed < START_BOUND_S + 15, f"the submit took {elapsed:.1f} s"
    assert stalled_prefect.count("POST", "/create_flow_run") >= 1  # it did ask Prefect

    (job,) = http_calls.get(f"{overloaded_api.base_url}/harvest", headers=auth).json()["data"]
    assert job["status"] == "failed" and job["tokens"] == 0  # recorded, charged nothing
    with get_client(sync_client=True) as client:  # straight to Prefect, not through the proxy
        runs = client.read_flow_runs(flow_run_filter=job_runs_filter(job["job_id"]))
    assert all(run.state is None or run.state.is_final() or run.state.name == "Cancelling" for run in runs), runs
