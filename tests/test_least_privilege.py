"""Least privilege (issue #44, item 6): each process holds only the secrets it uses, and the
recipe's database users are one per database.

- `harvest.credentials.handed`: what a child is handed of its parent's secrets;
- a real engine server, started the way a run starts it, and a real worker process, started the
  way a worker host starts it, with every secret of the service in the starter's environment:
  read from /proc, neither holds the job store's URL, the metrics token or the links' key, and
  the engine server holds no storage or Prefect credential either;
- infra/postgres-init.sql run as it is (its names made unique) on this machine's PostgreSQL:
  each user can migrate its own database and cannot connect to the other's, the superuser's
  leftovers pass to their user on a second run.

The compose file and the MinIO policies are checked in tests/test_deploy_recipe.py; `/health`
in tests/test_keyless_limits.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest

from harvest.credentials import SECRETS, handed

REPO = Path(__file__).resolve().parent.parent
PG_INIT = REPO / "infra" / "postgres-init.sql"
PG_ADMIN = "host=127.0.0.1 port=5432 dbname=postgres user=postgres"

EVERY_SECRET = {name: f"secret-{name.lower()}" for name in SECRETS}
"""Each secret variable of the service, with a value of its own."""

NEVER_ON_A_WORKER_HOST = ("HARVEST_DATABASE_URL", "HARVEST_METRICS_TOKEN", "HARVEST_SIGNING_SECRET",
                          "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_DATABASE_CONNECTION_URL",
                          "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_PASSWORD",
                          "PREFECT_REDIS_MESSAGING_URL", "PREFECT_SERVER_DOCKET_URL", "HARVEST_REDIS_URL")


def test_handed_keeps_only_the_named_secrets():
    env = {**EVERY_SECRET, "HARVEST_ENGINE": "hf", "PATH": "/usr/bin"}
    assert handed(env) == {"HARVEST_ENGINE": "hf", "PATH": "/usr/bin"}
    assert handed(env, ["AWS_SECRET_ACCESS_KEY"]) == {"HARVEST_ENGINE": "hf", "PATH": "/usr/bin",
                                                      "AWS_SECRET_ACCESS_KEY": EVERY_SECRET["AWS_SECRET_ACCESS_KEY"]}
    with pytest.raises(ValueError, match="HARVEST_DATABASE_URI"):
        handed(env, ["HARVEST_DATABASE_URI"])  # a misspelt need hands nothing silently


def test_the_roles_children_are_handed_only_their_own():
    from fleet.processes import API_NEEDS, SERVER_NEEDS, WORKER_NEEDS
    from harvest.credentials import PREFECT_DATABASE, PREFECT_REDIS

    assert not set(NEVER_ON_A_WORKER_HOST) & set(WORKER_NEEDS)
    assert {"PREFECT_SERVER_API_AUTH_STRING", *PREFECT_DATABASE}.isdisjoint(API_NEEDS)
    assert set(PREFECT_DATABASE) <= set(SERVER_NEEDS)
    # A scaled control plane's Redis (fleet.control_plane) is its Prefect processes' alone.
    assert set(PREFECT_REDIS) <= set(SERVER_NEEDS)
    assert {*PREFECT_REDIS, "HARVEST_REDIS_URL"}.isdisjoint({*API_NEEDS, *WORKER_NEEDS})
    assert {"HARVEST_DATABASE_URL", "HARVEST_METRICS_TOKEN", "HARVEST_SIGNING_SECRET", "AWS_SECRET_ACCESS_KEY"}.isdisjoint(SERVER_NEEDS)


def _environ(pid: int) -> dict[str, str]:
    return psutil.Process(pid).environ()


def test_an_engine_server_holds_no_secret(tmp_path, monkeypatch):
    """Started by a run's `connect`, as on a worker host, from a run holding every secret."""
    from harvest.settings import Settings
    from harvest.warm.client import connect
    from harvest.warm.protocol import GroupFiles, stop_engine_servers

    for name, value in EVERY_SECRET.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(uuid.uuid4()))
    home = tmp_path / "h"
    files = GroupFiles(home, "cpu")
    try:
        connect(files, Settings(home=home)).close()
        pid = files.server_pid()
        assert pid is not None, files.log.read_text()[-2000:]
        env = _environ(pid)
    finally:
        stop_engine_servers(home)
    assert env.get("HARVEST_HOME") == str(home.resolve())  # it is the run's environment, narrowed
    assert set(SECRETS).isdisjoint(env), sorted(set(SECRETS) & set(env))
    assert not [k for k in env if k.startswith("PREFECT_")], sorted(k for k in env if k.startswith("PREFECT_"))
    assert not [v for v in env.values() if v.startswith("secret-")]


