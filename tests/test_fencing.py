"""Two live writers of one shard, and a writer that was taken over going on after its successor
(issue 36, item 7): each shard is created once (`harvest.storage`), so however the two
writers' commits and the finalizer's manifest interleave, the manifest's hash of a shard is
its file's, on local disk and on moto's S3 server (in its own process).

Each writer is the real pipeline (`run_shards`: the shard's forward pass into a staged file,
then its write behind it) with its own engine, whose bytes differ from the other's by one bf16
step. The storage each writer sees is the real one behind a `Gate` the test holds: the writer
stops there once its file is staged (its write) and before its publication and its record (its
commit), and the test lets one step through at a time, in every order. Nothing in the
production code knows about it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
from safetensors.torch import load as load_tensors

from harvest.jobfiles import MANIFEST, STATS
from harvest.shard.layout import part_name, shard_name
from harvest.pipeline import finalize, run_job, tokenize_job
from harvest.shard.writing import ShardPass, capture_shard, run_shards, write_shard
from harvest.request import HarvestRequest, resolve_job
from harvest.shard.record import read_part, verified_part
from harvest.storage import Storage, StorageOptions
from tests.s3_fixtures import BUCKET
from tests.test_shard_writer import LastBitApart, Replay

SHARD = shard_name(0)
TIMEOUT_S = 60

STEPS = [("A", "publish"), ("A", "record"), ("B", "publish"), ("B", "record"), ("F", "finalize")]
ORDERS = [
    order for order in itertools.permutations(STEPS)
    if all(order.index((w, "publish")) < order.index((w, "record")) for w in "AB")
    and order.index(("F", "finalize")) > min(order.index((w, "record")) for w in "AB")
]
"""Every order of the two commits (each publishes its file, then its record) and the
finalizer (after a first record: before it there is no shard to list). 14 orders, among them
the issue's: B commits, the manifest is written, then A, taken over but alive, commits."""


class Gate:
    """Where one writer waits, its shard staged, until the test lets its next step through."""

    def __init__(self):
        self.cond = threading.Condition()
        self.at: str | None = None  # the step it waits at
        self.opened: str | None = None
        self.passed: list[str] = []
        self.finished = False
        self.error: BaseException | None = None

    @contextmanager
    def step(self, what: str):
        with self.cond:
            self.at = what
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.opened == what, TIMEOUT_S), f"never let through to {what}"
            self.at = self.opened = None
        try:
            yield
        finally:
            with self.cond:
                self.passed.append(what)
                self.cond.notify_all()

    def wait_parked(self) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.at is not None or self.finished, TIMEOUT_S), "writer neither waits nor ends"

    def let_through(self, what: str) -> None:
        """Let step `what` run and wait until it is over; nothing if the writer already ended
        (a writer that stood down takes no further step)."""
        self.wait_parked()
        with self.cond:
            if self.finished:
                return
            assert self.at == what, (self.at, what)
            done = len(self.passed)
            self.opened = what
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(self.passed) > done or self.finished, TIMEOUT_S), f"{what} never ended"


class GatedStorage(Storage):
    """The real storage as one writer sees it: shard 0's publication and its record each wait
    at the writer's gate; everything else (reads, the other shards) as is."""

    def __init__(self, url: str, gate: Gate, options: StorageOptions):
        super().__init__(url, options=options)
        self.gate = gate

    def publish_file(self, name, local_path):
        if name != SHARD:
            return super().publish_file(name, local_path)
        with self.gate.step("publish"):
            return super().publish_file(name, local_path)

    def write_bytes(self, name, data):
        if name != part_name(0):
            return super().write_bytes(name, data)
        with self.gate.step("record"):
            return super().write_bytes(name, data)


def _writer(job, url: str, options: StorageOptions, engine, tokenized, gate: Gate, staged: dict) -> threading.Thread:
    """A thread driving the real `ShardPass` over shard 0 as `run_shards` does (its write in a
    thread of its own), noting its staged file."""
    storage = GatedStorage(url, gate, options)

    def run():
        try:
            shards = ShardPass(job, storage)
            if shards.done(0) is None:
                staged[0] = capture_shard(job, engine, tokenized, 0, storage)
                shards.captured(staged[0])
                with ThreadPoolExecutor(1) as pool:
                    shards.writing(pool.submit(write_shard, job, storage, tokenized, 0, staged[0]))
                    shards.close()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            gate.error = exc
        finally:
            with gate.cond:
                gate.finished = True
                gate.cond.notify_all()

    return threading.Thread(target=run, name=f"writer-{id(gate)}", daemon=True)


