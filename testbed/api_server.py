"""API servers for tests and benches: the real app under a real uvicorn on loopback.

The tests' session fixtures (`tests.api_fixtures`; each server starts only when a test asks
for it, and is killed at session end):

``api_server`` → ``ApiServer``
    the real app (``testbed.api_factories``) run as a replica is (``fleet.roles.api_command``: uvicorn with the replica's
    HTTP parsing bounds and proxies) on 127.0.0.1 and a free port, with the project's own registry
    (infra/models.toml), its own SQLite job store and storage folder under the session's
    HARVEST_HOME. Harvest runs go to ``FileRuns`` (below), so no Prefect is needed; inline
    completions and ``/v1/models`` are served for real. ``.base_url`` is ``http://127.0.0.1:<port>/v1``.
``api_base_url`` → ``str``: ``api_server.base_url`` (what a client puts in ACS_API_BASE).
``make_key`` → ``make_key(**limits) -> str``: a fresh API key of ``api_server``, limits as in
    ``harvest keys create`` (``small``, ``large``, ``monthly_jobs``, ``token_budget``,
    ``activation_quota``; default: small 3, large 1, no quotas).
``harvest_api`` → ``ApiServer`` for the harvest tests: a test registry that adds
    ``llama-tiny-large`` (the tiny model on the large lane) and ``llama-tiny-noharvest``
    (served, not harvested), and ``llama-tiny-xl`` on a lane ``xl`` whose shards hold at most 1 MiB,
    a 0.2 s watcher, a waiter limit of 2 and a large-lane capacity of 2, and the tokenizers'
    parallelism as the app sets it (not the test session's). Its ``.make_key(**limits)`` works
    like ``make_key``.
For real Prefect runs, give an ``ApiServer`` ``app=PRODUCTION_APP`` (the production factory,
nothing swapped) and ``PREFECT_API_URL`` (as tests/test_stack.py does against a live
``make run``); ``app=FLOW_ENV_APP`` hands those runs an environment (``testbed.flow_env_runs``).

``ApiServer(env).start()`` starts more servers (e.g. to kill and restart one mid-job):
``.kill()`` (SIGKILL), ``.start()`` again on the same port, database and storage, ``.stop()``.

``harvest_up(home, models, env)`` runs ``harvest up`` (what `make run` runs) in a fresh
``home`` on free ports, with the built ``models`` copied in and ``env`` over the test's own
environment (no Prefect address or password: the stack makes its own); a context manager
giving the stack's ready lines (``ACS_API_BASE``, ``ACS_API_KEY``, ``PREFECT_UI``) plus
``home``, ``prefect_api_url`` and ``prefect_auth``, and stopping the stack (SIGTERM) on exit.

``serve_in_thread(app, settings=None)`` serves an app made by ``api.app.create_app`` (with the parts a test
swaps: an engine pool on the session's engine, a budget or limiter of its own) under uvicorn in
a thread of the test process, with a replica's HTTP server options (of ``settings``), without its lifespan (no watcher: the routes these tests call
need none; no migration either: hand such an app ``store=job_store``); a context manager giving
the server's root URL.
``job_store`` → ``api.db.JobStore``: the session's own job store (SQLite at
``<HARVEST_HOME>/harvest.db``, the default of the session's settings), migrated. The apps a test
serves in its own process are made with it (``create_app(store=job_store)``), and the test makes
their keys in it (``create_key(name, engine=job_store.db)``) and counts its statements there.

``FileRuns`` is the run store of the Prefect-free servers: the one seam the API tests fake.
Each ``read`` appends a line to ``<runs_dir>/reads.log``; a file ``<runs_dir>/unreachable``
makes reads fail as a Prefect server that is down would, ``<runs_dir>/start-fails`` starts;
``<runs_dir>/start-fails-after-create`` makes a start create the run and then fail (an answer
lost on its way back), and ``<runs_dir>/cancel-fails`` makes cancels fail;
``<runs_dir>/cancel-leaves-cancelling`` leaves a cancelled run Cancelling (its process still stopping).
A run is a JSON file ``<runs_dir>/<run_id>.json`` that the test moves through states with
``set_run(server, job_id, status, message=None, state_name="")``; ``finish_run(server, job_id, engine)``
really harvests the job with the core pipeline into the server's storage (what a worker
does) and marks the run done. A running run reports its job's progress as a real one does
(`flows.progress`: the shard records its job's folder holds), or what ``FileRuns.report`` set.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx

from fleet.processes import free_port
from harvest.storage import StorageOptions
from testbed import http_calls

__all__ = [
    "ApiServer", "FileRuns", "set_run", "finish_run", "free_port", "serve_in_thread", "harvest_up",
    "PRODUCTION_APP", "FILE_RUNS_APP", "FLOW_ENV_APP", "harvest_api_env", "pg_schema_url", "drop_pg_schema",
    "pg_api_server",
]

REPO = Path(__file__).resolve().parent.parent

# What `uvicorn --factory` runs (`testbed.api_factories`).
PRODUCTION_APP = "api.app:create_app"
FILE_RUNS_APP = "testbed.api_factories:file_runs_app"
FLOW_ENV_APP = "testbed.api_factories:flow_env_app"

# The service's lanes with a smaller service-wide capacity on `large` (so a test can fill it)
# and one lane more, `xl`, declared in config only (as an operator adds one), whose shards
# may hold at most 1 MiB (so a test can go over it with the tiny model).
TEST_LANES = """
[lanes.xl]
pool_limit = 1
key_limit = 2
capacity = 10
gpus_per_run = 8
max_shard_bytes = 1048576
description = "an added lane (tests)"
"""

# The same weights as a second model of the small lane (only declared lanes): it evicts
# llama-tiny from a one-model warm engine (tests/test_warm_engines.py).
SECOND_SMALL_MODEL = """
[models.llama-tiny-b]
weights = "models/llama-tiny"
builtin = true
lane = "small"
max_model_len = 2048
max_activation_prompt_tokens = 512
"""

TEST_MODELS = """
[models.llama-tiny-large]
weights = "models/llama-tiny"
builtin = true
lane = "large"
max_model_len = 2048
max_activation_prompt_tokens = 512

