"""Faults on the last two writes of a job, the statistics file and the manifest, on S3.

The same rig as `tests/test_faults_storage.py` (moto's S3 server behind `tests.fault_proxy`,
flow runs of the session's Prefect workers with botocore's own attempts set to 2): a fault
that outlasts botocore's attempts is retried by the service's own task
(`tasks.shards.finalize_job`, retried twice on a storage error) and the job completes; one
that never ends fails the job with `storage_failed` and leaves no manifest, so the job is
recorded failed and charged nothing (the watcher charges a failed run 0: `tests/test_faults.py`).
One shard per job keeps each run short.
"""

from __future__ import annotations

import json

import pytest

from tests.fault_proxy import INJECTED_MESSAGE
from tests.test_faults_storage import CLIENT_ATTEMPTS, _objects, _submit_s3, s3, s3_proxy  # noqa: F401 (fixtures)

REQUEST = {"model": "llama-tiny", "prompts": ["finalize fault one", "finalize fault two"], "shard_size": 2, "layers": [1, 5]}


def test_stats_and_manifest_writes_failing_past_botocore_are_retried_and_the_job_completes(harvest_stack, s3_proxy, s3):  # noqa: F811
    """Every botocore attempt of the first statistics write fails, then every attempt of the
    first manifest write: only the task's own retries get them through."""
    s3_proxy.clear()
    s3_proxy.add("PUT", "/stats.safetensors", "error", count=CLIENT_ATTEMPTS)
    s3_proxy.add("PUT", "/manifest.json", "error", count=CLIENT_ATTEMPTS)
    job_id, run_id = _submit_s3(harvest_stack, s3_proxy, REQUEST)
    status = harvest_stack.wait(run_id, timeout=180)
    assert status.status == "done", status
    assert s3_proxy.count("PUT", f"{job_id}/stats.safetensors") >= CLIENT_ATTEMPTS + 1
    assert s3_proxy.count("PUT", f"{job_id}/manifest.json") == CLIENT_ATTEMPTS + 1
    objects = _objects(s3, job_id)
    manifest = json.loads(objects["manifest.json"])
    assert [s["file"] for s in manifest["shards"]] == ["shard_00000.safetensors"]
    assert manifest["tokens"] == sum(manifest["shards"][0]["token_counts"])
    assert "stats.safetensors" in objects


@pytest.mark.parametrize("name", ["stats.safetensors", "manifest.json"])
def test_a_stats_or_manifest_write_failing_for_good_fails_the_job_with_no_manifest(harvest_stack, s3_proxy, s3, name):  # noqa: F811
    s3_proxy.clear()
    s3_proxy.add("PUT", f"/{name}", "error", count=10**6)
    job_id, run_id = _submit_s3(harvest_stack, s3_proxy, REQUEST)
    status = harvest_stack.wait(run_id, timeout=180)
    assert status.status == "failed", status
    # botocore's attempts, then the task's two retries with as many again each, then it gives up.
    assert s3_proxy.count("PUT", f"{job_id}/{name}") == 3 * CLIENT_ATTEMPTS
    assert status.message.startswith("storage_failed: ") and "(ref " in status.message, status.message
    assert INJECTED_MESSAGE not in status.message
    objects = _objects(s3, job_id)
    assert "manifest.json" not in objects
    assert "shard_00000.safetensors" in objects  # kept for a resume
    if name == "stats.safetensors":
        assert s3_proxy.count("PUT", f"{job_id}/manifest.json") == 0  # never tried without its statistics
