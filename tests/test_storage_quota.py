"""The per-key storage quota through the real app (SQLite and PostgreSQL): a submit whose
admitted bytes would take the key's kept files past its quota is 429 storage_quota_exceeded
naming the bytes, creates no job and charges nothing (the charge ledger says so); a done job
holds the bytes its folder holds, and its bytes come free once its retention has passed;
`harvest keys` sets the quota and reports the bytes held.

Every byte a job keeps counts (issue 44): the bytes held are checked against the job folders
themselves, walked here with `os.walk` (and `du -b`, whose directory entries add a few KiB), never
against a figure the service wrote: a done job's, a failed job's, a cancelled job's before and
after its run stopped (a shard landing after the cancel counts), and a large prompt's, which is
kept twice more (request.json, the manifest) than its shards say. The S3 counterpart (the
bucket's listing) is in tests/test_api_s3.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, update

from api.db import charge_ledger, jobs, utcnow
from api.store import key_usage
from testbed import http_calls
from tests.api_fixtures import finish_run, pg_api_server, set_run

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


def _folder(server, job_id: str) -> Path:
    return Path(server.env["HARVEST_STORAGE_URL"].removeprefix("file://")) / "jobs" / job_id


def _walked(server, *job_ids: str) -> int:
    """Bytes of every file in these jobs' folders, walked by the operating system."""
    return sum(os.path.getsize(os.path.join(root, name))
               for job_id in job_ids for root, _, names in os.walk(_folder(server, job_id)) for name in names)


def _du(server, job_id: str) -> int:
    done = subprocess.run(["du", "-b", "-s", str(_folder(server, job_id))], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def _admitted(engine, job_id: str) -> tuple[str, int]:
    """The job's key and the bytes it was admitted for (the most its folder may hold)."""
    with engine.connect() as conn:
        key_id, size = conn.execute(select(jobs.c.key_id, jobs.c.output_bytes).where(jobs.c.id == job_id)).one()
    return key_id, size


def _held_once_not(engine, key_id: str, before: int, timeout: float = 15) -> int:
    """The key's bytes held once the watcher has changed them from `before`."""
    deadline = time.monotonic() + timeout
    while (held := _held(engine, key_id)) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def _wait_status(server, key: str, job_id: str, status: str) -> dict:
    """The job once it reads `status`. Short waits: a `?wait=` read that already finds the job
    `status` waits for the next change."""
    for _ in range(30):
        job = http_calls.get(f"{server.base_url}/harvest/{job_id}?wait=0.5", headers=_auth(key), timeout=30).json()
        if job["status"] == status:
            return job
    raise AssertionError(f"job {job_id} is {job['status']}, not {status}")


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
        assert f"keeps up to {size:,} bytes" in error["message"]
        assert f"already hold {2 * size:,} of its {quota:,}-byte storage quota" in error["message"]
        assert "Retry-After" not in refused.headers
        assert _ledger_and_jobs(engine, key_id) == before  # no job, nothing charged

        # Done: the job holds what its folder holds (shards, statistics, and the request,
        # manifest and `_parts/` records that `bytes_written` leaves out), as the usage report
        # says; never more than it was admitted for.
        finish_run(server, first, hf_engine)
        job = _wait_status(server, key, first, "done")
        kept = _walked(server, first)
        assert job["result"]["bytes_written"] < kept <= size
        row = _listed(server, key)
        assert (row["bytes_held"], row["caps"]["storage_quota"]) == (kept + size, quota)

        # Its retention has passed (the sweep deletes its files): its bytes are free again.
        with engine.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == first).values(completed_at=utcnow() - timedelta(days=31)))
        third = _post(server, key)
        assert third.status_code == 202, third.text
        assert _held(engine, key_id) == 2 * size

        # Cancelled before they started, the others keep their request.json until swept.
        for job_id in (second, third.json()["job_id"]):
            http_calls.delete(f"{server.base_url}/harvest/{job_id}", headers=_auth(key))
        assert [os.listdir(_folder(server, j)) for j in (second, third.json()["job_id"])] == [["request.json"]] * 2
        assert _held(engine, key_id) == _walked(server, second, third.json()["job_id"]) > 0
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


LONG = {"model": "llama-tiny", "prompts": ["The sky is blue and the grass is green. " * 400], "layers": [1, 3]}
"""One prompt past the context (2,048 tokens run of ~4,000): ~2.1 MB of shard, and its 16 KB
text kept whole in request.json and the manifest."""


def test_done_job_holds_its_folder(harvest_api, hf_engine):
    engine = harvest_api.engine()
    try:
        key = harvest_api.make_key(name="held-done", storage_quota=1 << 30)
        job_id = _post(harvest_api, key, LONG).json()["job_id"]
        key_id, admitted = _admitted(engine, job_id)
        assert _held(engine, key_id) == admitted  # pending: the most it can keep
        finish_run(harvest_api, job_id, hf_engine)
        job = _wait_status(harvest_api, key, job_id, "done")
        held = _held_once_not(engine, key_id, admitted)
        walked = _walked(harvest_api, job_id)
        assert held == walked and abs(held - _du(harvest_api, job_id)) <= held // 100
        assert job["result"]["bytes_written"] < walked <= admitted  # the admitted bound held
        assert len(os.listdir(_folder(harvest_api, job_id) / "_parts")) == 1  # the statistics records count
    finally:
        engine.dispose()


