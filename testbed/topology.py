"""The production topology on one machine: the fleet's roles as separate processes and hosts.

    control plane   `harvest server` on PostgreSQL (its own database), bound to the bridge,
                    its API behind the password it generates (`flows.prefect_auth`), which
                    the fleet hands every other role as PREFECT_API_AUTH_STRING, as an operator
                    would
    API replicas    `harvest api` × N beside PostgreSQL (the job store, its own database)
    worker hosts    `harvest worker --lane small` × M, each in its own network namespace
    S3              moto's server in its own process, bound to the bridge

Each role has its own HARVEST_HOME and working directory and shares only what the fleet
shares: PostgreSQL, S3 and Prefect. A worker host lives in a network namespace
(`testbed.netns`), so its 127.0.0.1 is its own: it can reach Prefect and S3 only at the
bridge's address, as a real host would over the network, and nothing of another host's. The
replicas stay in the root namespace because PostgreSQL listens on 127.0.0.1 only (workers
never need the job store).

Used by tests/test_fleet.py and bench/bench_fleet.py:

    with Fleet(tmp, replicas=2, hosts=2, host_env={...}) as fleet:
        fleet.replicas[0].base_url, fleet.key, fleet.hosts[1].kill(), fleet.s3 ...
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg

from fleet.processes import Managed, free_port
from testbed import http_calls
from testbed.netns import Host, Network

__all__ = ["Fleet", "Role", "MotoS3", "PG_ADMIN", "CREDENTIALS"]

PG_ADMIN = "host=127.0.0.1 port=5432 dbname=postgres user=postgres"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
HARVEST = [sys.executable, "-m", "fleet.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    """This machine's environment without the test session's Prefect and harvest settings: a
    role gets only what the fleet gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HARVEST_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


class Role:
    """One role's process (`harvest server|api|worker`), started like an operator would."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], home: Path):
        self.name = name
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.log_path = home / f"{name}.out"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, env=env, cwd=home, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def wait_ready(self, prefix: str, timeout: float = 180) -> str:
        """The value of the ready line starting with `prefix` (e.g. "ACS_API_BASE=")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} printed no {prefix!r} within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, as an operator's supervisor would; the role stops its own children."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the role and everything it started, at once (no chance to clean up)."""
        Managed.kill_tree(self.tree())
        self.proc.wait(timeout=10)


@dataclass
class Replica:
    role: Role
    base_url: str
    port: int

    key: str | None = None
    """The fleet's key, once it has one."""

    def health(self) -> dict:
        """`/health` as the operator asks it, with the replica's metrics token (generated into
        its HARVEST_HOME): which replica it is and whether it holds the watcher lease. A
        researcher's key learns neither (tests/test_keyless_limits.py)."""
        from harvest.metrics_export import TOKEN_FILE

        token = (self.role.home / TOKEN_FILE).read_text().strip()
        return http_calls.get(self.base_url.removesuffix("/v1") + "/health", headers={"Authorization": f"Bearer {token}"},
                              timeout=5).json()


@dataclass
class WorkerHost:
    role: Role
    host: Host
    home: Path

    def flow_run_ids(self) -> set[str]:
        """Flow runs whose processes run on this host now (Prefect's env names each one)."""
        found = set()
        for pid in self.host.pids():
            try:
                run_id = psutil.Process(pid).environ().get("PREFECT__FLOW_RUN_ID")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if run_id:
                found.add(run_id)
        return found

    def kill(self) -> None:
        """Every process of the host SIGKILLed at once: the machine is lost."""
        self.host.kill_all()


