"""The orchestration layer's pure parts, no server: shard splitting, the job-state mapping,
the scale-out take-over decision, the job-folder layout and progress, the retention sweep,
deployment file and pool limits, the flows' settings."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from uuid import uuid4

import pytest

from harvest.placement import COLLECT, RECOMPUTE, TAKE_OVER, WAIT, helper_action, split_ranges
from flows.retention import expired_jobs, sweep
from harvest.jobfiles import JobFiles
from harvest.request import HarvestRequest
from harvest.settings import Settings, get_settings
from harvest.storage import Storage, StorageOptions


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
        ("SCHEDULED", 1, "running"),  # rescheduled after its host died, having started
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
    files = JobFiles.for_job("job-1", storage)
    url = files.write_request(request)
    assert url == files.request_url == f"file://{tmp_path}/jobs/job-1/request.json"
    job = JobFiles.from_request_url(url, StorageOptions())
    assert job.url == f"file://{tmp_path}/jobs/job-1" and JobFiles.job_ids(storage) == ["job-1"]
    assert job.read_request() == request
    assert job.read_progress() == {"shards_done": 0, "n_shards": 2}
    job.storage.write_bytes("_parts/shard_00000.safetensors", b"x")
    job.storage.write_bytes("_parts/timings-00001-00002.json", b"{}")  # a helper's timings: not a shard
    job.storage.write_bytes("_progress.json", json.dumps({"stage": "forward", "shards_done": 99}).encode())
    assert job.shards_done() == 1
    assert job.read_progress() == {"shards_done": 1, "n_shards": 2, "stage": "forward"}
    with pytest.raises(ValueError):
        JobFiles.from_request_url(f"file://{tmp_path}/jobs/job-1/other.json", StorageOptions())


def test_job_folder_names_are_the_spec_layout(tmp_path):
    files = JobFiles.for_job("j", Storage(f"file://{tmp_path}"))
    assert (files.shard_name(3), files.part_name(3)) == ("shard_00003.safetensors", "_parts/shard_00003.safetensors")
    assert files.shard_names(2) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert (files.REQUEST, files.STATS, files.MANIFEST, files.PROGRESS) == (
        "request.json", "stats.safetensors", "manifest.json", "_progress.json"
    )
    files.write_helper_timings([2, 5], {"load_s": 1.5, "forward_s": 2.0, "save_s": 0.0, "upload_s": 0.25})
    assert files.storage.exists("_parts/timings-00002-00005.json")
    assert files.read_helper_timings([2, 5])["forward_s"] == 2.0 and files.read_helper_timings([0, 2]) is None


def test_read_result_from_the_manifest(tmp_path):
    files = JobFiles.for_job("j", Storage(f"file://{tmp_path}"))
    assert files.read_result() is None and not files.has_manifest()
    manifest = {
        "shards": [{}, {}], "layer_indices": [1, 3], "contents": "activations", "tokens": 42,
        "bytes_written": 1000, "timings": {"load_s": 1, "forward_s": 2.5, "extra_s": 9, "real_tokens": 40, "padded_tokens": 2},
        "created_at": "x",
    }
    files.storage.write_bytes("manifest.json", json.dumps(manifest).encode())
    assert files.read_result() == {
        "n_shards": 2, "layer_indices": [1, 3], "contents": "activations", "tokens": 42, "bytes_written": 1000,
        "timings": {"load_s": 1.0, "forward_s": 2.5, "save_s": 0.0, "upload_s": 0.0, "real_tokens": 40, "padded_tokens": 2},
    }
    files.discard_manifest()
    assert not files.has_manifest()
    files.discard_manifest()  # none left: nothing to do


STALL = 60.0


@pytest.mark.parametrize(
    "state, since_grace_s, unchanged_s, action",
    [
        ("COMPLETED", -10, 0, COLLECT),
        ("FAILED", -10, 0, RECOMPUTE),
        ("CANCELLED", -10, 0, RECOMPUTE),
        # Not started: the helper's own until the grace ends, then taken over.
        ("SCHEDULED", -1, 500, WAIT),
        ("SCHEDULED", 0, 0, TAKE_OVER),
        ("PENDING", -1, 0, WAIT),
        ("PENDING", 5, 5, TAKE_OVER),  # picked up, but its process never got to Running
        ("PAUSED", 1, 1, TAKE_OVER),
        # Running: waited for however long (a dead host's run is marked Crashed by Prefect).
        ("RUNNING", 10_000, 10_000, WAIT),
        # Crashed, stuck Cancelling, unknown: taken over once unchanged for the stall bound.
        ("CRASHED", 100, STALL - 1, WAIT),
        ("CRASHED", -5, STALL, TAKE_OVER),
        ("CANCELLING", 100, 10, WAIT),
        ("CANCELLING", 100, STALL + 1, TAKE_OVER),
        (None, 100, 10, WAIT),
        (None, 100, STALL, TAKE_OVER),
    ],
)
def test_helper_take_over_decision(state, since_grace_s, unchanged_s, action):
    from prefect.client.schemas.objects import StateType

    kind = None if state is None else StateType(state)
    assert helper_action(kind, since_grace_s, unchanged_s, stall_s=STALL) == action


def test_every_helper_state_but_running_ends_within_a_bound():
    from prefect.client.schemas.objects import StateType

    late = 10 * STALL
    for kind in [*StateType, None]:
        ends = helper_action(kind, late, late, stall_s=STALL) != WAIT
        assert ends == (kind != StateType.RUNNING), kind


def test_flow_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("HARVEST_HELPER_GRACE_S", "2")
    monkeypatch.setenv("HARVEST_ENGINE", "hf")
    settings = Settings()
    assert (settings.helper_grace_s, settings.engine) == (2, "hf")
    defaults = {name: field.default for name, field in Settings.model_fields.items()}
    assert (defaults["helper_grace_s"], defaults["engine"]) == (30, "auto")
    # No test throttle is left in production settings: tests slow a job down with their own engine.
    assert not [name for name in defaults if "pause" in name]
    monkeypatch.setenv("HARVEST_HELPER_GRACE_S", "-1")
    with pytest.raises(ValueError):
        Settings()
    monkeypatch.setenv("HARVEST_HELPER_GRACE_S", "2")
    monkeypatch.setenv("HARVEST_ENGINE", "tensorrt")
    with pytest.raises(ValueError, match="HARVEST_ENGINE must be auto, vllm, hf or module:Class"):
        Settings()


def _job(root: Storage, job_id: str, ended: datetime | None) -> Storage:
    files = JobFiles.for_job(job_id, root)
    job = files.storage
    job.write_bytes(files.REQUEST, b"{}")
    job.write_bytes(files.shard_name(0), b"data")
    if ended is not None:
        job.write_bytes(files.MANIFEST, json.dumps({"created_at": ended.isoformat()}).encode())
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


def test_the_lanes_file_declares_the_pools_and_deployments():
    from flows.deploy import lane_spec, load_spec
    from harvest.lanes import load_lanes

    spec = lane_spec(load_lanes(get_settings()), "python -m launcher")
    assert {p["name"]: (p["type"], p["concurrency_limit"]) for p in spec["pools"]} == {"small": ("process", 3), "large": ("process", 1)}
    assert {d["name"]: d["work_pool"]["name"] for d in spec["deployments"]} == {"harvest-small": "small", "harvest-large": "large"}
    # The run command is the caller's (the fleet's launcher); without one, Prefect's own.
    assert [d["job_variables"] for d in spec["deployments"]] == [{"command": "python -m launcher"}] * 2
    assert [d["job_variables"] for d in lane_spec(load_lanes(get_settings()), None)["deployments"]] == [{}] * 2
    assert {d["name"] for d in load_spec()["deployments"]} == {"corpus-refresh", "retention-sweep"}