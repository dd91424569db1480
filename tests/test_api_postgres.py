"""The whole app on PostgreSQL (127.0.0.1:5432, database `test`, a schema of its own): the same
code as on SQLite, with the 20-submit race admitting exactly 3 and each cancel charged by the
rule, once, as the charge ledger records it."""

from __future__ import annotations

import threading

import httpx
import pytest

from testbed import http_calls
from tests.api_fixtures import pg_api_server, set_run


@pytest.fixture(scope="module")
def pg_api(harvest_home, tiny):
    # The race is the store's: twenty submits of one key are admitted one after another (the
    # replica's per-key share), and on a loaded machine the last of them can wait past the
    # default 20 s for its turn and be answered 503 `replica_busy`, which says nothing of the store.
    yield from pg_api_server(harvest_home, "postgres", {"HARVEST_ADMISSION_WAIT_S": "120"})


def test_race_and_charging_on_postgresql(pg_api):
    key = pg_api.make_key(name="pg", small=3)
    auth = {"Authorization": f"Bearer {key}"}
    barrier = threading.Barrier(20)
    answers: list[httpx.Response] = []

    def submit():
        barrier.wait()
        answers.append(http_calls.post(f"{pg_api.base_url}/harvest", headers=auth, timeout=60,
                                       json={"model": "llama-tiny", "prompts": ["race"]}))

    threads = [threading.Thread(target=submit) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in answers) == [202] * 3 + [429] * 17
    jobs = [r.json() for r in answers if r.status_code == 202]

    set_run(pg_api, jobs[0]["job_id"], "running")
    for _ in range(100):
        if http_calls.get(f"{pg_api.base_url}/harvest/{jobs[0]['job_id']}", headers=auth).json()["status"] == "running":
            break
    started = http_calls.delete(f"{pg_api.base_url}/harvest/{jobs[0]['job_id']}", headers=auth).json()
    assert (started["status"], started["tokens"]) == ("cancelled", jobs[0]["reserved_tokens"])
    for job in jobs[1:]:
        early = http_calls.delete(f"{pg_api.base_url}/harvest/{job['job_id']}", headers=auth).json()
        assert (early["status"], early["tokens"]) == ("cancelled", 0)
    listed = http_calls.get(f"{pg_api.base_url}/harvest", headers=auth).json()["data"]
    assert {j["job_id"] for j in listed} == {j["job_id"] for j in jobs}
    # Charged once each, by the ledger on PostgreSQL: the started one its reservation, the others 0.
    from sqlalchemy import text

    engine = pg_api.engine()
    try:
        with engine.connect() as conn:
            rows = {tuple(r) for r in conn.execute(text("SELECT job_id, outcome, tokens_charged FROM charge_ledger"))}
    finally:
        engine.dispose()
    assert rows == {(jobs[0]["job_id"], "cancelled", jobs[0]["reserved_tokens"])} | {
        (job["job_id"], "cancelled", 0) for job in jobs[1:]}
    created = [j["created_at"] for j in listed]
    assert created == sorted(created, reverse=True)  # newest first


def test_a_nul_byte_in_a_job_id_or_cursor_is_the_404_sqlite_gives(pg_api):
    """PostgreSQL takes no NUL in text (psycopg raises DataError): such an id names no job, as on
    SQLite, and nothing reaches a 500. A NUL inside a stored value is refused with a 400."""
    key = pg_api.make_key(name="pg-nul", small=3)
    auth = {"Authorization": f"Bearer {key}"}
    for path, params in (("/harvest/%00", None), ("/harvest/a%00b", None), ("/harvest", {"after": "\x00"})):
        response = http_calls.get(f"{pg_api.base_url}{path}", headers=auth, params=params, timeout=60)
        assert response.status_code == 404, (path, response.status_code, response.text[:300])
        assert response.json()["error"]["code"] == "harvest_job_not_found"
    response = http_calls.delete(f"{pg_api.base_url}/harvest/%00", headers=auth, timeout=60)
    assert response.status_code == 404, response.text[:300]
    # A NUL inside a prompt is text: the job is admitted and its request stored whole.
    submitted = http_calls.post(f"{pg_api.base_url}/harvest", headers=auth, timeout=60,
                                json={"model": "llama-tiny", "prompts": ["a\x00b"]})
    assert submitted.status_code == 202, submitted.text[:300]