class MotoS3:
    """moto's S3 server in its own process (never in the test process: see test_api_s3)."""

    def __init__(self, host: str, bucket: str):
        import boto3

        self.port = free_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.bucket = bucket
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.create_bucket(Bucket=bucket)
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> "MotoS3":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _create_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def _drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Fleet:
    """The topology of the module docstring; a context manager that tears everything down."""

    root: Path
    replicas_n: int = 2
    hosts_n: int = 2
    lane: str = "small"
    host_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every worker host (and so of its flow runs)."""
    replica_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        tag = uuid.uuid4().hex[:8]
        self.prefect_db = f"harvest_fleet_prefect_{tag}"
        self.jobs_db = f"harvest_fleet_jobs_{tag}"
        self.jobs_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.jobs_db}"
        self.network = Network()
        self.roles: list[Role] = []
        self.replicas: list[Replica] = []
        self.hosts: list[WorkerHost] = []
        self.s3: MotoS3 | None = None
        self._databases: list[str] = []
        self._host_numbers = itertools.count()

    # --- bring-up ---------------------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        try:
            self._up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _storage_env(self) -> dict[str, str]:
        return {
            "HARVEST_STORAGE_URL": f"s3://{self.s3.bucket}/fleet",
            "HARVEST_S3_ENDPOINT_URL": self.s3.endpoint,
            **CREDENTIALS,
        }

    def _up(self) -> None:
        started = time.monotonic()
        self.network.__enter__()
        gateway = self.network.gateway
        for name in (self.prefect_db, self.jobs_db):
            _create_database(name)
            self._databases.append(name)
        self.s3 = MotoS3(gateway, f"fleet-{uuid.uuid4().hex[:8]}")

        prefect_port = free_port()
        server = self._role(
            "control-plane", [*HARVEST, "server", "--host", gateway, "--port", str(prefect_port)],
            PREFECT_API_DATABASE_CONNECTION_URL=f"postgresql+asyncpg://postgres@127.0.0.1:5432/{self.prefect_db}",
        )
        self.prefect_api_url = server.wait_ready("PREFECT_API_URL=")
        self.prefect_auth = (server.home / "prefect-auth").read_text().strip()  # generated by the role
        self.timings = {"control_plane_s": time.monotonic() - started}

        # Replicas and hosts start together; each prints its ready line when it answers.
        with ThreadPoolExecutor(8) as pool:
            replicas = [pool.submit(self.add_replica) for _ in range(self.replicas_n)]
            hosts = [pool.submit(self.add_host) for _ in range(self.hosts_n)]
            for future in replicas + hosts:
                future.result()
        self.timings["fleet_s"] = time.monotonic() - started
        self.key = self.create_key("fleet")
        for replica in self.replicas:
            replica.key = self.key

    def _role(self, name: str, argv: list[str], host: Host | None = None, **env: str) -> Role:
        home = self.root / name
        role = Role(name, host.argv(argv) if host else argv, clean_env(HARVEST_HOME=str(home), **env), home)
        self.roles.append(role)
        return role

    def add_replica(self) -> Replica:
        port = free_port()
        role = self._role(
            f"api-{port}", [*HARVEST, "api", "--port", str(port)],
            PREFECT_API_URL=self.prefect_api_url, PREFECT_API_AUTH_STRING=self.prefect_auth, HARVEST_DATABASE_URL=self.jobs_url,
            **self._storage_env(), **self.replica_env,
        )
        replica = Replica(role, role.wait_ready("ACS_API_BASE="), port, getattr(self, "key", None))
        self.replicas.append(replica)
        return replica

    def add_host(self) -> WorkerHost:
        n = next(self._host_numbers)  # hosts start in parallel threads: a count, not a length
        host = self.network.add_host(f"w{n}-{uuid.uuid4().hex[:4]}")
        name = f"host-{host.name}"
        role = self._role(
            name, [*HARVEST, "worker", "--lane", self.lane, "--name", name], host,
            **{
                "PREFECT_API_URL": self.prefect_api_url, "PREFECT_API_AUTH_STRING": self.prefect_auth,
                "HARVEST_ENGINE": "hf",
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent),  # for tests.slow_engine
                **self._storage_env(), **self.host_env,
            },
        )
        role.wait_ready(f"WORKER_READY lane={self.lane}")
        worker = WorkerHost(role, host, role.home)
        self.hosts.append(worker)
        return worker

    def create_key(self, name: str, small: int = 10) -> str:
        """A new API key (`harvest keys create`, as an operator would), `small` jobs at once.
        Its reads have a key's own rate (50 a second, 1,000 at once): the fleet tests poll
        several jobs through two replicas every 0.1 s, more than the default 10 a second allows
        one client once reads are a few milliseconds each."""
        out = subprocess.run(
            [*HARVEST, "keys", "create", "--name", name, "--limit", f"small={small}",
             "--read-per-s", "50", "--read-burst", "1000"],
            env=clean_env(HARVEST_DATABASE_URL=self.jobs_url, HARVEST_HOME=str(self.root / "admin")),
            cwd=self.root, capture_output=True, text=True, check=True, timeout=120,
        )
        return out.stdout.strip().splitlines()[-1]

    # --- teardown ----------------------------------------------------------------------------
    def __exit__(self, *exc) -> None:
        # Replicas first (no new work), then hosts, the control plane last.
        order = sorted(self.roles, key=lambda r: 0 if r.name.startswith("api") else 2 if r.name == "control-plane" else 1)
        for role in order:
            try:
                role.stop()
            except Exception:
                role.kill()
        self.network.__exit__(None, None, None)
        if self.s3 is not None:
            self.s3.stop()
        for name in self._databases:
            try:
                _drop_database(name)
            except psycopg.Error:
                pass
