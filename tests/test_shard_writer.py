"""Shard writes behind the forward passes (`harvest.shard.writing.ShardPass`), large shards as S3
multipart uploads (`harvest.storage`), and two writers racing on one shard, on the real
pipeline, local disk and moto's S3 server.

The order of events is recorded by the engine and the storage themselves (wrappers around the
real ones), not by the writer under test; the multipart upload is read back from S3's own
ETag, which for a multipart object is `<md5 of the parts' md5s>-<number of parts>`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors

from harvest.jobfiles import MANIFEST, PARTS, STATS
from harvest.capture import ShardCapture
from harvest.pipeline import finalize, run_job, tokenize_job
from harvest.shard.writing import capture_shard, run_shards, write_shard
from harvest.request import HarvestRequest, resolve_job
from harvest.stats import RunningStats
from harvest.storage import Storage, StorageOptions
from tests.s3_fixtures import BUCKET


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


def test_a_large_shard_goes_up_as_one_multipart_upload(registry, hf_engine, on_s3):
    endpoint, client = on_s3.endpoint, on_s3.client
    # Every layer of 16 long prompts: 8 x 256 x 2 bytes a token, over 20 MiB in one shard,
    # so several parts of 5 MiB; the small shard beside it is one PUT.
    prompts = ["word " * 180] * 16 + ["short"]
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=prompts, shard_size=16, layers="all"), registry)
    storage = Storage(f"s3://{BUCKET}/job-multipart", options=StorageOptions(s3_endpoint_url=endpoint, s3_part_bytes=5 << 20))
    run_job(job, storage, hf_engine, "multipart")
    big = client.head_object(Bucket=BUCKET, Key="job-multipart/shard_00000.safetensors")
    small = client.head_object(Bucket=BUCKET, Key="job-multipart/shard_00001.safetensors")
    parts = -(-big["ContentLength"] // (5 << 20))
    assert parts >= 2 and big["ETag"].strip('"').endswith(f"-{parts}"), (big["ContentLength"], big["ETag"])
    assert "-" not in small["ETag"]
    body = client.get_object(Bucket=BUCKET, Key="job-multipart/shard_00000.safetensors")["Body"].read()
    import json

    manifest = json.loads(client.get_object(Bucket=BUCKET, Key="job-multipart/manifest.json")["Body"].read())
    assert hashlib.sha256(body).hexdigest() == manifest["shards"][0]["sha256"]
    assert load_tensors(body)["prompt_15"].shape[0] == 8


# --- two writers of one shard ----------------------------------------------------------------

STEPS = [("A", "publish"), ("A", "record"), ("B", "publish"), ("B", "record")]
RACES = [order for order in itertools.permutations(STEPS) if all(order.index((w, "publish")) < order.index((w, "record")) for w in "AB")]
"""Every order the two writers' steps can land in (each publishes its file, then its record)."""


class Turns:
    """Lets each writer's step run only when it is that step's turn in `order`."""

    def __init__(self, order):
        self.order, self.done, self.cond = list(order), 0, threading.Condition()

    def take(self, who: str, what: str, step):
        with self.cond:
            assert self.cond.wait_for(lambda: self.order[self.done] == (who, what), timeout=60), (who, what, self.done)
        try:
            return step()
        finally:
            with self.cond:
                self.done += 1
                self.cond.notify_all()


class RacingStorage(Storage):
    """The real storage as one writer sees it: its shard publication and its record wait for
    their turn (nothing else changes)."""

    def __init__(self, url: str, who: str, turns: Turns, options: StorageOptions):
        super().__init__(url, options=options)
        self.who, self.turns = who, turns

    def publish_file(self, name, local_path):
        return self.turns.take(self.who, "publish", lambda: Storage.publish_file(self, name, local_path))

    def write_bytes(self, name, data):
        if name.startswith(PARTS):
            return self.turns.take(self.who, "record", lambda: Storage.write_bytes(self, name, data))
        return super().write_bytes(name, data)


class Replay:
    """The real engine, each shard's forward pass run once and its values replayed after (the
    races repeat the same shards)."""

    def __init__(self, engine):
        self.engine, self.name, self.model, self.seen = engine, engine.name, engine.model, {}

    def capture(self, prompts, spec, *, batch_size=None, sink=None):
        key = tuple(map(tuple, prompts))
        if key not in self.seen:
            self.seen[key] = self.engine.capture(prompts, spec, batch_size=batch_size)
        for position, value in enumerate(self.seen[key].values):
            sink(position, value)
        return ShardCapture(values=[], stats=self.seen[key].stats)

    def versions(self):
        return self.engine.versions()


