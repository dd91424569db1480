"""What one key can cost an API replica, against the real app: the list carries no links, a
key holds at most its share of the long-poll slots, requests without a valid key are limited
per client address before the job store is asked, and a failed job's `error` names a
reference, never the run's own text (the details are in the log under that reference).

The harvest tests use the session's `harvest_api` (real uvicorn, SQLite job store, runs as
files: tests/api_fixtures.py); the address limit uses an app served in the test process
(`serve_in_thread`), so the job store's statements can be counted with an SQLAlchemy event.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from sqlalchemy import event

from testbed import http_calls
from tests.api_fixtures import serve_in_thread, set_run
from tests.test_api_jobs import _auth, _get, _submit, _until, done_job  # noqa: F401 - done_job is a fixture


@pytest.fixture(scope="module")
def key(harvest_api) -> str:
    return harvest_api.make_key(name="bounds", small=50)


# --- the list --------------------------------------------------------------------------------

def test_the_list_carries_no_links_and_a_read_does(harvest_api, key, done_job):
    """Before, each page signed every link of every done job on the event loop (100 jobs ×
    4,096 shards was 409,600 signatures a call)."""
    page = http_calls.get(f"{harvest_api.base_url}/harvest", headers=_auth(key), params={"limit": 100}, timeout=60).json()
    listed = next(j for j in page["data"] if j["job_id"] == done_job["job_id"])
    assert listed["status"] == "done" and listed["result"]["n_shards"] == done_job["result"]["n_shards"]
    assert listed["result"]["tokens"] == done_job["result"]["tokens"]
    assert not {"shard_urls", "manifest_url", "stats_url"} & {k for k, v in listed["result"].items() if v is not None}
    assert "urls_expire_at" not in listed and "/v1/files/" not in str(page)
    read = _get(harvest_api, key, done_job["job_id"]).json()
    assert len(read["result"]["shard_urls"]) == read["result"]["n_shards"] and read["result"]["manifest_url"]
    # The page size stays capped.
    too_many = http_calls.get(f"{harvest_api.base_url}/harvest", headers=_auth(key), params={"limit": 101}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "limit"


# --- long-poll slots --------------------------------------------------------------------------

def test_one_key_cannot_take_every_long_poll_slot(harvest_api, key):
    """The replica has 2 slots (`harvest_api`); a key holds at most its share (one). Before,
    the first key to ask took both and every other key's reads were declined."""
    other = harvest_api.make_key(name="bounds-other", small=5)
    mine, theirs = _submit(harvest_api, key)["job_id"], _submit(harvest_api, other)["job_id"]
    holder = threading.Thread(target=_get, args=(harvest_api, key, mine), kwargs={"wait": 4})
    holder.start()
    harvest_api.wait_for_longpoll_waiters(1)
    started = time.monotonic()
    second = _get(harvest_api, key, mine, wait=10)
    assert time.monotonic() - started < 1.5
    assert second.status_code == 200 and second.json()["status"] == "pending"
    assert second.headers["X-Acs-Longpoll"] == "declined" and second.headers["Retry-After"] == "3"
    # Another key still gets a slot: its read waits until its job changes.
    threading.Timer(1.0, set_run, (harvest_api, theirs, "running")).start()
    started = time.monotonic()
    waited = _get(harvest_api, other, theirs, wait=10)
    assert "X-Acs-Longpoll" not in waited.headers and waited.json()["status"] == "running"
    assert 0.8 < time.monotonic() - started < 4
    holder.join()
    for job, owner in ((mine, key), (theirs, other)):
        http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=_auth(owner), timeout=30)


# --- callers without a valid key ---------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_app(job_store):
    """The app on the session's job store with an address limit of 5 requests without a valid
    key (then 1 every 100 s), under uvicorn in a thread; the tests read the models route (a read
    with a key)."""
    from api.app import create_app
    from api.ratelimit import AddressLimiter

    limiter = AddressLimiter(per_s=0.01, burst=5)
    with serve_in_thread(create_app(store=job_store, anonymous_limiter=limiter)) as root:
        yield f"{root}/v1", limiter


