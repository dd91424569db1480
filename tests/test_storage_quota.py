"""The per-key storage quota through the real app (SQLite and PostgreSQL): a submit whose
admitted bytes would take the key's kept files past its quota is 429 storage_quota_exceeded
naming the bytes, creates no job and charges nothing (the charge ledger says so); a done job
holds the bytes it wrote, and its bytes come free once its retention has passed; `harvest keys`
sets the quota and reports the bytes held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import func, select, update

from api.db import charge_ledger, jobs, utcnow
from api.store import key_usage
from tests import http_calls
from tests.api_fixtures import finish_run, pg_api_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK = {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, harvest_home, tiny):
    if request.param == "sqlite":
        yield request.getfixturevalue("harvest_api")
        return
    yield from pg_api_server(harvest_home, "quota")


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _post(server, key, body=OK) -> httpx.Response:
    return http_calls.post(f"{server.base_url}/harvest", headers=_auth(key), json=body, timeout=60)


def _cli(server, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, **{k: v for k, v in server.env.items() if v is not None}, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "fleet.cli", "keys", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _listed(server, key_prefix: str) -> dict:
    done = _cli(server, "list", "--json")
    assert done.returncode == 0, done.stderr
    return next(r for r in json.loads(done.stdout) if key_prefix.startswith(r["prefix"]))


def _held(engine, key_id: str) -> int:
    """The usage report's figure, in this process (the CLI's own run is checked above)."""
    with engine.connect() as conn:
        return key_usage(conn, key_id, retention_days=30)["bytes_held"]


def _ledger_and_jobs(engine, key_id: str) -> tuple:
    with engine.connect() as conn:
        ledger = conn.execute(
            select(func.count(), func.coalesce(func.sum(charge_ledger.c.tokens_charged), 0)).where(charge_ledger.c.key_id == key_id)
        ).one()
        n_jobs = conn.execute(select(func.count()).where(jobs.c.key_id == key_id)).scalar_one()
    return tuple(ledger), n_jobs


def test_quota_refuses_frees_after_retention_and_is_reported(server, hf_engine):
    engine = server.engine()
    try:
        probe = server.make_key(name="probe")
        job_id = _post(server, probe).json()["job_id"]
        with engine.connect() as conn:
            size, key_id_probe = conn.execute(select(jobs.c.output_bytes, jobs.c.key_id).where(jobs.c.id == job_id)).one()
        http_calls.delete(f"{server.base_url}/harvest/{job_id}", headers=_auth(probe))
        assert size > 0 and key_id_probe

        quota = 2 * size + size // 2  # two jobs fit, a third does not
        key = server.make_key(name="quota", small=5, storage_quota=quota)
        first, second = (_post(server, key).json()["job_id"] for _ in range(2))
        with engine.connect() as conn:
            key_id = conn.execute(select(jobs.c.key_id).where(jobs.c.id == first)).scalar_one()
        before = _ledger_and_jobs(engine, key_id)

        refused = _post(server, key)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", None)
        assert f"writes {size:,} bytes" in error["message"]
        assert f"already hold {2 * size:,} of its {quota:,}-byte storage quota" in error["message"]
        assert "Retry-After" not in refused.headers
        assert _ledger_and_jobs(engine, key_id) == before  # no job, nothing charged

        # Done: the job holds the bytes it wrote (its shards, and the statistics and manifest the
        # admitted figure leaves out), as the usage report says.
        finish_run(server, first, hf_engine)
        for _ in range(20):
            job = http_calls.get(f"{server.base_url}/harvest/{first}?wait=5", headers=_auth(key)).json()
            if job["status"] == "done":
                break
        assert job["status"] == "done", job
        written = job["result"]["bytes_written"]
        assert written > 0
        row = _listed(server, key)
        assert (row["bytes_held"], row["caps"]["storage_quota"]) == (written + size, quota)
        assert _post(server, key).json()["error"]["code"] == "storage_quota_exceeded"  # still full

        # Its retention has passed (the sweep deletes its files): its bytes are free again.
        with engine.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == first).values(completed_at=utcnow() - timedelta(days=31)))
        third = _post(server, key)
        assert third.status_code == 202, third.text
        assert _held(engine, key_id) == 2 * size

        # Cancelled before they started, the others wrote nothing: nothing is held.
        for job_id in (second, third.json()["job_id"]):
            http_calls.delete(f"{server.base_url}/harvest/{job_id}", headers=_auth(key))
        assert _held(engine, key_id) == 0
    finally:
        engine.dispose()


def test_harvest_keys_sets_the_quota(harvest_api):
    assert _cli(harvest_api, "create", "--name", "bad", "--storage-quota", "5X").returncode == 2
    created = _cli(harvest_api, "create", "--name", "cli-quota", "--storage-quota", "1K")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    row = _listed(harvest_api, key)
    assert (row["bytes_held"], row["caps"]["storage_quota"]) == (0, 1024)
    big = _post(harvest_api, key, {**OK, "prompts": ["The sky is blue and the grass is green"] * 8})
    assert big.status_code == 429, big.text
    assert "1,024-byte storage quota" in big.json()["error"]["message"]
