"""`harvest up` on S3 (moto's server, in its own process), as an operator runs it with
`HARVEST_STORAGE_URL=s3://…`: a job's progress, read over HTTP while it runs, rises shard by
shard. The count comes from the job's run, which reports it on its flow run as each shard
lands (`flows.progress`); the stack's API watcher reads it on the run's progress event. Each
shard takes 3 s more here (`tests.slow_engine`), so every count lasts several watcher ticks.

What was written is checked against the bucket itself (boto3, not the service's storage code):
every shard and the manifest are objects of the job's folder, and nothing went to local disk.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from testbed import http_calls
from tests.api_fixtures import harvest_up
from tests.prefect_fixtures import with_migrated_database
from tests.s3_fixtures import BUCKET, CREDENTIALS
from tests.slow_engine import slow_shards

N_SHARDS = 4


@pytest.fixture(scope="module")
def s3_stack(tmp_path_factory, harvest_home, tiny, moto_s3):
    prefix = f"up-{uuid.uuid4().hex[:6]}"
    env = {
        **CREDENTIALS, **slow_shards(3),
        "HARVEST_STORAGE_URL": f"s3://{BUCKET}/{prefix}",
        "HARVEST_S3_ENDPOINT_URL": moto_s3.endpoint,
    }
    home = tmp_path_factory.mktemp("up-s3")
    with_migrated_database(home / "prefect")  # where `harvest up` keeps Prefect's database (`fleet.roles`)
    with harvest_up(home, harvest_home / "models", env) as info:
        yield {**info, "prefix": prefix, "s3": moto_s3}


def test_progress_on_harvest_up_with_s3_rises_shard_by_shard(s3_stack):
    base, auth = s3_stack["ACS_API_BASE"], {"Authorization": f"Bearer {s3_stack['ACS_API_KEY']}"}
    body = {"model": "llama-tiny", "prompts": [f"up on s3 {i}" for i in range(N_SHARDS)], "shard_size": 1, "layers": [1, 5]}
    submitted = http_calls.post(f"{base}/harvest", headers=auth, json=body, timeout=60)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job_id"]

    seen: list[int] = []
    deadline = time.monotonic() + 300
    while (job := http_calls.get(f"{base}/harvest/{job_id}", headers=auth, timeout=30).json())["status"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, (job, seen)
        if job["status"] == "running":
            seen.append(job["progress"]["shards_done"])
        time.sleep(0.2)
    assert job["status"] == "done", job
    assert job["progress"] == {"shards_done": N_SHARDS, "n_shards": N_SHARDS}
    assert seen == sorted(seen), seen
    # The count before the last lasts only until the run's end (tests/test_watcher_events.py).
    assert set(range(1, N_SHARDS - 1)) <= set(seen), f"progress read mid-run: {seen}"

    s3 = s3_stack["s3"].client
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{s3_stack['prefix']}/jobs/{job_id}/")
    names = {o["Key"].rsplit("/", 1)[-1] for o in listing.get("Contents", [])}
    assert {f"shard_{k:05d}.safetensors" for k in range(N_SHARDS)} | {"manifest.json"} <= names, names
    local = Path(s3_stack["home"]) / "storage" / "jobs" / job_id
    assert not local.exists(), f"job files on local disk at {local}"
    print(f"shards_done read while running: {seen}")
