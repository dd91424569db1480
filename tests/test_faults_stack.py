"""Faults of the stack's own parts under a real job (`tests.faults_fixtures`: the session's
Prefect server and workers, an API on PostgreSQL): the Prefect server restarted mid-job, a
PostgreSQL connection killed mid-admission, the API SIGKILLed between admission and run start.

"Charged once" is read from the charge ledger with SQL and compared with the manifest the
run wrote (token counts of its own), never with the column that did the charging.
"""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import psycopg
from sqlalchemy import create_engine, text

from testbed import http_calls
from tests.slow_engine import slow_shards

pytest_plugins = ["tests.faults_fixtures"]


def _manifest_tokens(faults_api, job_id: str) -> int:
    """Token count from the manifest on storage, summed from its per-shard counts."""
    from harvest.jobfiles import JobFiles

    manifest = JobFiles.for_job(job_id, faults_api.server.storage()).read_manifest()
    return sum(sum(s["token_counts"]) for s in manifest["shards"])


def _assert_charged_once(faults_api, job: dict) -> None:
    rows = faults_api.ledger(job["job_id"])
    assert len(rows) == 1, rows
    assert rows[0]["outcome"] == job["status"]
    expected = _manifest_tokens(faults_api, job["job_id"]) if job["status"] == "done" else 0
    assert rows[0]["tokens_charged"] == job["tokens"] == expected


def _submit(faults_api, request: dict, timeout: float = 60) -> httpx.Response:
    return http_calls.post(f"{faults_api.base_url}/harvest", headers=faults_api.auth, json=request, timeout=timeout)


