"""Long-poll over HTTP against the real app: `?wait=N` answers on the status change (from the
watcher or a cancel) or after N seconds, over the waiter limit it answers at once with
`X-Acs-Longpoll: declined` and `Retry-After: 3`, and waiters never poll the run backend."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from testbed import http_calls
from tests.test_api_jobs import _auth, _get, _submit
from tests.api_fixtures import set_run


@pytest.fixture(scope="module")
def key(harvest_api) -> str:
    return harvest_api.make_key(name="longpoll", small=50)


def test_long_poll_answers_on_the_status_change(harvest_api, key):
    job = _submit(harvest_api, key)["job_id"]
    threading.Timer(1.0, set_run, (harvest_api, job, "running")).start()
    started = time.monotonic()
    response = _get(harvest_api, key, job, wait=20)
    elapsed = time.monotonic() - started
    assert response.json()["status"] == "running" and response.json()["started_at"]
    assert 0.9 < elapsed < 3.0, elapsed
    assert "X-Acs-Longpoll" not in response.headers
    http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=_auth(key))


def test_long_poll_answers_after_wait_seconds_without_a_change(harvest_api, key):
    job = _submit(harvest_api, key)["job_id"]
    started = time.monotonic()
    response = _get(harvest_api, key, job, wait=1.5)
    assert 1.4 < time.monotonic() - started < 3.0
    assert response.status_code == 200 and response.json()["status"] == "pending"
    # A cancel wakes a waiter at once too.
    threading.Timer(0.5, lambda: http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=_auth(key))).start()
    started = time.monotonic()
    assert _get(harvest_api, key, job, wait=20).json()["status"] == "cancelled"
    assert time.monotonic() - started < 2.5


def test_waiters_over_the_limit_are_declined_and_waiters_never_poll_the_backend(harvest_api, key):
    """The replica holds 2 waiters (`harvest_api`), one per key (its share): two keys take both
    slots, and a third key's `?wait=` is declined at once by the replica's limit."""
    other, third = (harvest_api.make_key(name=f"longpoll-{uuid.uuid4().hex[:6]}", small=50) for _ in range(2))
    jobs = {k: _submit(harvest_api, k)["job_id"] for k in (key, other, third)}
    reads = Path(harvest_api.env["HARVEST_TEST_RUNS_DIR"]) / "reads.log"
    held = [threading.Thread(target=_get, args=(harvest_api, k, jobs[k]), kwargs={"wait": 3}) for k in (key, other)]
    for t in held:
        t.start()
    harvest_api.wait_for_longpoll_waiters(2)
    before = len(reads.read_text().splitlines())
    started = time.monotonic()
    response = _get(harvest_api, third, jobs[third], wait=10)
    assert time.monotonic() - started < 1.0
    assert response.status_code == 200 and response.json()["status"] == "pending"
    assert response.headers["X-Acs-Longpoll"] == "declined" and response.headers["Retry-After"] == "3"
    time.sleep(2.0)  # a window of ten watcher ticks to count the backend's reads in
    during = len(reads.read_text().splitlines()) - before
    for t in held:
        t.join()
    harvest_api.wait_for_longpoll_waiters(0)  # the gauge follows them out
    # One backend read per watcher tick (0.2 s) for every job together, however many wait.
    assert during <= 2.0 / 0.2 + 4, during
    assert _get(harvest_api, third, jobs[third], wait=0.2).headers.get("X-Acs-Longpoll") is None  # slots came back
    for k, job in jobs.items():
        http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=_auth(k))
