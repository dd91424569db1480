"""Real Prefect for tests: one server per test session, the project's pools and deployments,
and one process worker per lane. Loaded for every test by `tests/conftest.py`.

Fixtures (all session-scoped; the server and workers start only when a test asks for them):

``prefect_server`` → ``PrefectServer(api_url, ui_url, process, auth)``
    `prefect server start` on a free loopback port, SQLite under the session's HARVEST_HOME,
    migrated already (`with_migrated_database`; ~8 s, once), with basic auth on as every role
    runs it (`flows.prefect_auth`; ``auth`` is its ``user:password``). Sets ``PREFECT_API_URL``
    and ``PREFECT_API_AUTH_STRING`` in ``os.environ`` (so subprocesses such as a uvicorn API
    inherit them) and in this process's Prefect settings. Stopped at session end. A test
    restarting the server passes ``server_env(auth)`` to ``start_server``.

``prefect_deployments`` → list of deployment names
    infra/prefect.yaml applied: pools ``small`` (limit 3) and ``large`` (limit 1),
    deployments ``harvest/harvest-small``, ``harvest/harvest-large``,
    ``corpus-refresh/corpus-refresh``, ``retention-sweep/retention-sweep``.

``lane_workers`` → ``LaneWorkers``
    one ``prefect worker`` per lane (``.small``, ``.large``), with ``HARVEST_ENGINE=hf`` so
    flow runs use the HF reference engine, and a slot table, so they use the host's warm
    engine server (`harvest.warm`), and the worker host's ``/metrics`` as its role serves it
    (``.exporters[worker]``, a `fleet.metrics.Exporter`; the token is the session home's
    ``metrics-token``). ``.start(lane)`` adds a worker, ``.kill(worker)``
    SIGKILLs a worker *and its flow-run processes* (a lost machine). All stopped at session end,
    leaving no process behind.

``harvest_stack`` → ``HarvestStack``: the three above together, plus helpers
    ``submit(request, *, workers=1, env=None, key_id="test", job_id=None) -> SubmittedJob``: writes the
        request into the job's folder (``harvest.jobfiles.JobFiles``) and starts the run with
        ``flows.submit.start_harvest_run`` exactly as the API does.
    ``wait(flow_run_id, timeout=60, statuses=("done","failed","cancelled")) -> RunStatus``
    ``status(flow_run_id) -> RunStatus``

An API test needing a live flow backend asks for ``harvest_stack`` (or just
``prefect_deployments`` + ``lane_workers``) and then starts its uvicorn with the inherited
environment. Tests that need "mid-job" moments slow real work with an engine of their own,
``env=engine_env(OneSecondShards)`` (`tests.slow_engine`): the flow run asks its host's engine
server for that engine instead of the plain one.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harvest.settings import get_settings
from harvest.storage import open_storage

__all__ = ["PrefectServer", "LaneWorkers", "HarvestStack", "SubmittedJob", "deploy_pool", "recorded_task_runs", "server_env",
           "with_migrated_database"]

REPO = Path(__file__).resolve().parent.parent

# Flow runs on the HF reference engine, as warm engines (`harvest.warm`) of one CPU group per
# session: up to three models kept (the slow test engines of `tests.slow_engine` beside the
# plain one), idle servers gone two minutes after the last job. The repository is on the path
# so those engines import.
WORKER_ENV = {
    "HARVEST_ENGINE": "hf",
    "HARVEST_ENGINE_MODELS_PER_GROUP": "3",
    "HARVEST_ENGINE_IDLE_S": "120",
    "PYTHONPATH": str(REPO),
    "PREFECT_LOGGING_LEVEL": "WARNING",
}


@dataclass
class PrefectServer:
    api_url: str
    ui_url: str
    process: object
    auth: str
    """The server's basic-auth ``user:password``."""


# Prefect's own schema set-up (what a server runs on start: its migrations), on the database
# that PREFECT_API_DATABASE_CONNECTION_URL names.
_MIGRATE = """
import asyncio
from prefect.server.database import provide_database_interface
asyncio.run(provide_database_interface().create_db())
"""


