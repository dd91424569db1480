"""Every storage read sees the store as it is now, on S3, for a long-lived reader.

A real job, in one flow run or split over two (scale-out), on the session's Prefect workers (the
worker hosts `harvest up` runs: slot tables, warm engine servers) writes to moto's S3 server
through `tests.fault_proxy` (which only records the requests here), its shards slowed to a
second each (`tests.slow_engine`). An API replica on the same bucket, up for the whole module,
is the long-lived reader: its run store (`FileRuns`, standing in for the run's own report,
`flows.progress`) counts the job's shard records at each of the watcher's reads, and its
watcher finds the manifest at the end. Read through the API mid-run, the count must rise shard by shard (one
run: every value from 0 to the end; two runs may land two shards within one tick) and reach
done; s3fs's listings cache (one filesystem object per process) once froze it at the first
count and hid the manifest.

The proxy's record of the runs' requests gives the write order on S3: the manifest is the last
write into the job's folder, from either run.
"""

from __future__ import annotations

import time
import uuid

import pytest

from testbed import http_calls
from tests.api_fixtures import ApiServer, harvest_api_env
from tests.fault_proxy import FaultProxy
from tests.s3_fixtures import BUCKET, CREDENTIALS
from tests.slow_engine import slow_shards
from tests.write_log import s3_writes

PREFIX = "fresh"
N_SHARDS = 6


@pytest.fixture(scope="module")
def recording_proxy(moto_s3):
    proxy = FaultProxy(moto_s3.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def s3_reader_api(harvest_home, tiny, moto_s3):
    """An API replica on s3://BUCKET/PREFIX whose runs the test starts itself (FileRuns)."""
    env = {
        **harvest_api_env(harvest_home),
        **CREDENTIALS,
        "HARVEST_STORAGE_URL": f"s3://{BUCKET}/{PREFIX}",
        "HARVEST_S3_ENDPOINT_URL": moto_s3.endpoint,
    }
    server = ApiServer(harvest_home, "s3-fresh", env).start()
    yield server
    server.stop()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-run", "scale-out"])
def test_progress_on_s3_rises_shard_by_shard_for_a_long_lived_reader_and_the_manifest_is_written_last(
    s3_reader_api, recording_proxy, harvest_stack, workers
):
    from flows.submit import start_harvest_run

    api = s3_reader_api
    auth = {"Authorization": f"Bearer {api.make_key(name='fresh')}"}
    prompts = [f"fresh prompt {i}" for i in range(N_SHARDS)]
    submitted = http_calls.post(f"{api.base_url}/harvest", headers=auth, timeout=60,
                                json={"model": "llama-tiny", "prompts": prompts, "shard_size": 1, "layers": [1, 5]})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["job_id"]

    # Warm the reader up on this job's folder first (the listing a cache would keep), then
    # run the job for real: two runs, each writing through the proxy.
    assert http_calls.get(f"{api.base_url}/harvest/{job_id}", headers=auth).json()["progress"]["shards_done"] == 0
    api.runs.set(f"run-{job_id}", "running")
    # The watcher's read that shows the job running has also counted its shards: the run
    # store listed `_parts/` while the folder was empty (the listing a cache would keep).
    deadline = time.monotonic() + 30
    while http_calls.get(f"{api.base_url}/harvest/{job_id}", headers=auth).json()["status"] != "running":
        assert time.monotonic() < deadline, "the watcher never applied the run's state"
        time.sleep(0.05)
    env = {**CREDENTIALS, "HARVEST_S3_ENDPOINT_URL": recording_proxy.url, **slow_shards(2.0)}
    request_url = f"s3://{BUCKET}/{PREFIX}/jobs/{job_id}/request.json"
    run_id = start_harvest_run(job_id, request_url, "llama-tiny", "small", "fresh", workers=workers, env=env)

    seen: list[int] = []
    deadline = time.monotonic() + 240
    while (status := harvest_stack.status(run_id).status) not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, "the run did not end"
        seen.append(http_calls.get(f"{api.base_url}/harvest/{job_id}", headers=auth).json()["progress"]["shards_done"])
        time.sleep(0.1)
    assert status == "done", harvest_stack.status(run_id)

    # The reader's counts never go back, and it saw the shards land, not a count frozen at its
    # first listing: one at a time from one run (a shard takes 2 s, the watcher ticks every
    # 0.2 s), one or two at a time from two runs writing at once.
    assert seen == sorted(seen), seen
    between = sorted(set(v for v in seen if 0 < v < N_SHARDS))
    if workers == 1:  # the count before the last lasts only until the run's end (tests/test_watcher_events.py)
        assert list(range(1, N_SHARDS - 1)) == [v for v in between if v < N_SHARDS - 1], f"progress seen mid-run: {seen}"
    else:
        assert len(between) >= N_SHARDS // 2, f"progress seen mid-run: {seen}"

    api.runs.set(f"run-{job_id}", "done")  # what Prefect says; the reader must find the manifest
    deadline = time.monotonic() + 30
    while (job := http_calls.get(f"{api.base_url}/harvest/{job_id}", headers=auth).json())["status"] != "done":
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["progress"] == {"shards_done": N_SHARDS, "n_shards": N_SHARDS}
    assert job["result"]["n_shards"] == N_SHARDS

    # Write order on S3, from the wire: the manifest last, after both runs' shards and records.
    time.sleep(1.0)  # a write just after the run ended would show too
    writes = s3_writes(recording_proxy, f"/{PREFIX}/jobs/{job_id}/")
    names = [path.split("?")[0].rsplit("/", 1)[1] for _, path in writes]
    assert names[-1] == "manifest.json" and names.count("manifest.json") == 1, names
    assert {f"shard_{k:05d}.safetensors" for k in range(N_SHARDS)} <= set(names[:-1]), names
    assert "_progress.json" in names[:-1]


def test_a_long_lived_s3_reader_sees_objects_another_writer_added_after_it_listed(moto_s3):
    """The storage layer itself, on one s3fs filesystem object kept across reads (as a replica
    keeps it, listings cache on), while another writer (boto3, as another process would) adds
    objects: listing, exists() and size() answer what the store holds now."""
    import s3fs

    from harvest.jobfiles import JobFiles
    from harvest.storage import Storage

    s3 = moto_s3.client
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": moto_s3.endpoint})
    name = f"unit-{uuid.uuid4().hex[:8]}"
    root = Storage(f"s3://{BUCKET}/{PREFIX}", fs, f"{BUCKET}/{PREFIX}")
    files = JobFiles(root.child(name))

    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}/{key}", Body=body)

    put("_parts/shard_00000.safetensors", b"x")
    assert files.shards_done() == 1 and not files.has_manifest()
    assert name in root.listdir()
    put("_parts/shard_00001.safetensors", b"x")
    put("manifest.json", b"{}")
    assert files.shards_done() == 2
    assert files.has_manifest() and files.storage.size("manifest.json") == 2
    assert set(files.storage.listdir()) == {"_parts", "manifest.json"}
    put("manifest.json", b"{ }")
    assert files.storage.size("manifest.json") == 3
