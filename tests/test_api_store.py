"""The job store on SQLite and on PostgreSQL (127.0.0.1:5432, database `test`): atomic
admission under every cap, charging rules, charged-once, status that never goes back, the
restart budget of runs whose host died, the watcher lease, activation quota, per-key request
rates. Each test runs on a fresh database (a new SQLite file, a new PostgreSQL schema).

Charges are checked against `charge_ledger`, the append-only record written in the
transaction that ends a job, never against the `jobs.tokens` column the same code writes."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timezone

import pytest
from sqlalchemy import inspect, insert, select, text

from api.auth import activations_used, authenticate, create_key, reserve_activations, revoke_key, settle_activations
from api.db import JobStore, charge_ledger, jobs, make_engine, upgrade
from api.errors import NotCancellable, NotFound, RateLimited, Unauthorized
from api.runs import RunStatus
from api.settings import ApiSettings
from api.store import (
    active_jobs,
    admit,
    apply_state,
    attach_run,
    cancel_job,
    get_job,
    list_jobs,
    record_restart,
    set_spend_cap,
    tokens_used,
)
from harvest.lanes import load_lanes
from harvest.settings import Settings
from tests.api_fixtures import drop_pg_schema, pg_schema_url


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """A fresh job store, migrated: a new SQLite file, or a new schema on the PostgreSQL server."""
    if request.param == "sqlite":
        made = JobStore.from_url(f"sqlite:///{tmp_path / 'store.db'}").migrate()
        yield made
        made.dispose()
        return
    schema = f"harvest_test_{uuid.uuid4().hex[:10]}"
    url = pg_schema_url(schema)
    made = JobStore.from_url(url)
    try:
        made.migrate()
        yield made
    finally:
        made.dispose()
        drop_pg_schema(url, schema)


@pytest.fixture
def engine(store):
    """The store's engine of jobs, keys and charges (what most of the store's functions take)."""
    return store.db


def admit_on(key, job: dict, capacity: int, engine) -> dict:
    """`admit` on the job's lane as infra/lanes.toml declares it, with this capacity."""
    declared = load_lanes(Settings())[job["lane"]].model_copy(update={"capacity": capacity})
    return admit(key, job, declared=declared, engine=engine)


def _job(lane: str = "small", tokens: int = 10) -> dict:
    job_id = str(uuid.uuid4())
    return {
        "id": job_id,
        "model": "llama-tiny",
        "lane": lane,
        "n_prompts": 2,
        "layers": [2, 4, 6],
        "shard_size": 32,
        "n_shards": 1,
        "add_special_tokens": True,
        "contents": "activations",
        "reserved_tokens": tokens,
        "request_url": f"file:///x/jobs/{job_id}/request.json",
    }


def _race(n: int, fn) -> tuple[list, list]:
    """Run fn n times at once (a barrier releases them together); returns (results, errors)."""
    barrier = threading.Barrier(n)
    results, errors = [], []

    def one():
        barrier.wait()
        try:
            results.append(fn())
        except Exception as exc:  # noqa: BLE001 - collected and asserted on
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_migrations_create_the_schema_and_are_idempotent(engine):
    upgrade(engine)  # second time: nothing to do, no error
    names = set(inspect(engine).get_table_names())
    assert {"api_keys", "jobs", "usage", "service_flags", "lane_locks", "charge_ledger", "rate_buckets", "alembic_version"} <= names


def test_keys_are_hashed_at_rest_and_revocable(engine):
    key, record = create_key("alice", engine=engine)
    with engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT key_hash FROM api_keys").scalar_one()
    assert key not in stored and len(stored) == 64
    assert authenticate(f"Bearer {key}", engine=engine).id == record.id
    with pytest.raises(Unauthorized):
        authenticate(f"Bearer {key}x", engine=engine)
    with pytest.raises(Unauthorized):
        authenticate(None, engine=engine)
    assert revoke_key(record.id, engine=engine) == 1
    with pytest.raises(Unauthorized):
        authenticate(f"Bearer {key}", engine=engine)


def test_twenty_simultaneous_admissions_against_a_limit_of_three_admit_three(engine):
    _, key = create_key("racer", small=3, engine=engine)
    admitted, refused = _race(20, lambda: admit_on(key, _job(), 1000, engine))
    assert len(admitted) == 3, refused
    assert len(refused) == 17
    assert all(isinstance(e, RateLimited) and e.code == "harvest_concurrency_exceeded" for e in refused)
    assert "3 harvests on small models" in refused[0].message
    assert len(active_jobs(engine)) == 3


