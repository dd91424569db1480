"""Hardening of the HTTP surface, against the real app under uvicorn on loopback:
every body capped, one answer with a request id for unexpected errors, links that ignore the
client's Host, messages without server paths, per-key request rates shared by replicas, and a
failed start that leaves no run going.

Most tests use one server of their own (`guarded`) with small request rates, so a key can be
throttled in a few requests; each test makes its own keys.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import insert, select

from testbed import http_calls
from tests.api_fixtures import ApiServer, harvest_api_env

OK = {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def guarded(harvest_home, tiny):
    """An API whose keys may read 4 times at once (then 1 a second) and submit 2 times at once."""
    server = ApiServer(harvest_home, "guarded", {
        **harvest_api_env(harvest_home),
        "HARVEST_RATE_READ_BURST": "4", "HARVEST_RATE_READ_PER_S": "1",
        "HARVEST_RATE_SUBMIT_BURST": "2", "HARVEST_RATE_SUBMIT_PER_S": "0.2",
    })
    try:
        yield server.start()
    finally:
        server.stop()


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# --- 1. every body capped ---------------------------------------------------------------------

def test_routes_that_take_no_body_refuse_a_large_one_with_413(guarded):
    """Before: a GET or DELETE carried any body (answered 401/404 after uvicorn took it in)."""
    key = guarded.make_key(name="bodies")
    big = b"x" * (128 * 1024)
    for method, path in (("DELETE", "/harvest/some-job"), ("GET", "/harvest"), ("GET", "/models"),
                         ("GET", "/files/j/manifest.json")):
        response = http_calls.request(method, f"{guarded.base_url}{path}", headers=_auth(key), content=big, timeout=30)
        error = _error(response, 413, "request_too_large")
        assert "64 KB" in error["message"], error
    # Small bodies on them are still let through (and ignored), as HTTP allows.
    assert http_calls.request("GET", f"{guarded.base_url}/harvest", headers=_auth(key), content=b"{}").status_code == 200


def test_a_streamed_body_without_length_is_capped_on_the_completions_route(guarded):
    key = guarded.make_key(name="stream")

    def chunks():
        yield b'{"model": "llama-tiny", "prompt": "'
        for _ in range(9):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    response = http_calls.post(f"{guarded.base_url}/completions", headers={**_auth(key), "Content-Type": "application/json"},
                               content=chunks(), timeout=60)
    assert "8 MB" in _error(response, 413, "request_too_large")["message"]


# --- 2. one answer for unexpected errors, with a request id the log carries ------------------

def test_an_unexpected_error_answers_the_error_body_with_a_request_id_that_the_log_carries(guarded):
    """A job row the code cannot render (a bug's effect): before, a plain-text 500 with no id."""
    from api.auth import create_key
    from api.db import jobs, utcnow

    engine = guarded.engine()
    try:
        key, record = create_key("broken", engine=engine)
        with engine.begin() as conn:
            conn.execute(insert(jobs).values(
                id="00000000-0000-4000-8000-00000000b0b0", key_id=record.id, model="llama-tiny", lane="small",
                status="pending", n_prompts=1, layers=5, shard_size=1, n_shards=1, shards_done=0,
                add_special_tokens=True, contents="activations", reserved_tokens=1, created_at=utcnow(),
                request_url="file:///nowhere",
            ))
    finally:
        engine.dispose()
    response = http_calls.get(f"{guarded.base_url}/harvest/00000000-0000-4000-8000-00000000b0b0", headers=_auth(key))
    error = _error(response, 500, "internal_error")
    request_id = response.headers["X-Request-ID"]
    assert re.fullmatch(r"req_[0-9a-f]{24}", request_id)
    assert request_id in error["message"] and error["type"] == "server_error"
    assert "Traceback" not in response.text and "TypeError" not in response.text
    deadline = time.monotonic() + 5
    while request_id not in guarded.log.read_text():
        assert time.monotonic() < deadline, "the server's log never named the request id"
        time.sleep(0.1)
    logged = guarded.log.read_text()
    line = next(line for line in logged.splitlines() if request_id in line)
    assert "GET /v1/harvest/00000000-0000-4000-8000-00000000b0b0" in line
    assert "Traceback" in logged.split(request_id, 1)[1]  # and the traceback follows it


def test_every_answer_carries_its_own_request_id(guarded):
    key = guarded.make_key(name="ids")
    answers = [http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(key)),
               http_calls.get(f"{guarded.base_url}/harvest/nope", headers=_auth(key)),
               http_calls.get(f"{guarded.base_url}/harvest")]
    assert [a.status_code for a in answers] == [200, 404, 401]
    ids = [a.headers["X-Request-ID"] for a in answers]
    assert len(set(ids)) == 3 and all(i.startswith("req_") for i in ids)