[models.llama-tiny-xl]
weights = "models/llama-tiny"
builtin = true
lane = "xl"
max_model_len = 2048
max_activation_prompt_tokens = 512

[models.llama-tiny-noharvest]
weights = "models/llama-tiny"
builtin = true
lane = "small"
harvest = false
max_model_len = 2048
max_activation_prompt_tokens = 512
"""


class FileRuns:
    """Runs as JSON files (directory `HARVEST_TEST_RUNS_DIR`); see the module docstring."""

    def __init__(self, runs_dir: str | Path | None = None, storage_options: StorageOptions | None = None):
        """`storage_options`: how the jobs' store is reached (the replica's own, as its app's)."""
        self.dir = Path(runs_dir or os.environ["HARVEST_TEST_RUNS_DIR"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.storage_options = storage_options or StorageOptions()

    def _path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def _write(self, run_id: str, data: dict) -> None:
        staging = self._path(run_id).with_suffix(".tmp")
        staging.write_text(json.dumps(data))
        staging.replace(self._path(run_id))

    def get(self, run_id: str) -> dict | None:
        path = self._path(run_id)
        return json.loads(path.read_text()) if path.exists() else None

    def start(self, job_id: str, request_url: str, model: str, lane: str, key_id: str) -> str:
        if (self.dir / "start-fails").exists():  # tests: runs cannot be started
            raise ConnectionError("the run backend refused the connection")
        run_id = f"run-{job_id}"  # idempotent per job, like run_deployment's idempotency key
        if self.get(run_id) is None:
            self._write(run_id, {"job_id": job_id, "request_url": request_url, "status": "pending", "starts": 1})
        else:
            data = self.get(run_id)
            data["starts"] = data.get("starts", 1) + 1
            self._write(run_id, data)
        if (self.dir / "start-fails-after-create").exists():  # tests: the run exists, its id never came back
            raise TimeoutError("the run backend did not answer in time")
        return run_id

    async def follow(self, changed) -> None:
        """Pushes nothing: the watcher sees these runs change at its ticks."""

    def cancel_job(self, job_id: str) -> None:
        if (self.dir / "cancel-fails").exists():
            raise ConnectionError("the run backend refused the connection")
        self.cancel(f"run-{job_id}")

    def cancel(self, run_id: str) -> None:
        if (self.dir / "cancel-fails").exists():
            raise ConnectionError("the run backend refused the connection")
        data = self.get(run_id)
        if data is not None and data["status"] in ("pending", "running"):
            data["status"] = "cancelled"
            if (self.dir / "cancel-leaves-cancelling").exists():  # tests: its worker has yet to stop it
                data["state_name"] = "Cancelling"
            data["cancels"] = data.get("cancels", 0) + 1
            self._write(run_id, data)

    def read(self, run_ids: list[str]):
        from api.runs import RunStatus

        with open(self.dir / "reads.log", "a") as log:  # tests count backend reads
            log.write(f"{len(run_ids)}\n")
        if (self.dir / "unreachable").exists():  # tests: the backend (Prefect) is down
            raise ConnectionError("run backend unreachable")
        states = {}
        for run_id in run_ids:
            data = self.get(run_id)
            if data is not None:
                started = data.get("started_at")
                crashed = data["status"] == "crashed"  # its host died (Prefect's Crashed)
                states[run_id] = RunStatus(
                    status="failed" if crashed else data["status"],
                    message=data.get("message"),
                    started_at=datetime.fromisoformat(started) if started else None,
                    crashed=crashed,
                    state_name=data.get("state_name", ""),  # e.g. "Cancelling": cancelled, its process still stopping
                    shards_done=self._reported(data),
                    flow_run_id=run_id,
                )
        return states

    def _reported(self, data: dict) -> int | None:
        """The job's shards as its run reports them (`flows.progress`): what the test set
        (`report`), else, for a running run, the records in its job's folder, which is what a
        real run counts and reports."""
        if data.get("shards_done") is not None:
            return int(data["shards_done"])
        if data["status"] != "running" or not data.get("request_url"):
            return None
        from harvest.jobfiles import JobFiles

        return JobFiles.from_request_url(data["request_url"], self.storage_options).shards_done()

    def report(self, run_id: str, shards_done: int) -> None:
        """The run reports `shards_done` of its job's shards written (its label, in Prefect)."""
        data = self.get(run_id)
        data["shards_done"] = shards_done
        self._write(run_id, data)

    def reschedule(self, run_id: str) -> None:
        data = self.get(run_id)
        data["status"] = "running"  # Prefect: Scheduled again with run_count > 0 reads running
        data["reschedules"] = data.get("reschedules", 0) + 1
        self._write(run_id, data)

    def set(self, run_id: str, status: str, message: str | None = None, state_name: str = "") -> None:
        data = self.get(run_id) or {}
        data["status"] = status
        data["message"] = message
        data["state_name"] = state_name
        if status == "running" and not data.get("started_at"):
            data["started_at"] = datetime.now(timezone.utc).isoformat()
        self._write(run_id, data)


def longpoll_waiters(root: str, home: Path) -> int:
    """The `?wait=` reads the replica at `root` holds open now, as an operator reads them: its
    `/metrics` (`harvest_longpoll_waiters`), with the metrics token of its `home`."""
    from prometheus_client.parser import text_string_to_metric_families

    from harvest.metrics_export import metrics_token
    from harvest.settings import Settings

    token = metrics_token(Settings(home=home))
    response = http_calls.get(f"{root}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    family = next(f for f in text_string_to_metric_families(response.text) if f.name == "harvest_longpoll_waiters")
    return int(family.samples[0].value)


def wait_for_longpoll_waiters(root: str, home: Path, count: int, timeout: float = 30) -> None:
    """Until the replica at `root` holds `count` long-polls open: the waiters a test started
    are waiting, not still on their way."""
    deadline = time.monotonic() + timeout
    while (waiting := longpoll_waiters(root, home)) != count:
        assert time.monotonic() < deadline, f"{waiting} long-polls held open, not {count}"
        time.sleep(0.05)


class PortInUse(RuntimeError):
    """uvicorn could not bind its port."""


class ApiServer:
    """One uvicorn process running the app `app` makes (see the module docstring)."""

    def __init__(self, home: Path, name: str, env: dict[str, str | None] | None = None, *, app: str = FILE_RUNS_APP):
        self.home = home
        self.app = app
        self.dir = home / "api" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = {
            "HARVEST_DATABASE_URL": f"sqlite:///{self.dir / 'harvest.db'}",
            "HARVEST_STORAGE_URL": f"file://{self.dir / 'storage'}",
            "HARVEST_TEST_RUNS_DIR": str(self.dir / "runs"),
            "HARVEST_PORT": str(self.port),
            **(env or {}),
        }
        self.process: subprocess.Popen | None = None
        self.log = self.dir / "uvicorn.log"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    @property
    def runs(self) -> FileRuns:
        return FileRuns(self.env["HARVEST_TEST_RUNS_DIR"])

    def start(self, timeout: float = 180, attempts: int = 5) -> "ApiServer":  # a loaded CI box is slow to import torch
        """Start uvicorn on `self.port` and wait for /health.

        A restart on the same port (tests that kill the API) can find the port briefly held
        (a connection of the killed replica's, closing): a bind refused that way is tried
        again, a few times, a second apart.
        """
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except PortInUse:
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> "ApiServer":
        from fleet.roles import api_command

        # A variable given as None is left out: the replica then runs with the app's own default.
        env = {name: value for name, value in {**os.environ, **self.env}.items() if value is not None}
        env["PYTHONPATH"] = str(REPO)
        logged = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                api_command(self.app, "127.0.0.1", self.port, trusted_proxies=env.get("HARVEST_TRUSTED_PROXIES", ""),
                            log_level="warning"),  # the replica's, as shipped
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = self.log.read_bytes()[logged:].decode(errors="replace")
                if "address already in use" in output:
                    raise PortInUse(output)
                raise RuntimeError(f"the API exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if http_calls.get(f"{self.root}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the API did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown code runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def engine(self):
        from api.db import make_engine, upgrade

        engine = make_engine(self.env["HARVEST_DATABASE_URL"])
        upgrade(engine)
        return engine

    def wait_for_longpoll_waiters(self, count: int, timeout: float = 30) -> None:
        """Until this replica holds `count` long-polls open (`wait_for_longpoll_waiters`)."""
        from harvest.settings import get_settings

        wait_for_longpoll_waiters(self.root, Path(self.env.get("HARVEST_HOME") or get_settings().home), count, timeout)

    def make_key(self, **limits) -> str:
        from api.auth import create_key

        engine = self.engine()
        try:
            return create_key(limits.pop("name", "test"), engine=engine, **limits)[0]
        finally:
            engine.dispose()

    def storage(self):
        from harvest.storage import Storage

        return Storage(self.env.get("HARVEST_STORAGE_URL") or f"file://{self.home / 'storage'}")


def set_run(server: ApiServer, job_id: str, status: str, message: str | None = None, state_name: str = "") -> None:
    """Move the job's run to `status` (`state_name`: Prefect's name for it, e.g. "Cancelling")."""
    server.runs.set(f"run-{job_id}", status, message, state_name)


def finish_run(server: ApiServer, job_id: str, engine, storage=None) -> None:
    """Harvest the job for real (core pipeline, HF engine) into the server's storage; mark it done.

    `storage`: the server's storage root when the test process cannot open it from the URL
    alone (an S3 endpoint of its own)."""
    from harvest.jobfiles import JobFiles
    from harvest.pipeline import run_job
    from harvest.registry import load_registry
    from harvest.request import resolve_job
    from harvest.settings import Settings

    files = JobFiles.for_job(job_id, storage or server.storage())
    request = files.read_request()
    settings = Settings(models_file=server.env.get("HARVEST_MODELS_FILE", Settings().models_file),
                        lanes_file=server.env.get("HARVEST_LANES_FILE", Settings().lanes_file))
    job = resolve_job(request, load_registry(settings))
    set_run(server, job_id, "running")
    run_job(job, files.storage, engine, job_id)
    set_run(server, job_id, "done")


@contextmanager
def serve_in_thread(app, settings=None):
    """Serve `app` under uvicorn in a daemon thread on a free loopback port, without its
    lifespan, with a replica's HTTP server options (`api.http_server.http_options`) of
    `settings` (default: the session's `ApiSettings`); yields the root URL and stops the
    server on exit."""
    import uvicorn

    from api.http_server import http_options
    from api.settings import ApiSettings

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **http_options(settings or ApiSettings())))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextmanager
def harvest_up(home: Path, models: Path, env: dict[str, str] | None = None):
    import shutil
    import signal

    shutil.copytree(models, home / "models")  # the built checkpoints, not rebuilt
    # No PREFECT_API_AUTH_STRING either: the stack makes its own control-plane password.
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "PREFECT_API_AUTH")) and k != "PREFECT_HOME"}
    full.update({"HARVEST_HOME": str(home), "PYTHONPATH": str(REPO), **(env or {})})
    port, prefect_port = free_port(), free_port()
    log = open(home / "up.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "up", "--port", str(port), "--prefect-port", str(prefect_port)],
        cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
    )
    info: dict[str, str] = {}
    deadline = time.monotonic() + 240
    try:
        while "PREFECT_UI" not in info:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"harvest up exited {proc.poll()}:\n{(home / 'up.log').read_text()[-3000:]}")
            if "=" in line:
                name, _, value = line.strip().partition("=")
                info[name] = value
            assert time.monotonic() < deadline, "harvest up was not ready in 240 s"
        info["home"] = str(home)
        info["prefect_api_url"] = json.loads((home / "stack.json").read_text())["prefect_api_url"]
        info["prefect_auth"] = (home / "prefect-auth").read_text().strip()
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _server(home: Path, name: str, env: dict[str, str | None] | None = None):
    server = ApiServer(home, name, env).start()
    try:
        yield server
    finally:
        server.stop()


