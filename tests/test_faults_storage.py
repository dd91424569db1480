"""Faults on the way to storage, on real flow runs of the session's Prefect workers.

S3: moto's S3 server in its own process, behind `tests.fault_proxy` (in a thread here) that
fails or stalls the next N PUTs of one shard. The flow runs get the proxy as their S3 endpoint
and a short client timeout through their environment (`HARVEST_S3_ENDPOINT_URL`, fsspec's
`FSSPEC_S3` config), nothing else; what was written is checked with boto3 straight against
moto, never through the service's own reader.

Local disk: a 256 KiB tmpfs as the job's folder, filled by the shards.
"""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import uuid

import pytest

from tests.fault_proxy import INJECTED_MESSAGE, FaultProxy
from tests.s3_fixtures import BUCKET, CREDENTIALS

PREFIX = "faults"
CLIENT_ATTEMPTS = 2  # botocore's own attempts per write (total), set for the flow runs below
# A short read timeout so that a stalled PUT costs a second, and botocore's own attempts kept
# at 2, so that the service's retry of the shard write (tasks/shards.py) shows on top of them.
FSSPEC_S3 = {"config_kwargs": {"read_timeout": 1, "connect_timeout": 2, "retries": {"total_max_attempts": CLIENT_ATTEMPTS, "mode": "standard"}}}
REQUEST = {"model": "llama-tiny", "prompts": [f"fault prompt {i}" for i in range(6)], "shard_size": 2, "layers": [1, 5]}


@pytest.fixture(scope="module")
def s3_proxy(moto_s3):
    proxy = FaultProxy(moto_s3.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def s3(moto_s3):
    return moto_s3.client


def _submit_s3(harvest_stack, proxy: FaultProxy, request: dict = REQUEST) -> tuple[str, str]:
    """Write the request through the proxy and start the job's run as the API does."""
    import s3fs

    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest
    from harvest.storage import Storage

    job_id = str(uuid.uuid4())
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True)
    files = JobFiles.for_job(job_id, Storage(f"s3://{BUCKET}/{PREFIX}", fs, f"{BUCKET}/{PREFIX}"))
    url = files.write_request(HarvestRequest.model_validate(request))
    env = {**CREDENTIALS, "HARVEST_S3_ENDPOINT_URL": proxy.url, "FSSPEC_S3": json.dumps(FSSPEC_S3)}
    run_id = start_harvest_run(job_id, url, request["model"], "small", "faults", workers=1, env=env)
    return job_id, run_id


def _objects(s3, job_id: str) -> dict[str, bytes]:
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/jobs/{job_id}/").get("Contents", [])
    return {o["Key"].rsplit("/", 1)[1]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing}


def _assert_complete(objects: dict[str, bytes]) -> None:
    """Every shard in the manifest is on S3 with the size and sha256 the manifest gives."""
    manifest = json.loads(objects["manifest.json"])
    assert [s["file"] for s in manifest["shards"]] == [f"shard_{k:05d}.safetensors" for k in range(3)]
    for shard in manifest["shards"]:
        data = objects[shard["file"]]
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard["bytes"], shard["sha256"])


def test_s3_errors_and_timeouts_on_shard_writes_are_retried_and_the_job_completes(harvest_stack, s3_proxy, s3):
    """One job, two faults (one flow run costs ~15-30 s here): shard 0's first PUT stalls past
    the client's read timeout; every botocore attempt of shard 1's first write fails, so only
    the service's own retry of the write gets it through."""
    s3_proxy.clear()
    s3_proxy.add("PUT", "/shard_00000.safetensors", "hang", count=1, hold_s=4)  # > the 1 s read timeout
    s3_proxy.add("PUT", "/shard_00001.safetensors", "error", count=CLIENT_ATTEMPTS)
    job_id, run_id = _submit_s3(harvest_stack, s3_proxy)
    status = harvest_stack.wait(run_id, timeout=180)
    assert status.status == "done", status
    assert s3_proxy.count("PUT", f"{job_id}/shard_00000.safetensors") == 2  # the stalled one, then one more
    assert s3_proxy.count("PUT", f"{job_id}/shard_00001.safetensors") == CLIENT_ATTEMPTS + 1
    assert s3_proxy.count("PUT", f"{job_id}/shard_00002.safetensors") == 1  # untouched shards once
    _assert_complete(_objects(s3, job_id))


def test_a_shard_write_failing_past_every_retry_fails_the_job_with_no_manifest(harvest_stack, s3_proxy, s3):
    s3_proxy.clear()
    s3_proxy.add("PUT", "/shard_00001.safetensors", "error", count=10**6)
    job_id, run_id = _submit_s3(harvest_stack, s3_proxy)
    status = harvest_stack.wait(run_id, timeout=180)
    assert status.status == "failed", status
    # botocore's attempts, then the service's retries of the write with as many again each,
    # then it gives up (a finite number: the run ended).
    puts = s3_proxy.count("PUT", f"{job_id}/shard_00001.safetensors")
    assert puts >= 2 * CLIENT_ATTEMPTS and puts % CLIENT_ATTEMPTS == 0, puts
    # The store's own words stay in the run's log; the job says the vocabulary's, with a reference.
    assert status.message.startswith("storage_failed: ") and "(ref " in status.message, status.message
    assert INJECTED_MESSAGE not in status.message
    objects = _objects(s3, job_id)
    assert "manifest.json" not in objects and "stats.safetensors" not in objects
    assert "shard_00001.safetensors" not in objects
    assert "shard_00000.safetensors" in objects  # kept for a resume
    assert s3_proxy.count("PUT", f"{job_id}/shard_00002.safetensors") == 0  # it stopped there


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root works here), unmounted after the test."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_local_disk_full_fails_the_job_clearly_with_no_manifest(harvest_stack, small_disk):
    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest
    from harvest.storage import Storage

    # ~1.5 KB per token and layer kept (8 layers × 256 × bf16 ≈ 4 KiB/token): a few hundred
    # tokens per shard fill 256 KiB within the first shards.
    request = {"model": "llama-tiny", "prompts": ["the disk is filling up " * 20] * 8, "shard_size": 2, "layers": "all"}
    job_id = str(uuid.uuid4())
    files = JobFiles.for_job(job_id, Storage(f"file://{small_disk}"))
    url = files.write_request(HarvestRequest.model_validate(request))
    run_id = start_harvest_run(job_id, url, "llama-tiny", "small", "faults", workers=1)
    status = harvest_stack.wait(run_id, timeout=180)
    assert status.status == "failed", status
    assert status.message.startswith("storage_full: ") and "(ref " in status.message, status.message
    left = sorted(p.name for p in (small_disk / "jobs" / job_id).iterdir())
    assert "manifest.json" not in left and "stats.safetensors" not in left, left


def test_a_write_failing_on_a_full_disk_leaves_no_staging_file(small_disk):
    """A write that fails with ENOSPC removes its staging file, so the write's retry does not
    find the disk fuller than the failure left it, and the folder holds only complete files."""
    from harvest.storage import Storage

    storage = Storage(f"file://{small_disk}").child("jobs/disk-full")
    storage.write_bytes("shard_00000.safetensors", b"x" * 100_000)
    with pytest.raises(OSError) as failure:
        storage.write_bytes("shard_00001.safetensors", b"y" * 400_000)  # more than the 256 KiB disk holds
    assert failure.value.errno == errno.ENOSPC
    assert storage.listdir() == ["shard_00000.safetensors"]  # no .partial left, the complete file kept
    storage.write_bytes("shard_00001.safetensors", b"y" * 100_000)  # the space is there again for a retry