def test_unknown_routes_and_methods_answer_the_error_body_and_allow(guarded):
    response = http_calls.get(f"{guarded.base_url}/nothing-here")
    _error(response, 404, "route_not_found")
    for method, path, allowed in (("PUT", "/harvest", "GET, POST"), ("PATCH", "/harvest/x", "DELETE, GET"),
                                  ("POST", "/models", "GET"), ("DELETE", "/completions", "POST"),
                                  ("HEAD", "/harvest", "GET, POST")):  # no implicit HEAD: Allow says so
        response = http_calls.request(method, f"{guarded.base_url}{path}")
        if method != "HEAD":  # a HEAD answer has no body
            _error(response, 405, "method_not_allowed")
        assert response.status_code == 405 and response.headers["Allow"] == allowed, (method, path, response.headers.get("Allow"))


# --- 4. messages name models, not server paths ------------------------------------------------

def test_an_unavailable_model_is_named_without_server_paths(guarded):
    key = guarded.make_key(name="paths")
    error = _error(http_calls.post(f"{guarded.base_url}/harvest", headers=_auth(key), json={**OK, "model": "llama-8b", "layers": [8]},
                                   timeout=60), 503, "harvest_unavailable")
    assert "llama-8b" in error["message"] and "meta-llama/Llama-3.1-8B" in error["message"]
    assert str(guarded.home) not in error["message"] and "looked in" not in error["message"], error
    assert not re.search(r"(^|\s)(/(?!v1/)|~/)\S", error["message"]), error  # no server path (API routes are fine)


# --- 5. per-key request rates -----------------------------------------------------------------

def test_a_key_over_its_read_rate_gets_429_with_retry_after_and_others_are_not_starved(guarded):
    greedy, patient = guarded.make_key(name="greedy"), guarded.make_key(name="patient")
    codes = [http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(greedy)).status_code for _ in range(6)]
    assert codes[:4] == [200] * 4 and 429 in codes[4:], codes
    refused = http_calls.get(f"{guarded.base_url}/models", headers=_auth(greedy))
    error = _error(refused, 429, "rate_limit_exceeded")
    assert int(refused.headers["Retry-After"]) >= 1 and "at most 4 at once" in error["message"]
    assert http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(patient)).status_code == 200
    time.sleep(int(refused.headers["Retry-After"]) + 0.2)  # Retry-After is honest: a token is back
    assert http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(greedy)).status_code == 200


def test_submits_have_their_own_rate_shared_by_every_replica(guarded, harvest_home):
    """A second replica on the same job store: the key's submit bucket is one, not one each."""
    shared = {k: v for k, v in guarded.env.items() if k != "HARVEST_PORT"}  # same store, runs, storage
    replica = ApiServer(harvest_home, "guarded-replica", shared).start()
    try:
        # Another key's submit first: the new replica's first submit waits for its assessing
        # children's imports (`api.admission_process`), time in which this key's bucket would refill.
        for server in (guarded, replica):
            warm = guarded.make_key(name=f"warm-{server.base_url[-5:]}", small=10)
            assert http_calls.post(f"{server.base_url}/harvest", headers=_auth(warm), json=OK, timeout=60).status_code == 202
        # Its own submit rate, a token a minute after a burst of 2: however long a submit takes
        # on a busy box, no token comes back between these four.
        key = guarded.make_key(name="two-replicas", small=10, rate_submit_per_s=1 / 60, rate_submit_burst=2)
        answers = [http_calls.post(f"{server.base_url}/harvest", headers=_auth(key), json=OK, timeout=60)
                   for server in (guarded, replica, guarded, replica)]
        assert [a.status_code for a in answers[:2]] == [202, 202]
        assert {a.json()["error"]["code"] for a in answers[2:]} == {"rate_limit_exceeded"}
        # Reads are a separate bucket: still allowed.
        assert http_calls.get(f"{replica.base_url}/harvest", headers=_auth(key)).status_code == 200
    finally:
        replica.stop()


