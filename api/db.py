"""The job store's database: tables, the store's engines (`JobStore`), transactions, and
schema migrations (Alembic).

SQLite is the embedded default (`<home>/harvest.db`), PostgreSQL the production store; the same
code runs on both. What differs is how a transaction takes the lock that makes admission
atomic (see `locked`): PostgreSQL locks rows with `SELECT … FOR UPDATE`, SQLite has no row
locks, so every transaction here starts with `BEGIN IMMEDIATE`, which takes the database's
write lock up front. Both mean two submits that count the same key's jobs never interleave.

A `JobStore` (one store's engines) is made by whoever owns the process's parts (the app
factory, the `harvest keys` command, a test) and handed in: every function here and in
`api.store`, `api.auth`, `api.ratelimit`, `api.idempotency` and `api.lease` takes the engine
it works on. No engine lives in a module global, so two apps in one process keep their own
stores.

All times are stored as naive UTC (SQLite keeps no zone) and made aware on the way out.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import Connection, Engine

from api.settings import ApiSettings
from harvest.private_files import open_private
from harvest.settings import get_settings

__all__ = [
    "metadata",
    "api_keys",
    "jobs",
    "key_lane_limits",
    "usage",
    "service_flags",
    "lane_locks",
    "leases",
    "charge_ledger",
    "rate_buckets",
    "idempotency_keys",
    "database_url",
    "make_engine",
    "JobStore",
    "upgrade",
    "transaction",
    "reading",
    "locked",
    "ensure_row",
    "JOB_CHANNEL",
    "job_changed",
    "local_listeners",
    "LocalListeners",
    "utcnow",
    "aware",
]

metadata = MetaData()

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("prefix", String(16), nullable=False),
    Column("created_at", DateTime, nullable=False),
    Column("revoked_at", DateTime, nullable=True),
    Column("monthly_jobs", Integer, nullable=True),
    Column("token_budget", Integer, nullable=True),
    Column("activation_quota", Integer, nullable=True),
    # The key's own request rates (`api.ratelimit`); NULL: the service's HARVEST_RATE_* settings.
    Column("rate_submit_per_s", Float, nullable=True),
    Column("rate_submit_burst", Integer, nullable=True),
    Column("rate_read_per_s", Float, nullable=True),
    Column("rate_read_burst", Integer, nullable=True),
    # Bytes the key's kept job files may hold (`api.store.bytes_held`); NULL: the service's
    # HARVEST_STORAGE_QUOTA_BYTES (unlimited unless set).
    Column("storage_quota", BigInteger, nullable=True),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("key_id", String(40), ForeignKey("api_keys.id"), nullable=False),
    Column("model", String(200), nullable=False),
    Column("lane", String(32), nullable=False),
    Column("status", String(16), nullable=False),
    Column("n_prompts", Integer, nullable=False),
    Column("layers", JSON, nullable=False),
    Column("shard_size", Integer, nullable=False),
    Column("n_shards", Integer, nullable=False),
    Column("shards_done", Integer, nullable=False, default=0),
    Column("add_special_tokens", Boolean, nullable=False),
    Column("contents", String(16), nullable=False),
    Column("reserved_tokens", Integer, nullable=False),
    Column("tokens", Integer, nullable=True),
    Column("created_at", DateTime, nullable=False),
    Column("started_at", DateTime, nullable=True),
    Column("completed_at", DateTime, nullable=True),
    Column("error", Text, nullable=True),
    Column("request_url", Text, nullable=False),
    Column("flow_run_id", String(64), nullable=True),
    Column("restarts", Integer, nullable=False, default=0, server_default="0"),
    Column("result", JSON, nullable=True),
    # Set when a start failed after its run may have been created: the watcher cancels the
    # job's runs by their `job:<id>` tag until that succeeds (`api.watcher`).
    Column("stop_run", Boolean, nullable=False, default=False, server_default="0"),
    # Bytes of the job's folder: the most it can hold (`harvest.cost.kept_bytes`) until
    # `bytes_measured_at`, then what it held once ended and settled (`api.store`). NULL for jobs
    # admitted before migration 0007.
    Column("output_bytes", BigInteger, nullable=True),
    # When `output_bytes` became the measure of the job's ended, settled folder; NULL while it
    # is the admitted bound (active jobs, and ended jobs whose runs may still write: `api.store`).
    Column("bytes_measured_at", DateTime, nullable=True),
    Index("ix_jobs_key_created", "key_id", "created_at"),
    Index("ix_jobs_status", "status"),
    Index("ix_jobs_bytes_measured", "bytes_measured_at"),
    # The watcher's reads (`api.watcher`), each as long as its answer, however many jobs
    # there are: the jobs of the runs an event named, its re-read's next page of active jobs
    # in id order, and the jobs whose runs a failed start left to stop (a few among many).
    Index("ix_jobs_flow_run", "flow_run_id"),
    Index("ix_jobs_status_id", "status", "id"),
    Index("ix_jobs_stop_run", "stop_run"),
)

# A key's own cap of concurrent jobs in a lane; without a row the lane's `key_limit` applies
# (infra/lanes.toml), so a new lane needs no migration and existing keys get its default.
key_lane_limits = Table(
    "key_lane_limits",
    metadata,
    Column("key_id", String(40), ForeignKey("api_keys.id"), primary_key=True),
    Column("lane", String(32), primary_key=True),
    Column("max_jobs", Integer, nullable=False),
)

usage = Table(
    "usage",
    metadata,
    Column("key_id", String(40), ForeignKey("api_keys.id"), primary_key=True),
    Column("month", String(7), primary_key=True),
    Column("activations", Integer, nullable=False, default=0),
)

service_flags = Table(
    "service_flags",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=True),
    Column("updated_at", DateTime, nullable=False),
)

# One row per lease; `api.lease` takes and renews them (the watcher's: one API replica follows
# Prefect at a time).
leases = Table(
    "leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("expires_at", DateTime, nullable=False),
)

# The record of what each ended job was charged: one row per job (UNIQUE job_id), appended in
# the transaction that ends the job and never changed (triggers refuse UPDATE and DELETE,
# migration 0004). Usage and budgets are sums over it (`api.store`).
charge_ledger = Table(
    "charge_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(36), nullable=False, unique=True),
    Column("key_id", String(40), nullable=False),
    Column("lane", String(32), nullable=False),
    Column("tokens_charged", Integer, nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("created_at", DateTime, nullable=False),
    Index("ix_charge_ledger_key_created", "key_id", "created_at"),
)

# A token bucket per key and request kind (`api.ratelimit`), shared by every API replica.
rate_buckets = Table(
    "rate_buckets",
    metadata,
    Column("key_id", String(40), primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("tokens", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# A submit's Idempotency-Key, per API key (`api.idempotency`): claimed before admission, bound
# to the job it made (job_id NULL while that submit is in flight), with the sha256 of the
# request it came with, so a repeat answers the same job and another body a 409.
idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("key_id", String(40), ForeignKey("api_keys.id"), primary_key=True),
    Column("idempotency_key", String(255), primary_key=True),
    Column("request_sha256", String(64), nullable=False),
    Column("job_id", String(36), nullable=True),
    Column("created_at", DateTime, nullable=False),
)

# One row per lane, locked (FOR UPDATE) by every admission on that lane, so the service-wide
# queue capacity holds under concurrent submits from different keys.
lane_locks = Table("lane_locks", metadata, Column("lane", String(32), primary_key=True))


def utcnow() -> datetime:
    """Now, as the naive UTC the tables store."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def aware(value: datetime | None) -> datetime | None:
    return None if value is None else value.replace(tzinfo=timezone.utc)