def test_lane_capacity_holds_across_keys_under_concurrency(engine):
    keys = [create_key(f"k{i}", small=10, engine=engine)[1] for i in range(10)]
    admitted, refused = _race(10, lambda: admit_on(keys.pop(), _job(), 4, engine))
    assert len(admitted) == 4
    assert {e.code for e in refused} == {"harvest_capacity_exceeded"}


def test_lanes_are_counted_separately(engine):
    _, key = create_key("lanes", small=1, large=1, engine=engine)
    admit_on(key, _job("large"), 10, engine)
    admit_on(key, _job("small"), 10, engine)  # a running large job never blocks small
    with pytest.raises(RateLimited, match="1 harvest on large models") as refused:
        admit_on(key, _job("large"), 10, engine)
    assert refused.value.code == "harvest_concurrency_exceeded"


def test_monthly_job_quota_counts_ended_jobs_too(engine):
    _, key = create_key("quota", monthly_jobs=2, engine=engine)
    first = admit_on(key, _job(), 10, engine)
    cancel_job(first["id"], key.id, engine=engine)
    admit_on(key, _job(), 10, engine)
    with pytest.raises(RateLimited) as refused:
        admit_on(key, _job(), 10, engine)
    assert refused.value.code == "harvest_quota_exceeded"


def test_token_budget_counts_held_and_charged_tokens(engine):
    _, key = create_key("budget", token_budget=100, engine=engine)
    held = admit_on(key, _job(tokens=60), 10, engine)
    with pytest.raises(RateLimited) as refused:
        admit_on(key, _job(tokens=50), 10, engine)
    assert refused.value.code == "budget_exceeded" and "40 of its 100" in refused.value.message
    # Done with 30 tokens charged: 70 left.
    attach_run(held["id"], "r", engine=engine)
    apply_state(held["id"], RunStatus("done"), result={"tokens": 30, "n_shards": 1}, engine=engine)
    with engine.connect() as conn:
        assert tokens_used(conn, key.id) == 30
    admit_on(key, _job(tokens=70), 10, engine)


def test_spend_cap_refuses_with_retry_after(engine):
    _, key = create_key("spend", engine=engine)
    set_spend_cap(120, engine=engine)
    with pytest.raises(RateLimited) as refused:
        admit_on(key, _job(), 10, engine)
    assert refused.value.code == "spend_cap" and refused.value.headers["Retry-After"] == "120"
    set_spend_cap(None, engine=engine)
    admit_on(key, _job(), 10, engine)


def _admitted(engine, key, tokens=10):
    row = admit_on(key, _job(tokens=tokens), 10, engine)
    attach_run(row["id"], f"run-{row['id']}", engine=engine)
    return row["id"]