def test_a_key_can_have_its_own_rates(guarded):
    """`harvest keys create --read-burst 2 --read-per-s 0.5`: this key gets 2 reads at once where
    the service's setting is 4; a key without its own keeps the setting; `keys list` shows both."""
    import os
    import subprocess
    import sys

    guarded.make_key(name="plain-rates")
    env = {**os.environ, "HARVEST_DATABASE_URL": guarded.env["HARVEST_DATABASE_URL"],
           "HARVEST_RATE_READ_BURST": "4", "HARVEST_RATE_READ_PER_S": "1"}
    cli = [sys.executable, "-m", "fleet.cli", "keys"]
    made = subprocess.run([*cli, "create", "--name", "own-rates", "--read-burst", "2", "--read-per-s", "0.5"],
                          env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    own = made.stdout.strip().splitlines()[-1]
    codes = [http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(own)).status_code for _ in range(3)]
    assert codes == [200, 200, 429], codes
    refused = http_calls.get(f"{guarded.base_url}/harvest", headers=_auth(own))
    assert "at most 2 at once and 0.5 a second" in _error(refused, 429, "rate_limit_exceeded")["message"]
    assert int(refused.headers["Retry-After"]) == 2  # a token every 2 s
    listing = json.loads(subprocess.run([*cli, "list", "--json"], env=env, capture_output=True, text=True, check=True,
                                        cwd=Path(__file__).resolve().parent.parent).stdout)
    rates = {row["name"]: row["caps"]["rates"] for row in listing}
    assert rates["own-rates"]["read"] == {"per_s": 0.5, "burst": 2}
    assert rates["own-rates"]["submit"] == {"per_s": 2.0, "burst": 60}  # not its own: the (default) setting
    assert rates["plain-rates"]["read"] == {"per_s": 1.0, "burst": 4}


# --- 7. a failed start leaves no run going ----------------------------------------------------

def _runs_dir(server) -> Path:
    return Path(server.env["HARVEST_TEST_RUNS_DIR"])


def test_a_start_that_fails_after_the_run_was_created_cancels_that_run(guarded):
    """Before: the job was failed and charged nothing, and its run went on, unfollowed and free."""
    key = guarded.make_key(name="lost-answer")
    flag = _runs_dir(guarded) / "start-fails-after-create"
    flag.touch()
    try:
        response = http_calls.post(f"{guarded.base_url}/harvest", headers=_auth(key), json=OK, timeout=60)
    finally:
        flag.unlink()
    error = _error(response, 503, "harvest_unavailable")
    job_id = error["message"].split("Job ")[1].split(" ")[0]
    run = guarded.runs.get(f"run-{job_id}")
    assert run is not None and run["status"] == "cancelled" and run["cancels"] == 1
    body = http_calls.get(f"{guarded.base_url}/harvest/{job_id}", headers=_auth(key)).json()
    assert body["status"] == "failed" and "charged nothing" in body["error"] and "Error" not in body["error"]
    _assert_ledger(guarded, job_id, [("failed", 0)])


def test_when_the_cancel_fails_too_the_watcher_cancels_the_run_later(guarded):
    key = guarded.make_key(name="watcher-cancels")
    runs = _runs_dir(guarded)
    (runs / "start-fails-after-create").touch()
    (runs / "cancel-fails").touch()
    try:
        response = http_calls.post(f"{guarded.base_url}/harvest", headers=_auth(key), json=OK, timeout=60)
        job_id = _error(response, 503, "harvest_unavailable")["message"].split("Job ")[1].split(" ")[0]
        time.sleep(1.0)  # watcher ticks while the backend still refuses: the run goes on
        assert guarded.runs.get(f"run-{job_id}")["status"] == "pending"
    finally:
        (runs / "start-fails-after-create").unlink()
        (runs / "cancel-fails").unlink()
    deadline = time.monotonic() + 10
    while guarded.runs.get(f"run-{job_id}")["status"] != "cancelled":
        assert time.monotonic() < deadline, "the watcher never cancelled the run of the failed start"
        time.sleep(0.1)
    engine = guarded.engine()
    try:
        from api.db import jobs

        with engine.connect() as conn:
            assert conn.execute(select(jobs.c.stop_run).where(jobs.c.id == job_id)).scalar_one() is False
    finally:
        engine.dispose()


def _assert_ledger(server, job_id: str, expected: list[tuple]) -> None:
    from api.db import charge_ledger

    engine = server.engine()
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(charge_ledger.c.outcome, charge_ledger.c.tokens_charged).where(charge_ledger.c.job_id == job_id)
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == expected


# --- 3. links from the configured base URL, not the client's Host ------------------------------

def test_links_point_at_the_configured_base_url_never_at_the_clients_host():
    from starlette.requests import Request

    from api import deps
    from api.settings import ApiSettings

    request = Request({"type": "http", "method": "GET", "path": "/", "headers": [(b"host", b"evil.example:666")],
                       "scheme": "http", "server": ("127.0.0.1", 8123), "query_string": b""})
    for settings, expected in (
        (ApiSettings(port=8123), "http://127.0.0.1:8123"),
        (ApiSettings(host="0.0.0.0", port=8123), "http://127.0.0.1:8123"),
        (ApiSettings(host="10.1.2.3", port=9000), "http://10.1.2.3:9000"),
        (ApiSettings(public_base_url="https://acs.example.org/", port=8123), "https://acs.example.org"),
        (ApiSettings(trust_host_header=True, port=8123), "http://evil.example:666"),  # only when told to
    ):
        assert deps.base_url(request, settings) == expected