def _prefect_runs_of(job_id: str) -> list:
    """Every flow run of the job in Prefect (the parent is named after the job id)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[job_id])))


def test_prefect_server_restarted_mid_job_ends_done_and_charged_once(faults_api, prefect_server, harvest_home):
    from fleet.processes import start_server
    from tests.prefect_fixtures import server_env

    faults_api.flow_env(**slow_shards(1.0))
    try:
        answer = _submit(faults_api, {"model": "llama-tiny", "prompts": [f"restart {i}" for i in range(8)], "shard_size": 1, "layers": [2]})
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["job_id"]
        deadline = time.monotonic() + 120
        while (job := faults_api.read(job_id))["progress"]["shards_done"] < 1:
            assert job["status"] in ("pending", "running") and time.monotonic() < deadline, job
            time.sleep(0.3)
    finally:
        faults_api.flow_env()

    port = int(prefect_server.api_url.rsplit(":", 1)[1].split("/")[0])
    prefect_server.process.stop()  # SIGTERM; the session fixture stops whichever process is current
    down_at = time.monotonic()
    assert faults_api.read(job_id)["status"] == "running"  # the API answers from its store meanwhile
    prefect_server.process, _ = start_server(harvest_home / "prefect-server", port, server_env(prefect_server.auth), timeout=120)
    print(f"Prefect server down for {time.monotonic() - down_at:.1f} s")

    job = faults_api.wait(job_id, timeout=240)
    assert job["status"] == "done", job
    assert job["progress"] == {"shards_done": 8, "n_shards": 8}
    _assert_charged_once(faults_api, job)
    assert len(_prefect_runs_of(job_id)) == 1  # the same run went on (or resumed), no second one


def _key_id(engine, key: str) -> str:
    with engine.connect() as conn:
        return conn.execute(text("SELECT id FROM api_keys WHERE key_hash = :h"), {"h": hashlib.sha256(key.encode()).hexdigest()}).scalar_one()


def _blocked_by(conn: psycopg.Connection, pid: int, timeout: float = 30) -> int:
    """The backend waiting on a lock held by backend `pid` (the API's admission)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)).fetchone()
        if row:
            return row[0]
        time.sleep(0.05)
    raise AssertionError("no admission waited on the key's row")


def test_postgres_connection_killed_mid_admission_fails_clean_or_admits_never_half(faults_api):
    """The admission locks the lane's row, then the key's: a lock on the key's row taken here
    holds it in mid-transaction, where its connection is killed with pg_terminate_backend."""
    engine = create_engine(faults_api.pg_url)
    key_id = _key_id(engine, faults_api.key)
    schema = faults_api.pg_url.split("search_path%3D", 1)[1]
    dsn = faults_api.pg_url.replace("postgresql+psycopg://", "postgresql://").split("?", 1)[0]

    def count_jobs() -> int:
        with engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM jobs WHERE key_id = :k"), {"k": key_id}).scalar_one()

    try:
        jobs_before = count_jobs()
        folders_before = set(faults_api.server.storage().child("jobs").listdir())
        answers: list = []
        with psycopg.connect(dsn, options=f"-csearch_path={schema}") as holder:
            holder.execute("SELECT id FROM api_keys WHERE id = %s FOR UPDATE", (key_id,))  # in a transaction
            submit = threading.Thread(target=lambda: answers.append(
                _submit(faults_api, {"model": "llama-tiny", "prompts": ["killed mid-admission"], "layers": [1]})))
            submit.start()
            with psycopg.connect(dsn, autocommit=True) as admin:
                victim = _blocked_by(admin, holder.info.backend_pid)
                assert admin.execute("SELECT pg_terminate_backend(%s)", (victim,)).fetchone()[0] is True
            holder.rollback()
            submit.join(60)
        (answer,) = answers
        assert answer.status_code in (202, 500, 503), answer.text
        if answer.status_code == 202:  # admitted whole: a row, a run and its request
            job = answer.json()
            assert count_jobs() == jobs_before + 1
            assert faults_api.server.storage().exists(f"jobs/{job['job_id']}/request.json")
            _assert_charged_once(faults_api, faults_api.wait(job["job_id"]))
        else:  # refused whole: the service's error body, no row, no files
            error = answer.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
            assert count_jobs() == jobs_before
            assert set(faults_api.server.storage().child("jobs").listdir()) == folders_before
        # The next submit gets a healthy connection from the pool.
        again = _submit(faults_api, {"model": "llama-tiny", "prompts": ["after the kill"], "layers": [1]})
        assert again.status_code == 202, again.text
        _assert_charged_once(faults_api, faults_api.wait(again.json()["job_id"]))
        print(f"answer to the killed admission: {answer.status_code} {answer.text[:200]}")
    finally:
        engine.dispose()


def test_api_killed_between_admission_and_run_start_is_started_once_by_the_watcher(faults_api):
    """The API's request to Prefect to create the run is forwarded, and its answer held: the
    run exists, the API has not heard of it. SIGKILL the API there; restarted, its watcher
    finds the job without a run (HARVEST_ORPHAN_AFTER_S=1) and starts it with the same
    idempotency key, so Prefect hands back the same run: one run, done, charged once."""
    held = faults_api.proxy.add("POST", "/create_flow_run", "hold", count=1)
    outcome: list = []

    def submit() -> None:
        try:
            outcome.append(_submit(faults_api, {"model": "llama-tiny", "prompts": ["killed mid-submit", "and again"], "layers": [3]}, timeout=120))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=submit)
    thread.start()
    try:
        assert held.reached.wait(60), "the API never asked Prefect for a run"
        faults_api.server.kill()
    finally:
        held.release()
    thread.join(30)
    assert isinstance(outcome[0], httpx.HTTPError), outcome  # the client never got an answer

    engine = create_engine(faults_api.pg_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT id, status, flow_run_id FROM jobs WHERE key_id = :k ORDER BY created_at DESC LIMIT 1"),
                               {"k": _key_id(engine, faults_api.key)}).mappings().one()
        # Admitted, its run created in Prefect, and the API died before recording it.
        assert (row["status"], row["flow_run_id"]) == ("pending", None), row
        job_id = row["id"]
        assert len(_prefect_runs_of(job_id)) == 1
        faults_api.server.start()
        job = faults_api.wait(job_id)
        assert job["status"] == "done", job
        runs = _prefect_runs_of(job_id)
        assert len(runs) == 1 and str(runs[0].id) == job["run_id"], runs
        _assert_charged_once(faults_api, job)
        listed = http_calls.get(f"{faults_api.base_url}/harvest", headers=faults_api.auth).json()["data"]
        assert job_id in {j["job_id"] for j in listed}  # the owner sees it, though the submit never answered
    finally:
        engine.dispose()