def test_requests_without_a_valid_key_are_limited_per_address_before_the_job_store(keyed_app, job_store):
    """Once the address is empty, a request without a key costs no statement; made-up keys of
    a key's shape cost only the replica's reads of the key list, one a second at most
    (`api.ratelimit.KnownKeys`), however many arrive: never one lookup per request."""
    from concurrent.futures import ThreadPoolExecutor

    from api.auth import create_key
    from api.ratelimit import KEY_LIST_EVERY_S

    base_url, limiter = keyed_app
    valid = create_key("bounds-valid", engine=job_store.db)[0]
    statements: list[str] = []

    def count(conn, cursor, statement, *args):
        statements.append(statement)

    engine = job_store.db
    event.listen(engine, "before_cursor_execute", count)
    try:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            # A valid key spends nothing of its address's tokens.
            for _ in range(8):
                assert client.get("/models", headers=_auth(valid)).status_code == 200
            for _ in range(5):  # the burst: unknown keys are looked up, and refused
                assert client.get("/models", headers=_auth("acs_" + "x" * 43)).status_code == 401
            assert statements, "an unknown key is looked up in the job store"
            statements.clear()
            flood = [client.get("/models") for _ in range(10)]  # no key at all
            assert statements == [], f"{len(statements)} job-store statements for keyless requests refused by address"
            reads = limiter.known.reads
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                flood += pool.map(lambda _: client.get("/models", headers=_auth("acs_" + "y" * 43)), range(40))
            elapsed = time.monotonic() - started
        assert {r.status_code for r in flood} == {429}, {r.status_code for r in flood}
        error = flood[0].json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "valid API key" in error["message"]
        assert int(flood[0].headers["Retry-After"]) >= 1
        key_list_reads = limiter.known.reads - reads
        assert 1 <= key_list_reads <= elapsed / KEY_LIST_EVERY_S + 1, (key_list_reads, elapsed)
        assert all(s == "BEGIN IMMEDIATE" or ("key_hash" in s and "FROM api_keys" in s) for s in statements), statements
        assert len([s for s in statements if "FROM api_keys" in s]) == key_list_reads
    finally:
        event.remove(engine, "before_cursor_execute", count)


# --- job errors ---------------------------------------------------------------------------------

def test_a_failed_jobs_error_names_a_reference_and_its_details_stay_in_the_log(harvest_api, key):
    """Before, a run's failure message went into the job as it was: an engine server's log
    tail with host paths, socket names and memory figures."""
    tail = ("RuntimeError: the engine server of group gpu0 did not answer within 180 s:\n"
            "Traceback ... /home/ops/.harvest/engines/gpu0.sock refused; RSS 11.7 GB of 24 GB")
    job = _submit(harvest_api, key)["job_id"]
    set_run(harvest_api, job, "running")
    set_run(harvest_api, job, "failed", tail)
    body = _until(harvest_api, key, job, "failed")
    match = re.fullmatch(r"internal_error: (.+) \(ref ([0-9a-f]{12})\)", body["error"])
    assert match, body["error"]
    assert "/" not in body["error"] and "GB" not in body["error"] and "sock" not in body["error"]
    assert body["tokens"] == 0
    deadline = time.monotonic() + 10
    while f"ref {match[2]}" not in harvest_api.log.read_text():
        assert time.monotonic() < deadline, "the reference is not in the API's log"
        time.sleep(0.1)
    logged = next(line for line in harvest_api.log.read_text().splitlines() if f"ref {match[2]}" in line)
    assert "gpu0" in logged and job in logged


def test_a_runs_error_is_from_the_vocabulary_with_a_reference():
    """What the flow records when a run fails (`flows.harvest.ending`)."""
    from harvest.errors import JOB_ERROR, ActivationPromptTooLong, job_error

    lost, ref = job_error(RuntimeError("engine server exited: see /var/lib/harvest/engines/g0.log (RSS 11.7 GB)"))
    assert lost == f"engine_failed: The engine running this harvest failed. (ref {ref})" and JOB_ERROR.match(lost)
    disk, _ = job_error(FileNotFoundError(2, "No such file", "/srv/harvest/storage/jobs/x/shard_00000.safetensors"))
    assert disk.startswith("storage_failed: ") and "/srv" not in disk
    ours, _ = job_error(ActivationPromptTooLong("The prompt has 9 tokens, over the cap of 8."))
    assert ours.startswith("activation_prompt_too_long: The prompt has 9 tokens, over the cap of 8. (ref ")