def test_cancelled_and_failed_jobs_hold_what_they_left(harvest_api, hf_engine):
    """Until swept, a job that did not finish holds what its folder holds: a cancelled pending
    job its request.json; a failed one what it wrote before failing; one cancelled while
    running its admitted bytes until its run has stopped, then what it left, a shard that
    landed after the cancel included."""
    from harvest.jobfiles import JobFiles
    from harvest.pipeline import tokenize_job
    from harvest.registry import load_registry
    from harvest.request import resolve_job
    from harvest.settings import Settings
    from harvest.shard.writing import run_shards

    settings = Settings(models_file=harvest_api.env["HARVEST_MODELS_FILE"], lanes_file=harvest_api.env["HARVEST_LANES_FILE"])
    registry = load_registry(settings)

    def write_shard(job_id: str, k: int) -> None:
        """Shard k of the job and its `_parts/` record, as the job's run writes them."""
        files = JobFiles.for_job(job_id, harvest_api.storage())
        job = resolve_job(files.read_request(), registry)
        run_shards(job, files.storage, hf_engine, [k], tokenized=tokenize_job(job))

    body = {"model": "llama-tiny", "prompts": ["The sky is", "Grass is", "Water is"], "layers": [1], "shard_size": 1}
    engine = harvest_api.engine()
    flag = Path(harvest_api.env["HARVEST_TEST_RUNS_DIR"]) / "cancel-leaves-cancelling"
    try:
        # Cancelled while pending: its request.json, measured by the cancel itself.
        key = harvest_api.make_key(name="held-pending")
        pending = _post(harvest_api, key, body).json()["job_id"]
        assert http_calls.delete(f"{harvest_api.base_url}/harvest/{pending}", headers=_auth(key)).json()["status"] == "cancelled"
        assert os.listdir(_folder(harvest_api, pending)) == ["request.json"]
        assert _held(engine, _admitted(engine, pending)[0]) == _walked(harvest_api, pending) > 0

        # Failed after one of its three shards: that shard, its record and the request.
        key = harvest_api.make_key(name="held-failed")
        failed = _post(harvest_api, key, body).json()["job_id"]
        key_id, admitted = _admitted(engine, failed)
        set_run(harvest_api, failed, "running")
        _wait_status(harvest_api, key, failed, "running")
        write_shard(failed, 0)
        set_run(harvest_api, failed, "failed", "CUDA out of memory")
        _wait_status(harvest_api, key, failed, "failed")
        held = _held_once_not(engine, key_id, admitted)
        assert held == _walked(harvest_api, failed) > 0
        assert sorted(os.listdir(_folder(harvest_api, failed))) == ["_parts", "request.json", "shard_00000.safetensors"]

        # Cancelled while running: its run is still stopping, so the admitted bytes count; a
        # shard lands after the cancel; once the run is Cancelled, what it left counts.
        key = harvest_api.make_key(name="held-cancelled")
        running = _post(harvest_api, key, body).json()["job_id"]
        key_id, admitted = _admitted(engine, running)
        set_run(harvest_api, running, "running")
        _wait_status(harvest_api, key, running, "running")
        write_shard(running, 0)
        flag.touch()
        try:
            cancelled = http_calls.delete(f"{harvest_api.base_url}/harvest/{running}", headers=_auth(key))
        finally:
            flag.unlink()
        assert cancelled.json()["status"] == "cancelled"
        assert _held(engine, key_id) == admitted >= _walked(harvest_api, running)
        write_shard(running, 1)  # the shard in flight lands
        time.sleep(0.5)  # ticks of the watcher (0.2 s) while the run is Cancelling: nothing measured yet
        assert _held(engine, key_id) == admitted
        set_run(harvest_api, running, "cancelled", state_name="Cancelled")
        held = _held_once_not(engine, key_id, admitted)
        assert held == _walked(harvest_api, running)
        assert {"shard_00000.safetensors", "shard_00001.safetensors"} <= set(os.listdir(_folder(harvest_api, running)))
    finally:
        engine.dispose()


def test_a_large_prompt_is_counted_where_it_is_kept(harvest_api, hf_engine):
    """Issue 44's story, scaled down: a 1 MB prompt of one layer writes ~1 MB of shard, and is
    kept again in request.json and in the manifest. A quota that two jobs' shards fit in
    admits one such job, and refuses the second, before and after the first is done."""
    prompt = "The sky is blue and the grass is green. " * 25_000  # 1,000,000 characters
    body = {"model": "llama-tiny", "prompts": [prompt], "layers": [1]}
    quota = 4 << 20
    engine = harvest_api.engine()
    try:
        key = harvest_api.make_key(name="held-large", storage_quota=quota)
        first = _post(harvest_api, key, body)
        assert first.status_code == 202, first.text
        first = first.json()["job_id"]
        refused = _post(harvest_api, key, body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "storage_quota_exceeded", refused.text

        finish_run(harvest_api, first, hf_engine)
        _wait_status(harvest_api, key, first, "done")
        key_id, _ = _admitted(engine, first)
        folder = _folder(harvest_api, first)
        shards = os.path.getsize(folder / "shard_00000.safetensors")
        walked = _walked(harvest_api, first)
        assert 2 * shards < quota  # counting shards alone, two jobs would fit
        assert walked >= shards + 2 * len(prompt)  # the prompt, whole, in request.json and the manifest
        assert _held(engine, key_id) == walked
        again = _post(harvest_api, key, body)
        assert again.status_code == 429, again.text
        assert f"already hold {walked:,} of its {quota:,}-byte storage quota" in again.json()["error"]["message"]
    finally:
        engine.dispose()