def _ledger(engine, job_id: str) -> list[tuple]:
    """The job's charges as the ledger recorded them: (outcome, tokens_charged, key_id, lane)."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            select(charge_ledger.c.outcome, charge_ledger.c.tokens_charged, charge_ledger.c.key_id, charge_ledger.c.lane)
            .where(charge_ledger.c.job_id == job_id)
        ).all()]


def test_charging_rules(engine):
    _, key = create_key("charges", small=10, engine=engine)
    done = _admitted(engine, key, tokens=50)
    apply_state(done, RunStatus("running"), engine=engine)
    apply_state(done, RunStatus("done"), result={"tokens": 42, "n_shards": 1}, engine=engine)
    assert _ledger(engine, done) == [("done", 42, key.id, "small")]  # done → the tokens that ran

    failed = _admitted(engine, key)
    apply_state(failed, RunStatus("running"), engine=engine)
    apply_state(failed, RunStatus("failed", message="CUDA out of memory"), engine=engine)
    row = get_job(failed, engine=engine)
    assert row["status"] == "failed" and row["error"].startswith("internal_error: ") and "CUDA" not in row["error"]
    assert _ledger(engine, failed) == [("failed", 0, key.id, "small")]

    early = _admitted(engine, key)  # cancelled before its GPU run started → 0
    row, cancelled = cancel_job(early, key.id, engine=engine)
    assert cancelled and row["status"] == "cancelled"
    assert _ledger(engine, early) == [("cancelled", 0, key.id, "small")]

    late = _admitted(engine, key, tokens=33)  # cancelled after → the reserved tokens
    apply_state(late, RunStatus("running"), engine=engine)
    row, _ = cancel_job(late, key.id, engine=engine)
    assert row["status"] == "cancelled" and _ledger(engine, late) == [("cancelled", 33, key.id, "small")]

    again, cancelled = cancel_job(late, key.id, engine=engine)  # second cancel: same answer, no new charge
    assert not cancelled and again["tokens"] == 33
    assert _ledger(engine, late) == [("cancelled", 33, key.id, "small")]
    for ended in (done, failed):
        with pytest.raises(NotCancellable):
            cancel_job(ended, key.id, engine=engine)
    with pytest.raises(NotFound):
        cancel_job(late, "another-key", engine=engine)
    # Usage (`harvest keys list`, the token budget) is the ledger's sum: 42 + 0 + 0 + 33.
    from api.store import key_usage

    with engine.connect() as conn:
        assert tokens_used(conn, key.id) == 75
        assert key_usage(conn, key.id, retention_days=30)["tokens_charged"] == 75


def test_a_job_is_charged_once_however_many_endings_race(engine):
    """Twelve endings of one running job at once (done, cancel, failed, four of each): exactly
    one wins, and the ledger holds exactly one row for the job, the winner's charge."""
    _, key = create_key("once", engine=engine)
    job = _admitted(engine, key, tokens=20)
    apply_state(job, RunStatus("running"), engine=engine)
    endings = [
        ("done", 17, lambda: apply_state(job, RunStatus("done"), result={"tokens": 17, "n_shards": 1}, engine=engine)),
        ("cancelled", 20, lambda: cancel_job(job, key.id, engine=engine)[1]),
        ("failed", 0, lambda: apply_state(job, RunStatus("failed", message="x"), engine=engine)),
    ] * 4
    lock = threading.Lock()
    order = iter(endings)

    def one():
        outcome, tokens, end = next_of(order, lock)
        return outcome, tokens, end()

    results, errors = _race(len(endings), one)
    winners = [(outcome, tokens) for outcome, tokens, won in results if won is True]
    assert len(winners) == 1, (results, errors)
    # Losing cancels are refused (the job already ended done or failed) or answer the cancel.
    assert all(isinstance(e, NotCancellable) for e in errors), errors
    assert len(results) + len(errors) == 12
    (outcome, tokens), = winners
    assert _ledger(engine, job) == [(outcome, tokens, key.id, "small")]
    assert get_job(job, engine=engine)["status"] == outcome


def next_of(iterator, lock):
    with lock:
        return next(iterator)