class LastBitApart(Replay):
    """Every stored value one bf16 step away (the last bit flipped), with the statistics of
    those values: another write of the same shard, batched differently."""

    def capture(self, prompts, spec, *, batch_size=None, sink=None):
        stats = RunningStats(len(spec.layers), spec.n_features(self.model.hidden_size))

        def apart(position, value):
            other = (value.view(torch.int16) ^ 1).view(value.dtype)
            stats.update(other[:, 1:])
            sink(position, other)

        super().capture(prompts, spec, batch_size=batch_size, sink=apart)
        return ShardCapture(values=[], stats=stats)


@pytest.fixture(scope="module")
def replayed(hf_engine):
    return Replay(hf_engine), LastBitApart(hf_engine)


def _race(job, url: str, order, engines, options: StorageOptions = StorageOptions()) -> tuple[str, str]:
    """Shard 1 written once; shard 0 written by two threads, their steps landing in `order`;
    then finalize. Returns the two writes' sha256 of shard 0."""
    storage = Storage(url, options=options)
    storage.delete_all()
    tokenized = tokenize_job(job)
    run_shards(job, storage, engines[0], [1], tokenized=tokenized)
    turns = Turns(order)
    writers = {who: RacingStorage(url, who, turns, options) for who in "AB"}
    captured = {who: capture_shard(job, engine, tokenized, 0, writers[who]) for who, engine in zip("AB", engines, strict=True)}
    errors = []

    def write(who):
        try:
            write_shard(job, writers[who], tokenized, 0, captured[who])
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(who,)) for who in "AB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and turns.done == 4, (errors, turns.done)
    finalize(job, storage, {"engine": "hf"}, "race", tokenized=tokenized)
    return captured["A"].staged.sha256, captured["B"].staged.sha256


def _check_manifest_against_stored_bytes(read, writes: tuple[str, str], order) -> None:
    """The manifest's sha256 of each shard is hashlib's over the stored bytes, and its
    statistics those of the stored values (numpy, float64), whichever write stayed."""
    manifest = json.loads(read(MANIFEST))
    values = []
    for record in manifest["shards"]:
        body = read(record["file"])
        assert record["sha256"] == hashlib.sha256(body).hexdigest() and record["bytes"] == len(body), (order, record)
        tensors = load_tensors(body)
        values += [tensors[name].float().numpy().astype(np.float64)[:, 1:] for name in sorted(tensors) if name.startswith("prompt_")]
    assert hashlib.sha256(read(manifest["shards"][0]["file"])).hexdigest() in writes and writes[0] != writes[1]
    expected = np.concatenate(values, axis=1).mean(axis=1)
    stats = load_tensors(read(STATS))
    np.testing.assert_allclose(stats["mean"].numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=str(order))


def _two_prompts(registry):
    return resolve_job(HarvestRequest(model="llama-tiny", prompts=["The sky is", "Grass is green."], shard_size=1), registry)


def test_two_writers_of_one_shard_in_any_order_leave_a_manifest_that_lists_the_stored_bytes_on_disk(registry, replayed, tmp_path):
    job = _two_prompts(registry)
    for n, order in enumerate(RACES):
        folder = tmp_path / f"race-{n}"
        writes = _race(job, str(folder), order, replayed)
        _check_manifest_against_stored_bytes(lambda name: (folder / name).read_bytes(), writes, order)
        assert not list(folder.glob("*.partial")), order  # neither write's staging copy is left


def test_two_writers_of_one_shard_in_any_order_leave_a_manifest_that_lists_the_stored_bytes_on_s3(registry, replayed, on_s3):
    endpoint, client = on_s3.endpoint, on_s3.client
    job = _two_prompts(registry)
    for n, order in enumerate(RACES):
        writes = _race(job, f"s3://{BUCKET}/race-{n}", order, replayed, StorageOptions(s3_endpoint_url=endpoint))
        read = lambda name, n=n: client.get_object(Bucket=BUCKET, Key=f"race-{n}/{name}")["Body"].read()  # noqa: E731
        _check_manifest_against_stored_bytes(read, writes, order)
