"""The watcher's cost follows what changed, not how many jobs there are (`api.watcher`).

A real watcher on a real job store (SQLite, migrated) and real storage (fsspec's memory
filesystem, its calls counted), with 200 other jobs running; the run store is the API tests'
one seam, `FileRuns` (runs as JSON files), its reads recorded here. Its `follow` pushes nothing,
so a test names a run as Prefect's event stream would (`Watcher.run_changed`) and ticks the
watcher by hand; the lease tests run the watcher's own loop and lease keeper on an event loop.

- A tick after an event naming one job reads that job's run only, lists no folder, and costs a
  few indexed statements, whatever else is active.
- A job's progress comes from its run's own report (`RunStatus.shards_done`, the
  `harvest.shards_done` label `flows.progress` writes), capped at its shards and never lowered.
- The paged re-read records a change whose event was missed within its bound:
  ceil(active / page) + 1 passes.
- The lease is renewed on its own clock while a tick is stuck past the lease's lifetime, and no
  other replica takes it over; a tick stuck while its lease really lapsed writes nothing.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections import Counter

import pytest
from sqlalchemy import event, insert

from tests.api_fixtures import FileRuns

OTHERS = 200


class CountingFS:
    """An fsspec filesystem that counts every public call made on it (each a storage request)."""

    def __init__(self, fs):
        self._fs = fs
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        value = getattr(self._fs, name)
        if callable(value) and not name.startswith("_"):
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return value(*args, **kwargs)

            return counted
        return value


class RecordingRuns(FileRuns):
    """`FileRuns`, with each read's run ids kept; `block_s`: the next read sleeps that long first
    (Prefect slow to answer), `entered` set when it starts sleeping."""

    def __init__(self, runs_dir):
        super().__init__(runs_dir)
        self.reads: list[list[str]] = []
        self.block_s = 0.0
        self.entered = threading.Event()

    def read(self, run_ids):
        self.reads.append(list(run_ids))
        if self.block_s:
            block, self.block_s = self.block_s, 0.0
            self.entered.set()
            time.sleep(block)
        return super().read(run_ids)


@pytest.fixture
def rig(tmp_path):
    """A migrated job store, a key, counted memory storage, recorded runs."""
    from fsspec.implementations.memory import MemoryFileSystem

    from api.auth import create_key
    from api.db import JobStore
    from harvest.storage import Storage

    store = JobStore.from_url(f"sqlite:///{tmp_path / 'harvest.db'}").migrate()
    _, key = create_key("watch-cost", small=10_000, engine=store.db)
    fs = CountingFS(MemoryFileSystem())
    root = f"/watch-cost-{uuid.uuid4().hex[:8]}"
    storage = Storage(f"memory://{root}", fs=fs, root=root)
    runs = RecordingRuns(tmp_path / "runs")
    yield store, key, storage, fs, runs
    store.dispose()


def _jobs(store, key, runs: RecordingRuns, n: int, status: str = "running", n_shards: int = 4) -> list[str]:
    """`n` jobs as admission and their run's start leave them (one transaction), their runs
    in `status` having reported 0 shards."""
    from api.db import jobs, transaction, utcnow

    ids = [str(uuid.uuid4()) for _ in range(n)]
    now = utcnow()
    rows = [{
        "id": job_id, "key_id": key.id, "model": "llama-tiny", "lane": "small", "status": status, "n_prompts": n_shards,
        "layers": [1], "shard_size": 1, "n_shards": n_shards, "shards_done": 0, "add_special_tokens": True,
        "contents": "activations", "reserved_tokens": 10, "created_at": now, "started_at": now if status == "running" else None,
        "request_url": f"memory://nowhere/jobs/{job_id}/request.json", "flow_run_id": f"run-{job_id}", "output_bytes": 1000,
    } for job_id in ids]
    with transaction(store.db) as conn:
        conn.execute(insert(jobs), rows)
    for row in rows:
        runs._write(row["flow_run_id"], {"job_id": row["id"], "request_url": row["request_url"], "status": "pending",
                                         "starts": 1, "shards_done": 0})
        runs.set(row["flow_run_id"], status)
    return ids


def _watcher(runs, storage, store, **kwargs):
    from api.watcher import Watcher

    kwargs.setdefault("interval", 3600.0)  # the interval's pass only when a test says so
    kwargs.setdefault("lease", None)
    return Watcher(runs, storage, store, max_waiters=1, **kwargs)


def _job(store, job_id: str) -> dict:
    from api.store import get_job

    return get_job(job_id, engine=store.db)


class Statements:
    """SQL statements the job store runs while this is open."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def _record(self, conn, cursor, statement, *args):
        self.seen.append(statement)

    def __enter__(self):
        event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc):
        event.remove(self.engine, "before_cursor_execute", self._record)


