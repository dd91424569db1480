"""A stale run cannot undo a finished job (issue 44, item 5).

The story: a harvest flow run, rescheduled after its host crashed, runs again on another host
while its first attempt's process is still alive. The successor finishes the job and writes
manifest.json; then the old attempt fails, and its failure path (`flows.harvest.ending`)
removed the manifest unconditionally, so the API showed the job done with its files expired.
Now each attempt records its own token in the manifest it writes (`Manifest.writer`), and a
failing attempt removes the manifest only if it holds that token, checked and removed as one
step (`Storage.delete_if`: DeleteObject with `If-Match` on S3, a lock the manifest's writer
holds too on local disk).

Real parts: the tiny checkpoint through the real pipeline (`run_shards`, `finalize`) for the
manifests, local disk and moto's S3 server in its own process, and for `ending` a real flow
run on the session's Prefect server. What is stored is read back past the code under test
(pathlib, boto3).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from prefect import flow

from flows.harvest import ending
from harvest.jobfiles import MANIFEST, JobFiles
from harvest.pipeline import finalize, tokenize_job
from harvest.shard.writing import run_shards
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage, StorageOptions
from tests.s3_fixtures import BUCKET


@pytest.fixture(params=["disk", "s3"])
def job(request, tmp_path):
    """A job folder on the store, and a reader of its manifest as stored (None: absent) that
    does not go through `Storage`."""
    if request.param == "s3":
        s3 = request.getfixturevalue("on_s3")
        prefix = f"jobs/{uuid.uuid4().hex}"

        def stored() -> bytes | None:
            try:
                return s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/{MANIFEST}")["Body"].read()
            except s3.client.exceptions.NoSuchKey:
                return None

        return JobFiles(Storage(f"s3://{BUCKET}/{prefix}", options=StorageOptions(s3_endpoint_url=s3.endpoint))), stored
    folder = tmp_path / "job"
    return JobFiles(Storage(str(folder))), lambda: (folder / MANIFEST).read_bytes() if (folder / MANIFEST).exists() else None


@pytest.fixture(scope="module")
def two_prompts(registry):
    return resolve_job(HarvestRequest(model="llama-tiny", prompts=["The sky is", "Grass is green."], shard_size=1), registry)


def _manifest(writer: str) -> bytes:
    return json.dumps({"version": 2, "job_id": "j", "writer": writer}).encode()


def test_a_stale_attempts_failure_keeps_its_successors_manifest(job, two_prompts, hf_engine):
    """Attempt A wrote the manifest, then its rescheduled successor B wrote it again (both
    through the real pipeline); A fails last. B's manifest stays, byte for byte; B failing
    after all removes it (its own)."""
    files, stored = job
    tokenized = tokenize_job(two_prompts)
    run_shards(two_prompts, files.storage, hf_engine, tokenized=tokenized)
    finalize(two_prompts, files.storage, {"engine": "hf"}, "j", tokenized=tokenized, writer="attempt-A")
    assert json.loads(stored())["writer"] == "attempt-A"
    finalize(two_prompts, files.storage, {"engine": "hf"}, "j", tokenized=tokenized, writer="attempt-B")
    successors = stored()
    assert json.loads(successors)["writer"] == "attempt-B" and json.loads(successors)["n_prompts"] == 2

    assert files.discard_manifest("attempt-A") is False
    assert stored() == successors and files.read_result()["n_shards"] == 2
    assert files.discard_manifest("attempt-B") is True
    assert stored() is None and files.read_result() is None


def test_a_failing_attempt_removes_the_manifest_it_wrote(job, two_prompts, hf_engine):
    files, stored = job
    tokenized = tokenize_job(two_prompts)
    run_shards(two_prompts, files.storage, hf_engine, tokenized=tokenized)
    finalize(two_prompts, files.storage, {"engine": "hf"}, "j", tokenized=tokenized, writer="attempt-A")
    assert files.discard_manifest("attempt-A") is True
    assert stored() is None
    assert files.discard_manifest("attempt-A") is False  # none left: nothing to do
    files.delete()  # the retention sweep; a late failure must not make the folder again
    assert files.discard_manifest("attempt-A") is False and files.storage.listdir() == []
    assert not files.storage.fs.exists(files.storage.root)


def test_a_successors_manifest_landing_after_the_check_is_kept(job):
    """The race inside the failure path: the stale attempt reads the manifest, finds its own,
    and its successor's manifest lands before the removal. On S3 the removal is conditional
    on the ETag read (412, then the new object is checked and kept); on local disk the
    successor's write waits on the manifest's lock until the check and the removal are over,
    so what is removed is the stale attempt's own and the successor's lands after it."""
    files, stored = job
    files.write_manifest(_manifest("A"))
    checks: list[bytes] = []
    successor = threading.Thread(target=files.write_manifest, args=(_manifest("B"),))

    def owned(data: bytes) -> bool:
        checks.append(data)
        if len(checks) == 1:
            successor.start()  # B writes now, from another thread, as another process would
            successor.join(timeout=0.5 if files.storage.is_local else 10)
            assert successor.is_alive() == files.storage.is_local  # on disk it waits on the lock
        return json.loads(data)["writer"] == "A"

    removed = files.storage.delete_if(MANIFEST, owned)
    successor.join(timeout=10)
    assert not successor.is_alive()
    assert json.loads(stored())["writer"] == "B"
    if files.storage.is_local:
        assert removed is True and checks == [_manifest("A")]
    else:
        assert removed is False and checks == [_manifest("A"), _manifest("B")]


def test_the_flows_failure_path_removes_only_its_own_attempts_manifest(prefect_server, tmp_path):
    """`ending` in a real flow run: the stale attempt's run ends Failed with the job's error
    and the successor's manifest stays; the successor's own failure removes it."""
    folder = tmp_path / "job"
    files = JobFiles(Storage(str(folder)))
    files.write_manifest(_manifest("attempt-B"))

    @flow(name="stale-attempt", persist_result=False)
    def attempt(writer: str):
        return ending(RuntimeError("engine server exited"), "j", files, None, False, writer)

    started = time.monotonic()
    state = attempt("attempt-A", return_state=True)
    assert state.is_failed() and state.message.startswith("engine_failed: ")
    assert (folder / MANIFEST).read_bytes() == _manifest("attempt-B")
    state = attempt("attempt-B", return_state=True)
    assert state.is_failed() and not (folder / MANIFEST).exists()
    assert time.monotonic() - started < 30
