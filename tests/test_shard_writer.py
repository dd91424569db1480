"""Shard writes behind the forward passes (`harvest.pipeline.ShardWriter`), and large shards
as S3 multipart uploads (`harvest.storage`), on the real pipeline and moto's S3 server.

The order of events is recorded by the engine and the storage themselves (wrappers around the
real ones), not by the writer under test; the multipart upload is read back from S3's own
ETag, which for a multipart object is `<md5 of the parts' md5s>-<number of parts>`.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from safetensors.torch import load as load_tensors

from harvest.jobfiles import MANIFEST
from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.settings import get_settings
from harvest.storage import Storage


class Timeline:
    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def add(self, what: str, k: int) -> None:
        with self.lock:
            self.events.append((what, k))

    def at(self, what: str, k: int) -> int:
        return self.events.index((what, k))


class TimedEngine:
    """The real HF engine, noting when each shard's forward pass starts and ends."""

    def __init__(self, engine, timeline: Timeline):
        self.engine, self.timeline, self.name, self.model = engine, timeline, engine.name, engine.model
        self.k = 0

    def capture(self, prompts, spec, *, batch_size=None, sink=None):
        self.timeline.add("forward-start", self.k)
        capture = self.engine.capture(prompts, spec, batch_size=batch_size, sink=sink)
        self.timeline.add("forward-end", self.k)
        self.k += 1
        return capture

    def versions(self):
        return self.engine.versions()


class SlowStorage(Storage):
    """Real in-memory storage whose shard writes take 0.3 s, noting when each starts and ends."""

    def __init__(self, url: str, timeline: Timeline):
        super().__init__(url)
        self.timeline = timeline

    def write_bytes(self, name: str, data: bytes) -> int:
        if name.startswith("shard_"):
            k = int(name.split("_")[1].split(".")[0])
            self.timeline.add("write-start", k)
            time.sleep(0.3)
            written = super().write_bytes(name, data)
            self.timeline.add("write-end", k)
            return written
        return super().write_bytes(name, data)


def _job(registry, n: int, **fields):
    prompts = [f"prompt number {k} of the overlap test" for k in range(n)]
    return resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, shard_size=1, **fields), registry)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_write_runs_behind_the_next_forward_pass_and_never_three_shards_at_once(registry, hf_engine, overlap):
    timeline = Timeline()
    storage = SlowStorage(f"memory:///tests/overlap-{overlap}", timeline)
    storage.delete_all()
    n = 5
    run_job(_job(registry, n), storage, TimedEngine(hf_engine, timeline), "overlap", overlap=overlap)
    assert storage.exists(MANIFEST)
    for k in range(n - 1):
        if overlap:
            # Shard k is written while shard k+1 is computed ...
            assert timeline.at("write-start", k) < timeline.at("forward-end", k + 1), timeline.events
        else:
            assert timeline.at("write-end", k) < timeline.at("forward-start", k + 1), timeline.events
    for k in range(n - 2):
        # ... and shard k+2 starts only once shard k is written: at most two shards in memory.
        assert timeline.at("write-end", k) < timeline.at("forward-start", k + 2), timeline.events


def test_a_write_that_fails_fails_the_job_after_the_shard_in_flight_and_leaves_no_manifest(registry, hf_engine):
    class FailingStorage(Storage):
        def write_bytes(self, name, data):
            if name == "shard_00002.safetensors":
                raise OSError("No space left on device")
            return super().write_bytes(name, data)

    storage = FailingStorage("memory:///tests/overlap-failing")
    storage.delete_all()
    with pytest.raises(OSError, match="No space left"):
        run_job(_job(registry, 5), storage, hf_engine, "overlap-failing")
    assert not storage.exists(MANIFEST)
    assert storage.exists("shard_00001.safetensors") and not storage.exists("shard_00003.safetensors")


@pytest.fixture(scope="module")
def moto_s3():
    from tests.topology import MotoS3

    s3 = MotoS3("127.0.0.1", "shards")
    try:
        yield s3.endpoint, s3.client
    finally:
        s3.stop()


def test_a_large_shard_goes_up_as_one_multipart_upload(registry, hf_engine, moto_s3, monkeypatch):
    endpoint, client = moto_s3
    for name, value in {"HARVEST_S3_ENDPOINT_URL": endpoint, "HARVEST_S3_PART_BYTES": str(5 << 20),
                        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        # Every layer of 16 long prompts: 8 x 256 x 2 bytes a token, over 20 MiB in one shard,
        # so several parts of 5 MiB; the small shard beside it is one PUT.
        prompts = ["word " * 180] * 16 + ["short"]
        job = resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, shard_size=16, layers="all"), registry)
        storage = Storage("s3://shards/job-multipart")
        run_job(job, storage, hf_engine, "multipart")
    finally:
        get_settings.cache_clear()
    big = client.head_object(Bucket="shards", Key="job-multipart/shard_00000.safetensors")
    small = client.head_object(Bucket="shards", Key="job-multipart/shard_00001.safetensors")
    parts = -(-big["ContentLength"] // (5 << 20))
    assert parts >= 2 and big["ETag"].strip('"').endswith(f"-{parts}"), (big["ContentLength"], big["ETag"])
    assert "-" not in small["ETag"]
    body = client.get_object(Bucket="shards", Key="job-multipart/shard_00000.safetensors")["Body"].read()
    import json

    manifest = json.loads(client.get_object(Bucket="shards", Key="job-multipart/manifest.json")["Body"].read())
    assert hashlib.sha256(body).hexdigest() == manifest["shards"][0]["sha256"]
    assert load_tensors(body)["prompt_15"].shape[0] == 8