def test_a_tick_after_an_event_reads_that_run_only_and_lists_no_folder(rig):
    store, key, storage, fs, runs = rig
    _jobs(store, key, runs, OTHERS)
    (job,) = _jobs(store, key, runs, 1, status="pending")
    watcher = _watcher(runs, storage, store)
    watcher.tick()  # the first interval's pass: a page of the active jobs (200 of 201)
    assert [len(r) for r in runs.reads] == [200]

    runs.reads.clear()
    fs.calls.clear()
    runs.set(f"run-{job}", "running")
    runs.report(f"run-{job}", 2)
    watcher.run_changed(f"run-{job}")  # Prefect's event stream names the run
    with Statements(store.db) as sql:
        started = time.perf_counter()
        changed = watcher.tick()
        took = time.perf_counter() - started
    assert changed == [job]
    assert runs.reads == [[f"run-{job}"]], "the tick read runs no event named"
    assert sum(fs.calls.values()) == 0, f"the tick used storage: {dict(fs.calls)}"
    assert _job(store, job)["status"] == "running" and _job(store, job)["shards_done"] == 2
    # The job found by its run (one indexed query), its state and its progress written: a
    # handful of statements, none of them a read of every active job.
    assert len(sql.seen) <= 12, sql.seen
    reads_of_jobs = [s for s in sql.seen if "FROM jobs" in s]
    assert reads_of_jobs and all("jobs.id = " in s or "jobs.flow_run_id IN" in s for s in reads_of_jobs), reads_of_jobs
    print(f"event tick with {OTHERS} other active jobs: {took * 1000:.1f} ms, {len(sql.seen)} statements, 1 run read")

    runs.reads.clear()
    assert watcher.tick() == [] and runs.reads == []  # nothing named, no pass due: nothing read


def test_progress_reaches_the_job_from_the_runs_own_report(rig):
    store, key, storage, fs, runs = rig
    (job,) = _jobs(store, key, runs, 1, n_shards=4)
    watcher = _watcher(runs, storage, store)
    watcher.tick()
    fs.calls.clear()
    # The job's folder holds no shard at all: the count can only come from the run's report.
    for reported, recorded in ((1, 1), (3, 3), (2, 3), (9, 4)):  # never lowered, never past its shards
        runs.report(f"run-{job}", reported)
        watcher.run_changed(f"run-{job}")
        watcher.tick()
        assert _job(store, job)["shards_done"] == recorded, (reported, recorded)
    assert sum(fs.calls.values()) == 0, dict(fs.calls)
    assert _job(store, job)["status"] == "running"


def test_the_paged_reread_records_a_missed_change_within_its_bound(rig):
    """No event names the run that failed: the re-read's pages (50 jobs a pass) find it within
    ceil(active / page) + 1 passes, each pass reading one page, never more."""
    store, key, storage, fs, runs = rig
    page = 50
    _jobs(store, key, runs, OTHERS)
    (job,) = _jobs(store, key, runs, 1)
    watcher = _watcher(runs, storage, store, interval=1e-6, page=page)  # every tick is a pass
    watcher.tick()
    watcher.tick()  # somewhere in the cycle: the bound holds from wherever it is
    runs.reads.clear()
    runs.set(f"run-{job}", "failed", message="the run failed")
    bound = math.ceil((OTHERS + 1) / page) + 1
    passes = 0
    while _job(store, job)["status"] != "failed":
        passes += 1
        assert passes <= bound, f"not recorded after {bound} passes"
        watcher.tick()
    assert all(len(r) <= page for r in runs.reads), [len(r) for r in runs.reads]
    assert _job(store, job)["error"]
    print(f"a missed change recorded after {passes} passes (bound {bound}) of {page} runs each")