def database_url(settings: ApiSettings) -> str:
    return settings.database_url or f"sqlite:///{settings.home / 'harvest.db'}"


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """An engine whose transactions lock the way admission needs (module docstring); on
    PostgreSQL a pool of `pool_size` connections, `max_overflow` more at a peak."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1] if "///" in url else ""
        if path and path != ":memory:":
            # Owner-only before SQLite opens it (its journal takes the file's mode): the store
            # holds key hashes, prompts' requests and who submitted what.
            os.close(open_private(path, os.O_RDWR | os.O_CREAT))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               execution_options={_LISTENERS: LocalListeners()})

        @event.listens_for(engine, "connect")
        def _connect(dbapi_connection, _record):
            # Let SQLAlchemy, not the driver, decide when a transaction begins…
            dbapi_connection.isolation_level = None
            dbapi_connection.execute("PRAGMA busy_timeout = 30000")
            dbapi_connection.execute("PRAGMA foreign_keys = ON")

        @event.listens_for(engine, "begin")
        def _begin(conn):
            # …and begin it IMMEDIATE: the write lock is taken before the first read, so
            # read-count-insert sequences are serialised (SQLite's equivalent of FOR UPDATE).
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)


MIGRATION_LOCK = 0x68617276  # an arbitrary constant: "harv"


class JobStore:
    """One job store as an app or a command uses it: `db` (SQLAlchemy's engine: a model's engine
    is another thing, `harvest.engines`) for jobs, charges, keys and quotas, whose commits are durable, and `rates` for the per-key request rates
    (`api.ratelimit`).

    On PostgreSQL `rates` is a second pool on the same store whose commits do not wait for the
    write-ahead log to reach the disk (`synchronous_commit=off`, on its connections only). Every
    request of every key commits a bucket, so that wait would sit in front of every read; what
    a crash can lose is a bucket's last fraction of a second, which only gives keys back a few
    tokens. Its pool holds at most 15 connections (its transactions are short; more callers
    wait), so a replica opens at most 45 to the store. On SQLite `rates` is `db` itself.

    Made by whoever owns the process's parts (`api.app.create_app`, the `harvest keys` command,
    a test) and handed to what uses it; nothing looks a store up. The schema is brought to the
    newest revision by `migrate` (the app's lifespan does it before the first request).
    """

    def __init__(self, db: Engine):
        self.db = db
        self.rates = db if db.dialect.name != "postgresql" else _without_disk_wait(db)
        self._migrated = False
        self._migrating = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> "JobStore":
        """The store at `url` (`sqlite:///path` or `postgresql://…`: `make_engine`)."""
        return cls(make_engine(url))

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> "JobStore":
        """The store HARVEST_DATABASE_URL names (default SQLite at `<home>/harvest.db`)."""
        return cls.from_url(database_url(settings))

    @property
    def url(self) -> str:
        """The store's URL, password included (what a LISTEN connection opens: `api.notify`)."""
        return self.db.url.render_as_string(hide_password=False)

    def migrate(self) -> "JobStore":
        """Bring the schema to the newest revision, once however many threads ask (`upgrade`)."""
        with self._migrating:
            if not self._migrated:
                upgrade(self.db)
                self._migrated = True
        return self

    def dispose(self) -> None:
        """Close the pools' connections (a test's store, a command that is done)."""
        if self.rates is not self.db:
            self.rates.dispose()
        self.db.dispose()


def _without_disk_wait(engine: Engine) -> Engine:
    """A pool on the same PostgreSQL store whose commits skip the disk wait (`JobStore.rates`)."""
    # Added to the URL's own `options` (a schema's search_path may be there).
    options = " ".join(filter(None, (engine.url.query.get("options"), "-c synchronous_commit=off")))
    url = engine.url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    return make_engine(url, pool_size=5, max_overflow=10)


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (idempotent)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Replicas starting together would race to create the same tables: the first to
            # take this lock migrates, the others then find the schema at head. (SQLite's
            # BEGIN IMMEDIATE already serialises them.)
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


JOB_CHANNEL = "harvest_job_changed"
"""PostgreSQL channel on which every change of a job's status is announced (payload: job id)."""

class LocalListeners:
    """Callbacks `fn(job_id)` called after a commit that changed a job in one SQLite store: the
    store's engine holds them (`local_listeners`), so two stores in one process never hear
    each other's changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []

    def add(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def remove(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def tell(self, job_id: str) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(job_id)


_LISTENERS = "harvest_local_listeners"
"""The execution option of a SQLite engine that holds its `LocalListeners` (`make_engine`):
SQLAlchemy's place for what belongs to one engine."""


def local_listeners(engine: Engine) -> LocalListeners | None:
    """The listeners of a SQLite store's engine (None on PostgreSQL, which notifies itself)."""
    return engine.get_execution_options().get(_LISTENERS)

_CHANGED = "harvest_changed_jobs"


def job_changed(conn: Connection, job_id: str) -> None:
    """Announce, once this transaction commits, that the job's status changed.

    On PostgreSQL this is `pg_notify`: the server delivers it at commit, to every API replica
    that LISTENs (`api.notify`), this one included, and drops it on rollback. SQLite is the
    single-process store: the announcement goes to the `local_listeners` of its engine.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_notify(:channel, :job_id)"), {"channel": JOB_CHANNEL, "job_id": job_id})
    else:
        conn.info.setdefault(_CHANGED, set()).add(job_id)


@contextmanager
def transaction(engine: Engine):
    """One transaction on the store's `engine` (committed on success, rolled back on error)."""
    with engine.begin() as conn:
        conn.info.pop(_CHANGED, None)  # left by a transaction that rolled back
        yield conn
        changed = conn.info.pop(_CHANGED, ())
    listeners = local_listeners(engine) if changed else None
    for job_id in changed if listeners is not None else ():  # committed: tell the store's listeners
        listeners.tell(job_id)


@contextmanager
def reading(engine: Engine):
    """Reads only, and each statement may see its own snapshot: on PostgreSQL in autocommit,
    so no BEGIN and COMMIT round trips (a job read is the replica's commonest request, and on
    a busy host every round trip waits for a CPU twice); on SQLite a transaction as usual."""
    if engine.dialect.name != "postgresql":
        with transaction(engine) as conn:
            yield conn
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        yield conn


def ensure_row(conn: Connection, table: Table, **values) -> None:
    """Insert the row unless one with its key exists (no error, no aborted transaction)."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    conn.execute(insert(table).values(**values).on_conflict_do_nothing())


def locked(conn: Connection, table: Table, *where):
    """`SELECT … FOR UPDATE` (PostgreSQL row lock; SQLite already holds the write lock)."""
    from sqlalchemy import select

    query = select(table).where(*where)
    if conn.dialect.name != "sqlite":
        query = query.with_for_update()
    return conn.execute(query).mappings().first()


if __name__ == "__main__":  # `python -m api.db`: migrate HARVEST_DATABASE_URL to the newest schema
    url = database_url(get_settings(ApiSettings))
    upgrade(make_engine(url))
    print(f"{url}: schema at the newest revision")