def harvest_api_env(home: Path) -> dict[str, str | None]:
    models = home / "api" / "test-models.toml"
    models.parent.mkdir(parents=True, exist_ok=True)
    models.write_text((REPO / "infra" / "models.toml").read_text() + TEST_MODELS)
    lanes = home / "api" / "test-lanes.toml"
    lanes.write_text((REPO / "infra" / "lanes.toml").read_text().replace("capacity = 8", "capacity = 2") + TEST_LANES)
    return {
        "HARVEST_MODELS_FILE": str(models),
        "HARVEST_LANES_FILE": str(lanes),
        "HARVEST_WATCH_INTERVAL_S": "0.2",
        "HARVEST_ORPHAN_AFTER_S": "1",
        "HARVEST_LONGPOLL_MAX_WAITERS": "2",
        "TOKENIZERS_PARALLELISM": None,  # the test session's own setting (conftest) left out: as shipped
    }


def pg_schema_url(schema: str) -> str:
    """A fresh schema in the `test` database of the PostgreSQL server at 127.0.0.1:5432; a
    missing server fails the test (it never skips: the production store must be tested)."""
    import psycopg

    errors = []
    for user in ("postgres", "root"):
        try:
            with psycopg.connect(f"host=127.0.0.1 port=5432 dbname=test user={user}", connect_timeout=3, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{schema}"')
            return f"postgresql+psycopg://{user}@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
        except psycopg.OperationalError as exc:
            errors.append(f"{user}: {exc}")
    raise RuntimeError("these tests need the PostgreSQL server at 127.0.0.1:5432: " + "; ".join(errors))


def drop_pg_schema(url: str, schema: str) -> None:
    import psycopg

    user = url.split("//", 1)[1].split("@", 1)[0]
    with psycopg.connect(f"host=127.0.0.1 port=5432 dbname=test user={user}", autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def pg_api_server(home: Path, name: str, env: dict[str, str] | None = None):
    """`harvest_api`'s app (with `env` besides) on PostgreSQL, in a schema of its own (dropped
    after), for a module's fixture to `yield from`."""
    schema = f"harvest_{name}_{uuid.uuid4().hex[:10]}"
    url = pg_schema_url(schema)
    server = ApiServer(home, name, {**harvest_api_env(home), **(env or {}), "HARVEST_DATABASE_URL": url})
    try:
        yield server.start()
    finally:
        server.stop()
        drop_pg_schema(url, schema)