def with_migrated_database(prefect_home: Path) -> Path:
    """`prefect_home`, holding an empty Prefect database at Prefect's current schema where a
    server finds it by default (SQLite, `prefect.db`): a copy of one that the test run migrated
    once, the first of its processes to need it building it under a lock (conftest names the
    folder). A server on a fresh database runs all of Prefect's migrations as it starts (18
    CPU-s to ready on this 2-core box, 7.5 on a migrated one), and the suite starts several;
    the server still checks the schema as it starts. `make run` in tests/test_stack.py meets a
    fresh database, as a new user's does."""
    folder = Path(os.environ["HARVEST_TEST_PREFECT_DATABASE"])
    template = folder / "prefect.db"
    with open(folder / "prefect.db.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and find it
        if not template.exists():
            staging = folder / "staging.db"
            staging.unlink(missing_ok=True)
            env = {**os.environ, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{staging}"}
            done = subprocess.run([sys.executable, "-c", _MIGRATE], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            os.replace(staging, template)
    prefect_home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, prefect_home / "prefect.db")
    return prefect_home


def server_env(auth: str) -> dict[str, str]:
    """The environment of a Prefect server that requires `auth`."""
    from flows.prefect_auth import SERVER_ENV

    return {SERVER_ENV: auth}


@pytest.fixture(scope="session")
def prefect_server(harvest_home: Path):
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.prefect_auth import CLIENT_ENV
    from flows.prefect_clients import share_tls_context
    from fleet.processes import free_port, start_server

    # This process's Prefect clients (polls of its runs, several a second) share one TLS
    # context, as a replica's and a run's do: each would load the CA bundle (~20 ms of CPU).
    share_tls_context()
    port = free_port()
    auth = f"harvest-test:{secrets.token_urlsafe(24)}"
    server, api_url = start_server(with_migrated_database(harvest_home / "prefect-server"), port, server_env(auth), timeout=90)
    previous = {name: os.environ.get(name) for name in ("PREFECT_API_URL", CLIENT_ENV)}
    os.environ.update({"PREFECT_API_URL": api_url, CLIENT_ENV: auth})
    current = PrefectServer(api_url=api_url, ui_url=f"http://127.0.0.1:{port}", process=server, auth=auth)
    try:
        with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
            yield current
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # Whichever process serves now: a test may have restarted the server on the same port.
        current.process.stop()
        if current.process is not server:
            server.stop()


@pytest.fixture(scope="session")
def prefect_deployments(prefect_server) -> list[str]:
    from fleet.processes import RUN_COMMAND
    from flows.deploy import apply_sync

    from harvest.lanes import load_lanes
    from harvest.settings import get_settings

    return apply_sync(load_lanes(get_settings()), run_command=RUN_COMMAND)


def deploy_pool(pool: str, entrypoint: str = "flows.harvest.harvest", name: str | None = None) -> str:
    """A process work pool of a test's own (no limit: its hosts' slots are the limit) and a
    deployment on it (default `harvest-<pool>`, which `flows.submit.start_harvest_run` uses for
    lane `pool`), made the way flows/deploy.py makes them: module entrypoint, no pull steps."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.flows import load_flow_from_entrypoint

    from fleet.processes import RUN_COMMAND

    name = name or f"harvest-{pool}"
    flow = load_flow_from_entrypoint(entrypoint)
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
        client.create_deployment(
            flow_id=client.create_flow_from_name(flow.name), name=name, work_pool_name=pool, entrypoint=entrypoint,
            path=None, pull_steps=[], parameter_openapi_schema=flow.parameters.model_dump(), enforce_parameter_schema=True,
            job_variables={"command": RUN_COMMAND},
        )
    return f"{flow.name}/{name}"


def recorded_task_runs(flow_run_id, until, timeout: float = 30) -> list:
    """A flow run's task runs, read until `until(task_runs)` holds or `timeout` seconds passed.

    Prefect records task runs from their events, which under load may land after the flow run's
    end; and a task run is made under Prefect's default name (`<task>-<random>`, such as
    `write-shard-5cf`) and renamed as it starts, a rename that is recorded later still."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(str(flow_run_id))])))
            if until(tasks) or time.monotonic() > deadline:
                return tasks
            time.sleep(0.2)


@dataclass
class LaneWorkers:
    api_url: str
    log_dir: Path
    workers: list = field(default_factory=list)
    small: object = None
    large: object = None
    exporters: dict = field(default_factory=dict)

    def start(self, lane: str, env: dict[str, str] | None = None):
        from fleet.processes import start_worker
        from harvest.lanes import load_lanes
        from harvest.warm.protocol import unix_socket_path

        name = f"{lane}-{uuid.uuid4().hex[:6]}"
        env = {**WORKER_ENV, **(env or {})}
        declared = load_lanes(get_settings()).get(lane)
        starter = None
        if declared is not None:
            # A worker host of the lane: as many CPU slots as its pool runs at once, so its
            # runs share the host's warm engine, and its runs forked from a run starter. A
            # worker of a test's own pool stays a bare one, whose runs start and load their
            # engine themselves.
            env["HARVEST_SLOTS"] = json.dumps([[] for _ in range(declared.pool_limit or 1)])
            starter = unix_socket_path(self.log_dir, f"runs-{name}")
        metrics_dir = self.log_dir / "metrics" / name
        worker = start_worker(lane, self.api_url, self.log_dir / f"worker-{name}.log", env, name=name, run_starter=starter,
                              metrics_dir=metrics_dir)
        self.workers.append(worker)
        self.exporters[worker] = _serve_metrics(worker, metrics_dir)
        return worker

    def kill(self, worker) -> None:
        worker.kill()

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.stop()
        for exporter in self.exporters.values():
            exporter.close()


def _serve_metrics(worker, metrics_dir: Path):
    """The worker host's /metrics, as `harvest worker` serves it (`fleet.roles.start_worker_host`)."""
    from fleet.metrics import serve_worker_metrics
    from harvest.metrics_export import metrics_token
    from harvest.settings import get_settings

    settings = get_settings()
    return serve_worker_metrics(lambda: worker.pid, settings.home, metrics_dir, metrics_token(settings))


@pytest.fixture(scope="session")
def lane_workers(prefect_deployments, prefect_server, harvest_home: Path):
    workers = LaneWorkers(api_url=prefect_server.api_url, log_dir=harvest_home / "worker-logs")
    workers.small = workers.start("small")
    workers.large = workers.start("large")
    try:
        yield workers
    finally:
        workers.stop_all()


@dataclass
class SubmittedJob:
    job_id: str
    flow_run_id: str
    request_url: str
    storage: object
    """`harvest.storage.Storage` of the job's folder."""
    files: object = None
    """`harvest.jobfiles.JobFiles` of the job's folder (names of its files, progress)."""


@dataclass
class HarvestStack:
    server: PrefectServer
    workers: LaneWorkers

    def submit(
        self, request, *, workers: int = 1, env: dict[str, str] | None = None, key_id: str = "test", job_id: str | None = None
    ) -> SubmittedJob:
        from flows.submit import RunStartTimeout, cancel_job_runs, start_harvest_run
        from harvest.jobfiles import JobFiles
        from harvest.registry import load_registry
        from harvest.request import HarvestRequest

        request = request if isinstance(request, HarvestRequest) else HarvestRequest.model_validate(request)
        lane = load_registry(get_settings()).get(request.model).lane
        for attempt in range(3):
            job = job_id or str(uuid.uuid4())
            files = JobFiles.for_job(job, open_storage(get_settings()))
            url = files.write_request(request)
            try:
                run_id = start_harvest_run(job, url, request.model, lane, key_id, workers=workers, env=env)
                return SubmittedJob(job_id=job, flow_run_id=run_id, request_url=url, storage=files.storage, files=files)
            except RunStartTimeout:
                # As the API answers it (503, Retry-After) and a client then submits again: the
                # start that gave up may still have made its run, so the job's runs are
                # cancelled by its tag first. A test that named its job cannot be renamed.
                cancel_job_runs(job)
                if job_id is not None or attempt == 2:
                    raise
                time.sleep(2)
        raise AssertionError("unreachable")

    @staticmethod
    def status(flow_run_id: str):
        from flows.submit import read_harvest_run

        return read_harvest_run(flow_run_id)

    def wait(self, flow_run_id: str, timeout: float = 60, statuses=("done", "failed", "cancelled"), poll: float = 0.2):
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(flow_run_id)
            if status.status in statuses:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {status.state_name} after {timeout} s")
            time.sleep(poll)


@pytest.fixture(scope="session")
def harvest_stack(prefect_server, lane_workers) -> HarvestStack:
    return HarvestStack(server=prefect_server, workers=lane_workers)