def test_the_ledger_refuses_a_second_charge_and_any_change(engine):
    """The database itself keeps the ledger honest: UNIQUE(job_id) refuses a second row for a
    job, and triggers refuse UPDATE and DELETE, whatever code runs against it."""
    from sqlalchemy.exc import DBAPIError, IntegrityError

    _, key = create_key("ledger", engine=engine)
    job = _admitted(engine, key, tokens=9)
    cancel_job(job, key.id, engine=engine)
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            conn.execute(insert(charge_ledger).values(
                job_id=job, key_id=key.id, lane="small", tokens_charged=9, outcome="done", created_at=datetime.now(),
            ))
    for statement in ("UPDATE charge_ledger SET tokens_charged = 0", "DELETE FROM charge_ledger"):
        with pytest.raises(DBAPIError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(text(statement))
    assert _ledger(engine, job) == [("cancelled", 0, key.id, "small")]


def test_migration_0004_records_jobs_that_ended_before_it(tmp_path):
    """A store at revision 0003 with ended and active jobs: upgrading writes one ledger row per
    ended job (its tokens, its outcome) and none for the active one."""
    from alembic import command
    from alembic.config import Config
    from pathlib import Path

    import api.db

    eng = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    config = Config()
    config.set_main_option("script_location", str(Path(api.db.__file__).parent / "migrations"))
    with eng.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0003")
        conn.execute(text(
            "INSERT INTO api_keys (id, name, key_hash, prefix, created_at) VALUES ('k1', 'old', 'h', 'acs_x', '2026-01-01 00:00:00.000000')"
        ))
        for job_id, status, tokens in (("j-done", "done", 40), ("j-cancel", "cancelled", 7), ("j-run", "running", None)):
            conn.execute(text(
                "INSERT INTO jobs (id, key_id, model, lane, status, n_prompts, layers, shard_size, n_shards, shards_done, "
                "add_special_tokens, contents, reserved_tokens, tokens, created_at, completed_at, request_url, restarts) "
                "VALUES (:id, 'k1', 'llama-tiny', 'small', :status, 1, '[1]', 32, 1, 0, 1, 'activations', 50, :tokens, "
                "'2026-01-02 00:00:00.000000', :completed, 'file:///x', 0)"
            ), {"id": job_id, "status": status, "tokens": tokens, "completed": None if tokens is None else "2026-01-03 00:00:00.000000"})
    upgrade(eng)
    assert _ledger(eng, "j-done") == [("done", 40, "k1", "small")]
    assert _ledger(eng, "j-cancel") == [("cancelled", 7, "k1", "small")]
    assert _ledger(eng, "j-run") == []
    eng.dispose()


def test_status_comes_from_the_database_and_never_goes_back(engine):
    _, key = create_key("forward", small=10, engine=engine)
    job = _admitted(engine, key, tokens=25)
    assert apply_state(job, RunStatus("pending"), engine=engine) is False
    assert apply_state(job, RunStatus("running"), engine=engine) is True
    # A run rescheduled after its host died reads pending again: the job stays running.
    assert apply_state(job, RunStatus("pending"), engine=engine) is False
    assert apply_state(job, RunStatus("running"), engine=engine) is False  # no change, no announcement
    with engine.connect() as conn:
        assert conn.execute(select(jobs.c.status).where(jobs.c.id == job)).scalar_one() == "running"
    assert apply_state(job, RunStatus("done"), result={"tokens": 24, "n_shards": 1}, engine=engine) is True
    for later in (RunStatus("running"), RunStatus("pending"), RunStatus("failed", message="x")):
        assert apply_state(job, later, engine=engine) is False
    with engine.connect() as conn:
        assert conn.execute(select(jobs.c.status).where(jobs.c.id == job)).scalar_one() == "done"
    assert _ledger(engine, job) == [("done", 24, key.id, "small")]


def test_a_job_whose_hosts_keep_dying_fails_after_its_restart_budget_charged_nothing(engine):
    _, key = create_key("crashes", engine=engine)
    job = _admitted(engine, key, tokens=30)
    apply_state(job, RunStatus("running"), engine=engine)
    assert [record_restart(job, 2, engine=engine) for _ in range(3)] == [True, True, False]
    with engine.connect() as conn:
        status, tokens, error, restarts = conn.execute(
            select(jobs.c.status, jobs.c.tokens, jobs.c.error, jobs.c.restarts).where(jobs.c.id == job)
        ).one()
    assert (status, restarts) == ("failed", 2) and "died 3 times" in error
    assert _ledger(engine, job) == [("failed", 0, key.id, "small")]
    assert record_restart(job, 2, engine=engine) is False  # ended: nothing more to count


def test_one_holder_of_the_watcher_lease_at_a_time(engine):
    import time

    from api.lease import Lease

    a, b = Lease("watcher", "replica-a", 0.5, engine), Lease("watcher", "replica-b", 0.5, engine)
    assert a.acquire() and not b.acquire()
    assert a.acquire()  # renewal
    assert a.current_holder() == "replica-a"
    time.sleep(0.7)  # a stopped renewing (died): b takes over once it expired
    assert b.acquire() and not a.acquire()
    assert b.current_holder() == "replica-b"
    b.release()  # a clean stop hands over at once
    assert a.acquire()
    holders, _ = _race(8, lambda: Lease("watcher", f"r-{uuid.uuid4().hex[:6]}", 30, engine).acquire())
    assert holders.count(True) == 0  # a holds it: nobody else may take it, however many try
    a.release()
    winners, _ = _race(8, lambda: Lease("watcher", f"r-{uuid.uuid4().hex[:6]}", 30, engine).acquire())
    assert winners.count(True) == 1


def test_listing_is_newest_first_and_paginated(engine):
    _, key = create_key("lister", small=100, engine=engine)
    _, other = create_key("other", engine=engine)
    ids = [admit_on(key, _job(), 100, engine)["id"] for _ in range(5)]
    admit_on(other, _job(), 100, engine)
    page, more = list_jobs(key.id, limit=2, engine=engine)
    assert more and [r["id"] for r in page] == ids[::-1][:2]
    rest, more = list_jobs(key.id, limit=10, after=page[-1]["id"], engine=engine)
    assert not more and [r["id"] for r in rest] == ids[::-1][2:]


def test_activation_quota_holds_under_concurrency(engine):
    _, key = create_key("inline", activation_quota=10, engine=engine)
    counted, refused = _race(12, lambda: reserve_activations(key, 2, engine=engine))
    assert len(counted) == 5
    assert len(refused) == 7 and {e.code for e in refused} == {"activation_quota_exceeded"}
    assert activations_used(key.id, engine=engine) == 10
    # Settled to what the responses returned: the holds' surplus comes back.
    for month in counted:
        settle_activations(key, month, 2, 1, engine=engine)
    assert activations_used(key.id, engine=engine) == 5
    _, unlimited = create_key("free", engine=engine)
    for _ in range(3):
        reserve_activations(unlimited, 1000, engine=engine)


def test_times_are_stored_as_utc(engine):
    _, key = create_key("clock", engine=engine)
    before = datetime.now(timezone.utc).replace(tzinfo=None)
    row = admit_on(key, _job(), 10, engine)
    stored = get_job(row["id"], engine=engine)["created_at"]
    assert abs((stored - before).total_seconds()) < 5


def test_job_changes_reach_every_replicas_listener_after_commit_only(engine):
    """What wakes long-polls on every replica: one listener per replica (two here, as two API
    processes would have), each told of a committed change, never of a rolled-back one."""
    import queue
    import time

    from api.db import job_changed, transaction
    from api.notify import JobChanges

    inboxes = [queue.Queue(), queue.Queue()]
    listeners = [JobChanges(inbox.put, engine) for inbox in inboxes]
    for listener in listeners:
        listener.start()
    try:
        assert all(listener.listening.wait(10) for listener in listeners)
        _, key = create_key("notify", engine=engine)
        job = _admitted(engine, key)
        with pytest.raises(RuntimeError):
            with transaction(engine) as conn:
                job_changed(conn, job)
                raise RuntimeError("rolled back")
        time.sleep(0.5)
        assert all(job not in list(inbox.queue) for inbox in inboxes)  # nothing of a rollback
        apply_state(job, RunStatus("running"), engine=engine)
        for inbox in inboxes:
            deadline = time.monotonic() + 5
            while inbox.get(timeout=max(deadline - time.monotonic(), 0.01)) != job:
                pass  # another test's job on the same server
    finally:
        for listener in listeners:
            listener.stop()


def test_two_sqlite_stores_in_one_process_never_hear_each_others_changes(tmp_path):
    """The listeners of a SQLite store are its engine's (`api.db.local_listeners`), not the
    process's: before, a change in one store woke the other's long-polls too."""
    from api.db import job_changed, transaction
    from api.notify import JobChanges

    stores = [JobStore.from_url(f"sqlite:///{tmp_path / name}.db").migrate() for name in "ab"]
    heard: dict[str, list[str]] = {"a": [], "b": []}
    listeners = [JobChanges(heard[name].append, store.db) for name, store in zip("ab", stores)]
    for listener in listeners:
        listener.start()
    try:
        with transaction(stores[0].db) as conn:
            job_changed(conn, "job-in-a")
        with transaction(stores[1].db) as conn:
            job_changed(conn, "job-in-b")
        assert heard == {"a": ["job-in-a"], "b": ["job-in-b"]}
    finally:
        for listener in listeners:
            listener.stop()
        for store in stores:
            store.dispose()


def test_a_keys_request_rate_holds_under_concurrency_across_replicas(engine):
    """The token bucket lives in the job store: 30 requests at once through two engines (two
    API replicas' connection pools) against a burst of 10 take exactly 10 tokens; another key
    is untouched; tokens come back at the configured rate."""
    import time

    from api.ratelimit import take

    url = engine.url.render_as_string(hide_password=False)
    other_replica = make_engine(url)
    try:
        now = time.time()
        engines = [engine, other_replica] * 15
        lock = threading.Lock()
        order = iter(engines)
        results, errors = _race(30, lambda: take("key-a", "read", per_s=1.0, burst=10, now=now, engine=next_of(order, lock)))
        assert not errors, errors
        assert sum(1 for wait in results if wait == 0.0) == 10
        assert all(0 < wait <= 1.0 for wait in results if wait != 0.0)
        assert take("key-b", "read", per_s=1.0, burst=10, now=now, engine=engine) == 0.0  # not starved
        assert take("key-a", "submit", per_s=1.0, burst=10, now=now, engine=engine) == 0.0  # kinds are separate
        # 2.5 s later two tokens are back (the bucket never overfills): two pass, the third waits 0.5 s.
        later = [take("key-a", "read", per_s=1.0, burst=10, now=now + 2.5, engine=engine) for _ in range(3)]
        assert later[:2] == [0.0, 0.0] and later[2] == pytest.approx(0.5)
        # A replica whose clock is behind never refills a bucket backwards.
        assert take("key-a", "read", per_s=1.0, burst=10, now=now, engine=other_replica) == pytest.approx(0.5)
    finally:
        other_replica.dispose()


def test_a_requests_key_and_bucket_are_one_transaction_whose_commit_skips_the_disk_wait(store):
    """`authenticate_within_rate`, which every request with a key pays: one transaction for the
    key and its bucket, on PostgreSQL on connections whose commits do not wait for the WAL to
    reach the disk (`synchronous_commit=off`), while the jobs' engine stays durable. Read back
    from the server's own settings and, for the bucket, through the jobs' engine."""
    from sqlalchemy import event

    from api.db import rate_buckets
    from api.ratelimit import authenticate_within_rate

    engine, rates = store.db, store.rates
    begun = {"rates": 0, "jobs": 0}
    event.listen(rates, "begin", lambda _conn: begun.__setitem__("rates", begun["rates"] + 1))
    if rates is not engine:
        event.listen(engine, "begin", lambda _conn: begun.__setitem__("jobs", begun["jobs"] + 1))
    key, record = create_key("reader", rate_read_burst=5, engine=engine)
    begun.update(rates=0, jobs=0)

    assert authenticate_within_rate(f"Bearer {key}", "read", ApiSettings(), store).id == record.id
    assert begun == {"rates": 1, "jobs": 0}
    with engine.connect() as conn:
        tokens = conn.execute(select(rate_buckets.c.tokens).where(rate_buckets.c.key_id == record.id)).scalar_one()
    assert tokens == pytest.approx(4.0, abs=0.01)  # one of the burst of 5 taken

    with pytest.raises(Unauthorized):
        authenticate_within_rate("Bearer acs_" + "0" * 32, "read", ApiSettings(), store)
    with engine.connect() as conn:
        assert conn.execute(select(rate_buckets.c.key_id)).scalars().all() == [record.id]  # none for the unknown key

    if engine.dialect.name == "postgresql":
        assert rates is not engine
        with rates.connect() as conn:
            assert conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar_one() == "off"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar_one() == "on"
    else:
        assert rates is engine  # SQLite: one store, one writer


def test_job_reads_on_postgresql_send_no_begin_and_leave_the_pool_transactional(engine):
    """`api.db.reading` (job reads and list pages): on PostgreSQL each statement is its own
    transaction (no BEGIN/COMMIT round trips), read from the server's clocks: inside a
    transaction `now()` is when it began, so after a sleep it lags `statement_timestamp()`.
    The same pooled connection then runs `transaction()` transactionally again."""
    from api.db import reading, transaction

    key, record = create_key("lister", engine=engine)
    job = _job()
    admit_on(record, job, 10, engine)
    assert get_job(job["id"], record.id, engine=engine)["id"] == job["id"]
    assert list_jobs(record.id, limit=5, engine=engine)[0][0]["id"] == job["id"]
    if engine.dialect.name != "postgresql":
        return  # SQLite: a transaction as usual
    with reading(engine) as conn:
        conn.execute(text("SELECT pg_sleep(0.05)"))
        assert conn.execute(text("SELECT now() < statement_timestamp() - interval '40 milliseconds'")).scalar_one() is False
    engine.pool.dispose()  # so the pool holds one connection: `transaction` below gets the one `reading` used
    with reading(engine) as conn:
        pass
    with transaction(engine) as conn:
        conn.execute(text("SELECT pg_sleep(0.05)"))
        assert conn.execute(text("SELECT now() < statement_timestamp() - interval '40 milliseconds'")).scalar_one() is True