def test_a_tick_starts_a_bounded_number_of_orphans_the_oldest_first(rig):
    """Jobs admitted by a replica that died before starting their runs: each interval's pass
    starts at most `ORPHANS_PER_TICK` of them, the oldest first, so many orphans at once never
    make one tick long; the next passes start the rest."""
    from datetime import timedelta

    from api.db import jobs, transaction, utcnow
    from api.watcher import ORPHANS_PER_TICK

    store, key, storage, fs, runs = rig
    n = ORPHANS_PER_TICK + 7
    admitted = utcnow() - timedelta(hours=1)
    ids = [str(uuid.uuid4()) for _ in range(n)]
    with transaction(store.db) as conn:
        conn.execute(insert(jobs), [{
            "id": job_id, "key_id": key.id, "model": "llama-tiny", "lane": "small", "status": "pending", "n_prompts": 1,
            "layers": [1], "shard_size": 1, "n_shards": 1, "shards_done": 0, "add_special_tokens": True,
            "contents": "activations", "reserved_tokens": 10, "created_at": admitted + timedelta(seconds=k),
            "request_url": f"memory://nowhere/jobs/{job_id}/request.json", "flow_run_id": None, "output_bytes": 1000,
        } for k, job_id in enumerate(ids)])
    watcher = _watcher(runs, storage, store, interval=1e-6)  # every tick is a pass
    watcher.tick()
    started = [job_id for job_id in ids if _job(store, job_id)["flow_run_id"] is not None]
    assert started == ids[:ORPHANS_PER_TICK]  # the oldest, in the store's own record
    watcher.tick()
    assert all(_job(store, job_id)["flow_run_id"] is not None for job_id in ids)


def test_the_lease_is_renewed_while_a_tick_is_stuck_and_nobody_takes_it_over(rig):
    from api.lease import Lease

    store, key, storage, fs, runs = rig
    (job,) = _jobs(store, key, runs, 1, status="pending")
    runs.set(f"run-{job}", "running")
    ttl = 1.0
    runs.block_s = 2.5 * ttl  # the first read of the first tick: Prefect slow to answer
    lease = Lease("watcher", "replica-a", ttl, store.db)
    other = Lease("watcher", "replica-b", ttl, store.db)

    held_before, tick_s_before = _sample("harvest_watcher_lease_renewals_total", outcome="held"), _sample("harvest_watcher_tick_seconds_sum")

    async def scenario():
        watcher = _watcher(runs, storage, store, interval=0.05, lease=lease)
        await watcher.start()
        try:
            assert await asyncio.to_thread(runs.entered.wait, 10), "no tick started"
            renewals_before = lease.renewals
            stuck_until = time.monotonic() + 2 * ttl
            takeovers = []
            while time.monotonic() < stuck_until:
                takeovers.append(await asyncio.to_thread(other.acquire))
                await asyncio.sleep(0.1)
            renewed = lease.renewals - renewals_before
            deadline = time.monotonic() + 10
            while _job(store, job)["status"] != "running":  # the stuck tick, still the holder, records it
                assert time.monotonic() < deadline, "the tick never wrote"
                await asyncio.sleep(0.05)
            return takeovers, renewed, lease.current_holder()
        finally:
            await watcher.stop()

    takeovers, renewed, holder = asyncio.run(scenario())
    assert not any(takeovers), "another replica took the lease while its holder was alive"
    assert renewed >= 3, f"{renewed} renewals in {2 * ttl} s (every {ttl / 3:.2f} s expected)"
    assert holder == "replica-a"
    assert lease.current_holder() is None  # a clean stop hands it over at once
    # What an operator sees (`harvest_watcher_*`): the renewals, and the stuck tick's seconds.
    assert _sample("harvest_watcher_lease_renewals_total", outcome="held") - held_before >= renewed
    assert _sample("harvest_watcher_tick_seconds_sum") - tick_s_before >= runs.block_s


