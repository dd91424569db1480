"""The orchestration layer's pure parts, no server: shard splitting, the job-state mapping,
the job-folder layout and progress, the retention sweep, deployment file and pool limits."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from uuid import uuid4

import pytest

from flows.harvest import split_ranges
from flows.jobs import job_storage, read_progress, read_request, write_request
from flows.retention import expired_jobs, sweep
from harvest.request import HarvestRequest
from harvest.storage import Storage


@pytest.mark.parametrize(
    "n, workers, expected",
    [
        (3, 2, [[0, 2], [2, 3]]),
        (10, 3, [[0, 4], [4, 7], [7, 10]]),
        (2, 5, [[0, 1], [1, 2]]),
        (7, 1, [[0, 7]]),
    ],
)
def test_split_ranges_are_contiguous_and_balanced(n, workers, expected):
    assert split_ranges(n, workers) == expected


def _run(state_type: str, run_count: int = 0, message: str | None = None):
    from prefect.client.schemas.objects import FlowRun, State, StateType

    return FlowRun(flow_id=uuid4(), state=State(type=StateType(state_type), message=message), run_count=run_count)


@pytest.mark.parametrize(
    "state, run_count, status",
    [
        ("SCHEDULED", 0, "pending"),
        ("PENDING", 0, "pending"),
        ("SCHEDULED", 1, "running"),  # rescheduled by the reaper after it had started
        ("RUNNING", 1, "running"),
        ("COMPLETED", 1, "done"),
        ("FAILED", 1, "failed"),
        ("CRASHED", 1, "failed"),
        ("CANCELLING", 1, "cancelled"),
        ("CANCELLED", 0, "cancelled"),
    ],
)
def test_job_status_from_flow_run_state(state, run_count, status):
    from flows.submit import job_status

    assert job_status(_run(state, run_count)) == status


def test_request_round_trip_and_progress_counts_shard_records(tmp_path):
    storage = Storage(f"file://{tmp_path}")
    request = HarvestRequest(model="llama-tiny", prompts=["a", "b", "c"], shard_size=2)
    url = write_request("job-1", request, storage)
    assert url == f"file://{tmp_path}/jobs/job-1/request.json"
    job = job_storage(url)
    assert read_request(job) == request
    assert read_progress(job) == {"shards_done": 0, "n_shards": 2}
    job.write_bytes("_parts/shard_00000.safetensors", b"x")
    job.write_bytes("_progress.json", json.dumps({"stage": "forward", "shards_done": 99}).encode())
    assert read_progress(job) == {"shards_done": 1, "n_shards": 2, "stage": "forward"}
    with pytest.raises(ValueError):
        job_storage(f"file://{tmp_path}/jobs/job-1/other.json")


def _job(root: Storage, job_id: str, ended: datetime | None) -> Storage:
    job = root.child(f"jobs/{job_id}")
    job.write_bytes("request.json", b"{}")
    job.write_bytes("shard_00000.safetensors", b"data")
    if ended is not None:
        job.write_bytes("manifest.json", json.dumps({"created_at": ended.isoformat()}).encode())
    return job


def test_retention_sweep_deletes_only_expired_job_folders(tmp_path):
    import os

    root = Storage(f"file://{tmp_path}")
    now = datetime.now(timezone.utc)
    old = _job(root, "old", now - timedelta(days=31))
    fresh = _job(root, "fresh", now - timedelta(days=29))
    running = _job(root, "running", None)  # no manifest, request just written
    abandoned = _job(root, "abandoned", None)
    stale = (now - timedelta(days=40)).timestamp()
    os.utime(abandoned.path("request.json"), (stale, stale))

    assert sorted(expired_jobs(root, 30)) == ["abandoned", "old"]
    assert sorted(sweep(root, 30, dry_run=True)) == ["abandoned", "old"]
    assert old.exists("manifest.json")  # a dry run deletes nothing
    assert sorted(sweep(root, 30)) == ["abandoned", "old"]
    assert not old.exists("manifest.json") and not old.exists("shard_00000.safetensors")
    assert not abandoned.exists("request.json")
    assert fresh.exists("manifest.json") and running.exists("request.json")
    assert root.child("jobs").listdir() == ["fresh", "running"]


def test_prefect_yaml_declares_the_pools_and_deployments(monkeypatch):
    from flows.deploy import load_spec, pool_limit

    spec = load_spec()
    pools = {p["name"]: p for p in spec["pools"]}
    assert {n: (p["type"], pool_limit(p)) for n, p in pools.items()} == {"small": ("process", 3), "large": ("process", 1)}
    assert {d["name"] for d in spec["deployments"]} == {"harvest-small", "harvest-large", "corpus-refresh", "retention-sweep"}
    monkeypatch.setenv("HARVEST_POOL_LIMIT_LARGE", "2")
    monkeypatch.setenv("HARVEST_POOL_LIMIT_SMALL", "none")
    assert pool_limit(pools["large"]) == 2 and pool_limit(pools["small"]) is None