def _race(job, url: str, options: StorageOptions, order, engines) -> dict[str, str]:
    """Shard 1 written once; shard 0 by two writers whose commits and the finalizer land in
    `order`, both staged before either commits. Returns each writer's own sha256 of shard 0
    and which one published first."""
    storage = Storage(url, options=options)
    storage.delete_all()
    tokenized = tokenize_job(job)
    run_shards(job, storage, engines[0], [1], tokenized=tokenized)
    for engine in engines:  # the real engine runs once, here; the racing writers replay it
        capture_shard(job, engine, tokenized, 0, storage).staged.discard()
    gates = {"A": Gate(), "B": Gate()}
    staged = {"A": {}, "B": {}}
    threads = [_writer(job, url, options, engine, tokenized, gates[w], staged[w]) for w, engine in zip("AB", engines, strict=True)]
    for thread in threads:
        thread.start()
    try:
        for gate in gates.values():
            gate.wait_parked()
            assert gate.at == "publish", (gate.at, gate.error)  # both written, neither committed
        first = None
        for who, what in order:
            if who == "F":
                finalize(job, storage, {"engine": "hf"}, "fencing", tokenized=tokenized)
                continue
            first = first or (who if what == "publish" else None)
            gates[who].let_through(what)
    finally:
        for gate in gates.values():  # a failed assertion must not leave a writer waiting
            with gate.cond:
                gate.opened = gate.at
                gate.cond.notify_all()
        for thread in threads:
            thread.join(TIMEOUT_S)
    errors = {w: g.error for w, g in gates.items() if g.error is not None}
    assert not errors, (order, errors)  # the loser stood down, it did not fail
    return {"A": staged["A"][0].staged.sha256, "B": staged["B"][0].staged.sha256, "first": first}


def _stale(read) -> list[str]:
    """The shards whose manifest entry (size, sha256) is not hashlib's over the stored bytes."""
    manifest = json.loads(read(MANIFEST))
    return [r["file"] for r in manifest["shards"] if (r["bytes"], r["sha256"]) != _digest(read(r["file"]))]


def _digest(body: bytes) -> tuple[int, str]:
    return len(body), hashlib.sha256(body).hexdigest()


def _check(read, writes: dict[str, str], order) -> None:
    """The manifest lists each shard's stored bytes (size, hashlib's sha256) and statistics;
    shard 0 is the first publisher's file."""
    assert not _stale(read), order
    assert writes["A"] != writes["B"]
    assert _digest(read(SHARD))[1] == writes[writes["first"]], order  # the first write stands
    values = []
    for record in json.loads(read(MANIFEST))["shards"]:
        tensors = load_tensors(read(record["file"]))
        values += [tensors[n].float().numpy().astype(np.float64)[:, 1:] for n in sorted(tensors) if n.startswith("prompt_")]
    np.testing.assert_allclose(
        load_tensors(read(STATS))["mean"].numpy(), np.concatenate(values, axis=1).mean(axis=1), rtol=1e-5, atol=1e-6, err_msg=str(order)
    )


def _every_order(job, engines, url_of, read_of, options: StorageOptions = StorageOptions()) -> None:
    """Race in every order, then check: first the issue's failure (a manifest naming a hash its
    file no longer has), over all orders at once, then the rest, order by order; each time
    the shard's record vouches for its file too (a resume skips it)."""
    raced = [(order, _race(job, url_of(n), options, order, engines), read_of(n), url_of(n)) for n, order in enumerate(ORDERS)]
    stale = [order for order, _, read, _ in raced if _stale(read)]
    assert not stale, f"the manifest's sha256 of a shard is not its file's after {len(stale)} of {len(ORDERS)} orders, e.g. {stale[0]}"
    for order, writes, read, url in raced:
        _check(read, writes, order)
        assert verified_part(Storage(url, options=options), 0) is not None, order


@pytest.fixture(scope="module")
def engines(hf_engine):
    """Two writers of one shard: the real engine's values, and the same one bf16 step apart."""
    return Replay(hf_engine), LastBitApart(hf_engine)


@pytest.fixture(scope="module")
def two_prompts(registry):
    return resolve_job(HarvestRequest(model="llama-tiny", prompts=["The sky is", "Grass is green."], shard_size=1), registry)