def _sample(name: str, **labels: str) -> float:
    """A metric's value in this process's registry (the watcher's metrics count in memory here)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


class RenewalsFail:
    """A lease whose renewals fail after the first take (its database unreachable from this
    replica only): it lapses while the replica lives."""

    def __init__(self, lease):
        self._lease, self.takes = lease, 0

    def acquire(self):
        self.takes += 1
        if self.takes > 1:
            raise ConnectionError("the job store is unreachable")
        return self._lease.acquire()

    def __getattr__(self, name):
        return getattr(self._lease, name)


def test_a_tick_stuck_past_a_lapsed_lease_writes_nothing(rig):
    from api.lease import Lease

    store, key, storage, fs, runs = rig
    (job,) = _jobs(store, key, runs, 1, status="pending")
    runs.set(f"run-{job}", "failed", message="the run failed")
    ttl = 1.0
    runs.block_s = 2.5 * ttl
    lease = RenewalsFail(Lease("watcher", "replica-a", ttl, store.db))
    other = Lease("watcher", "replica-b", ttl, store.db)

    async def scenario():
        watcher = _watcher(runs, storage, store, interval=0.05, lease=lease)
        await watcher.start()
        try:
            assert await asyncio.to_thread(runs.entered.wait, 10), "no tick started"
            deadline = time.monotonic() + 5
            while not await asyncio.to_thread(other.acquire):  # once it lapsed, another replica takes it
                assert time.monotonic() < deadline, "the lapsed lease was never free"
                await asyncio.sleep(0.1)
            renewals = []
            until = time.monotonic() + 2.5 * ttl  # the stuck read returns meanwhile
            while time.monotonic() < until:  # the new holder renews, as its own keeper would
                renewals.append(await asyncio.to_thread(other.acquire))
                await asyncio.sleep(0.2)
            assert not watcher.holding()
            return renewals
        finally:
            await watcher.stop()

    errors_before = _sample("harvest_watcher_lease_renewals_total", outcome="error")
    renewals = asyncio.run(scenario())
    assert all(renewals), "the new holder lost the lease"
    assert _sample("harvest_watcher_lease_renewals_total", outcome="error") > errors_before  # the failed renewals, counted
    assert runs.reads, "the tick never read"
    assert _job(store, job)["status"] == "pending", "a tick wrote after its lease was lost"
    assert other.current_holder() == "replica-b"


def test_a_runs_report_is_its_label_and_only_the_jobs_own_run_reports(tmp_path, monkeypatch):
    """The flow side (`flows.progress.RunProgress.report`): the count goes on the job's own
    run as the `harvest.shards_done` label, then an event naming the run, only when it moved
    and the run's end will not say it (not the last shard); a helper run reports nothing; the
    labels go out on the run's label thread, each count in turn, without the shard loop
    waiting; and `flows.run_status` reads the label back."""
    from contextlib import nullcontext
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Running

    import flows.progress as progress
    from flows.run_status import PROGRESS_EVENT, SHARDS_DONE_LABEL, run_status
    from harvest.jobfiles import JobFiles
    from harvest.storage import Storage

    class Client:
        def __init__(self):
            self.labels: list[dict] = []

        def update_flow_run_labels(self, run_id, labels):
            self.labels.append(labels)

    events = []
    monkeypatch.setattr(progress, "emit_event", lambda name, **kw: events.append((name, kw)))
    run = object.__new__(progress.RunProgress)  # a run's view of itself, without a Prefect server
    client = Client()
    run.id, run.n_shards = uuid4(), 3
    run.writer = progress.ProgressWriter(run.id, "harvest-progress-test", client=lambda: nullcontext(client))
    run.files = JobFiles(Storage(f"file://{tmp_path / 'job'}"))
    run.shards_done, run.job_split, run.reported = 0, None, None
    run.report()
    assert run.writer.flush(10)
    assert client.labels == [] and events == []  # a helper's (or not yet the job's) count
    run.reports_for_job(split=False)
    for done in (1, 1, 2, 3):  # 3: the last shard, which the run's end reports
        run.shards_done = done
        started = time.monotonic()
        run.report()
        assert time.monotonic() - started < 0.5  # the shard loop never waits for a label write
    assert run.writer.flush(10)
    run.writer.close()
    # Reported back to back, each count is still written, in turn, never folded into the next.
    assert client.labels == [{SHARDS_DONE_LABEL: "1"}, {SHARDS_DONE_LABEL: "2"}]
    assert [(name, kw["resource"]["prefect.resource.id"], kw["payload"]) for name, kw in events] == [
        (PROGRESS_EVENT, f"prefect.flow-run.{run.id}", {"shards_done": n}) for n in (1, 2)]

    flow_run = FlowRun(flow_id=uuid4(), state=Running(), run_count=1, labels={SHARDS_DONE_LABEL: "2", "harvest.slot": "0"})
    assert run_status(flow_run).status == "running" and run_status(flow_run).shards_done == 2
    assert run_status(FlowRun(flow_id=uuid4(), state=Running(), run_count=1)).shards_done is None