def test_a_worker_host_s_runs_never_hold_the_job_store_or_the_metrics_token(tmp_path, monkeypatch):
    """The Prefect worker a worker host starts (its flow runs get its environment, plus Prefect's
    per-run variables), read from /proc as soon as it runs."""
    from fleet.processes import start_worker

    for name, value in EVERY_SECRET.items():
        monkeypatch.setenv(name, value)
    worker = start_worker("least-privilege", "http://127.0.0.1:9/api", tmp_path / "worker.log", {"HARVEST_ENGINE": "hf"})
    try:
        # Until the child has exec'd, /proc shows the environment it forked with (the test's):
        # read it once the variable handed only to the worker is there.
        deadline = time.monotonic() + 30
        env = _environ(worker.pid)
        while "HARVEST_ENGINE" not in env and time.monotonic() < deadline:
            time.sleep(0.05)
            env = _environ(worker.pid)
    finally:
        worker.kill()
    assert env["HARVEST_ENGINE"] == "hf" and env["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    for name in NEVER_ON_A_WORKER_HOST:
        assert name not in env, name
    # What a run does need: the Prefect API and the bucket.
    for name in ("PREFECT_API_AUTH_STRING", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env.get(name) == EVERY_SECRET[name], name


# --- infra/postgres-init.sql on a real PostgreSQL ------------------------------------------------


def _admin(sql: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql)


def _connect(user: str, db: str) -> psycopg.Connection:
    # Trust auth on this machine's server: the password is not what is checked here, the
    # privileges are (CONNECT on the database, ownership).
    return psycopg.connect(f"host=127.0.0.1 port=5432 dbname={db} user={user}", autocommit=True)


@pytest.fixture
def pg_init(tmp_path):
    """postgres-init.sql with its users and databases given names of their own (the server is
    shared), and a way to run it as the superuser with the two passwords in its environment."""
    tag = uuid.uuid4().hex[:8]
    names = {"jobs_user": f"hj_{tag}", "prefect_user": f"hp_{tag}", "jobs": f"jobs_{tag}", "prefect": f"prefect_{tag}"}
    text = PG_INIT.read_text().replace("harvest_jobs", names["jobs_user"]).replace("harvest_prefect", names["prefect_user"])
    text = re.sub(r"\bjobs\b", names["jobs"], text)
    text = re.sub(r"\bprefect\b", names["prefect"], text)
    script = tmp_path / "init.sql"
    script.write_text(text)

    def run(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        passwords = {"JOBS_DB_PASSWORD": "jobs-pw", "PREFECT_DB_PASSWORD": "prefect-pw"} if env is None else env
        return subprocess.run(["psql", "-X", "-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1",
                               "-f", str(script)], env={**os.environ, **passwords}, capture_output=True, text=True, timeout=60)

    try:
        yield names, run
    finally:
        for db in (names["jobs"], names["prefect"]):
            _admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        for user in (names["jobs_user"], names["prefect_user"]):
            _admin(f'DROP ROLE IF EXISTS "{user}"')


def test_each_database_has_its_own_user(pg_init):
    from api.db import make_engine, upgrade

    names, run = pg_init
    done = run()
    assert done.returncode == 0, done.stderr
    with psycopg.connect(PG_ADMIN) as conn:
        owners = dict(conn.execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database WHERE datname = ANY(%s)",
                                   [[names["jobs"], names["prefect"]]]).fetchall())
        powers = conn.execute("SELECT bool_or(rolsuper OR rolcreatedb OR rolcreaterole) FROM pg_roles WHERE rolname = ANY(%s)",
                              [[names["jobs_user"], names["prefect_user"]]]).fetchone()[0]
    assert owners == {names["jobs"]: names["jobs_user"], names["prefect"]: names["prefect_user"]}
    assert powers is False

    # The job store's user migrates its database (the replicas' start) ...
    engine = make_engine(f"postgresql+psycopg://{names['jobs_user']}@127.0.0.1:5432/{names['jobs']}")
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    # ... Prefect's user does what Prefect's migrations need that is more than tables ...
    with _connect(names["prefect_user"], names["prefect"]) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    # ... and neither can connect to the other's database.
    for user, db in ((names["jobs_user"], names["prefect"]), (names["prefect_user"], names["jobs"])):
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            _connect(user, db).close()

    # Run again (a volume made before these users: the superuser's tables and functions), its
    # objects pass to the database's user, what the user made stays its own.
    with psycopg.connect(f"host=127.0.0.1 port=5432 dbname={names['jobs']} user=postgres", autocommit=True) as conn:
        conn.execute("CREATE TABLE leftover (id serial PRIMARY KEY)")
        conn.execute("CREATE FUNCTION leftover_fn() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    done = run()
    assert done.returncode == 0, done.stderr
    with psycopg.connect(f"host=127.0.0.1 port=5432 dbname={names['jobs']} user=postgres") as conn:
        others = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relowner <> %s::regrole "
            "UNION ALL SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace AND proowner <> %s::regrole",
            [names["jobs_user"], names["jobs_user"]]).fetchall()
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert others == [] and {"leftover", "jobs", "api_keys"} <= tables, (others, tables)


def test_the_init_refuses_to_run_without_the_passwords(pg_init):
    names, run = pg_init
    done = run({"JOBS_DB_PASSWORD": "", "PREFECT_DB_PASSWORD": "x"})
    assert done.returncode != 0 and "JOBS_DB_PASSWORD" in done.stderr, done.stderr
    with psycopg.connect(PG_ADMIN) as conn:
        made = conn.execute("SELECT count(*) FROM pg_roles WHERE rolname = %s", [names["jobs_user"]]).fetchone()[0]
    assert made == 0