def s3_options(s3) -> StorageOptions:
    """The moto server's store, in parts of 5 MiB (files of a few parts stay small)."""
    return StorageOptions(s3_endpoint_url=s3.endpoint, s3_part_bytes=5 << 20)


def _s3_reader(s3, prefix: str):
    return lambda name: s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read()


def test_two_live_writers_of_one_shard_on_local_disk_leave_the_manifest_hashing_the_file_in_every_order(two_prompts, engines, tmp_path):
    _every_order(two_prompts, engines, lambda n: str(tmp_path / f"race-{n}"), lambda n: lambda name: (tmp_path / f"race-{n}" / name).read_bytes())
    assert not list(tmp_path.glob("race-*/*.partial"))  # no write's staged copy is left


def test_two_live_writers_of_one_shard_on_s3_leave_the_manifest_hashing_the_object_in_every_order(two_prompts, engines, on_s3):
    _every_order(two_prompts, engines, lambda n: f"s3://{BUCKET}/race-{n}", lambda n: _s3_reader(on_s3, f"race-{n}"), s3_options(on_s3))


# --- the create-once publication itself, and the retries it must let through ----------------------


def _staged_copy(storage: Storage, data: bytes) -> str:
    path = storage.staging_path(SHARD)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_second_publication_of_a_name_fails_and_changes_nothing(where, tmp_path, request):
    """On S3 with files of 3 parts: the loser's multipart upload is aborted, not left pending."""
    if where == "s3":
        s3 = request.getfixturevalue("on_s3")
        storage = Storage(f"s3://{BUCKET}/publish", options=s3_options(s3))
    else:
        storage = Storage(str(tmp_path / "publish"))
    first, second = os.urandom(11 << 20), os.urandom(11 << 20)
    storage.publish_file(SHARD, _staged_copy(storage, first))
    loser = _staged_copy(storage, second)
    with pytest.raises(FileExistsError):
        storage.publish_file(SHARD, loser)
    assert storage.read_bytes(SHARD) == first
    assert not os.path.exists(loser)  # the loser's staged copy is gone all the same
    if where == "s3":
        assert not s3.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    else:
        assert sorted(os.listdir(tmp_path / "publish")) == [SHARD]


def test_a_retry_whose_upload_landed_unanswered_keeps_its_own_file_and_statistics(two_prompts, engines, tmp_path):
    folder = tmp_path / "retry"
    storage = Storage(str(folder))
    tokenized = tokenize_job(two_prompts)
    captured = capture_shard(two_prompts, engines[0], tokenized, 0, storage)
    size, sha256 = captured.staged.seal()
    # The first try's file landed, its answer was lost (the staged copy still here): the retry.
    shutil.copyfile(captured.staged.path, tmp_path / "landed")
    storage.publish_file(SHARD, str(tmp_path / "landed"))
    record, _ = write_shard(two_prompts, storage, tokenized, 0, captured)
    assert (record.bytes, record.sha256) == (size, sha256) and captured.staged.superseded
    stored_record, stats, _ = read_part(storage, 0)
    assert stored_record == record and stats.count == captured.stats.count and stats.mean.equal(captured.stats.mean)


@pytest.mark.parametrize("where", ["disk", "s3"])
def test_a_rescheduled_run_adopts_the_shard_its_cut_off_attempt_published_without_a_record(where, two_prompts, engines, tmp_path, request):
    """The attempt before published shard 0 (other bytes) and died before its record: the
    rescheduled run cannot replace it, so it lists it, and the job completes."""
    if where == "s3":
        s3 = request.getfixturevalue("on_s3")
        url, read, options = f"s3://{BUCKET}/rescheduled", _s3_reader(s3, "rescheduled"), s3_options(s3)
    else:
        url, options = str(tmp_path / "rescheduled"), StorageOptions()
        read = lambda name: (tmp_path / "rescheduled" / name).read_bytes()  # noqa: E731
    storage = Storage(url, options=options)
    storage.delete_all()
    tokenized = tokenize_job(two_prompts)
    cut_off = capture_shard(two_prompts, engines[1], tokenized, 0, storage)
    cut_off.staged.seal()
    storage.publish_file(SHARD, cut_off.staged.path)
    assert not storage.exists(part_name(0))
    summary = run_job(two_prompts, storage, engines[0], "rescheduled", tokenized=tokenized)
    assert summary.shards_skipped == 0
    _check(read, {"A": cut_off.staged.sha256, "B": "its own", "first": "A"}, "rescheduled")
    assert verified_part(storage, 0) is not None
