"""The scaled control plane (issue 45, item 1; `fleet.control_plane`), started as an operator
starts it: `harvest server --api-servers 2 --redis-url …` on a fresh PostgreSQL database and a
Redis database of its own (127.0.0.1:6379; both must answer: these tests fail, never skip,
without them), and one worker host, `harvest worker --lane small`, given both servers
(HARVEST_PREFECT_API_URLS) and named so that its order starts with the second.

- The role runs two Prefect API servers and Prefect's services in a third process, all on
  PostgreSQL and Redis (Redis holds Prefect's keys).
- A flow run created through the first server is read through the second; the worker, which
  talks to the second, runs it to done.
- The worker's server killed: the other still answers, and a job submitted through it runs to
  done on that worker (its forwarder moved to the first server); the role restarts the server.
- The forwarder alone (`fleet.prefect_endpoints.ApiForwarder`): a connection goes to the first
  server of its order that accepts, to the next while that one is down, and back once it is up;
  a role's order is stable and spreads roles over servers.
- Refusals: more than one server (or the services apart) on SQLite, or without Redis, is
  refused before anything starts, naming the setting.
"""

from __future__ import annotations

import http.server
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from fleet.prefect_endpoints import ApiForwarder, preference
from fleet.processes import free_port
from harvest.settings import get_settings
from harvest.storage import open_storage
from testbed.topology import HARVEST, Role, _create_database, _drop_database, clean_env

REDIS = "redis://127.0.0.1:6379"


def _fresh_redis_db() -> int:
    """An empty database number of the Redis at 127.0.0.1:6379 (its 16 default ones), or a
    failure saying Redis is not there."""
    try:
        redis.Redis.from_url(f"{REDIS}/0", socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        raise RuntimeError(f"these tests need the Redis server at 127.0.0.1:6379: {exc}") from None
    for db in random.sample(range(1, 16), 15):
        if redis.Redis.from_url(f"{REDIS}/{db}").dbsize() == 0:
            return db
    raise RuntimeError("no empty Redis database (1-15) at 127.0.0.1:6379")


class Scaled:
    """What the module's fixture started: the server role, its URLs and password, the worker."""

    def __init__(self, root: Path, storage_url: str, models: Path):
        self.db = f"harvest_scaled_{uuid.uuid4().hex[:10]}"
        self.redis_db = _fresh_redis_db()
        self.roles: list[Role] = []
        _create_database(self.db)
        try:
            port = free_port(consecutive=2)  # the role's servers take consecutive ports
            started = time.monotonic()
            self.server = self._role(root, "control-plane", [
                *HARVEST, "server", "--port", str(port), "--api-servers", "2", "--redis-url", f"{REDIS}/{self.redis_db}"],
                PREFECT_API_DATABASE_CONNECTION_URL=f"postgresql+asyncpg://postgres@127.0.0.1:5432/{self.db}")
            urls = [f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port + 1}/api"]
            # The worker host starts once both servers answer, while the services start and the
            # control plane's objects are applied (a worker that comes first creates its pool).
            self._wait_health(urls)
            self.servers_s = time.monotonic() - started
            self.auth = (self.server.home / "prefect-auth").read_text().strip()
            # Its order puts the second server first.
            self.worker_name = next(n for n in (f"scaled-{i}" for i in range(100)) if preference(urls, n)[0] == urls[1])
            home = root / "worker"
            home.mkdir()
            (home / "models").symlink_to(models, target_is_directory=True)  # the session's built checkpoints
            self.worker = self._role(root, "worker", [
                *HARVEST, "worker", "--lane", "small", "--name", self.worker_name, "--metrics-port", "0"],
                HARVEST_PREFECT_API_URLS=",".join(urls), PREFECT_API_AUTH_STRING=self.auth, HARVEST_ENGINE="hf",
                HARVEST_STORAGE_URL=storage_url)
            self.urls = self.server.wait_ready("HARVEST_PREFECT_API_URLS=", timeout=150).split(",")
            assert self.urls == urls, self.urls
            self.control_plane_s = time.monotonic() - started
            self.worker.wait_ready("WORKER_READY lane=small", timeout=150)
            self.ready_s = time.monotonic() - started
        except BaseException:
            self.close()
            raise

    def _wait_health(self, urls: list[str], timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        for url in urls:
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if self.server.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not answer:\n{self.server.tail()}")
                time.sleep(0.3)

    def _role(self, root: Path, name: str, argv: list[str], **env: str) -> Role:
        role = Role(name, argv, clean_env(HARVEST_HOME=str(root / name), **env), root / name)
        self.roles.append(role)
        return role

    def servers(self) -> dict[str, psutil.Process]:
        """The role's Prefect API server processes by URL, and its services' as "services"."""
        found = {}
        for proc in self.server.tree():
            try:
                cmd = proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "fleet.prefect_server" in cmd:
                found[next(u for u in self.urls if f":{cmd[cmd.index('--port') + 1]}/" in u)] = proc
            elif cmd[-3:] == ["server", "services", "start"]:
                found["services"] = proc
        return found

    def close(self) -> None:
        for role in reversed(self.roles):  # the worker first, the control plane last
            try:
                role.stop()
            except Exception:
                role.kill()
        try:
            _drop_database(self.db)
        finally:
            redis.Redis.from_url(f"{REDIS}/{self.redis_db}").flushdb()


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, tiny):
    from harvest.settings import get_settings

    settings = get_settings()
    control = Scaled(tmp_path_factory.mktemp("scaled"), settings.resolved_storage_url, settings.home / "models")
    try:
        yield control
    finally:
        control.close()


def _at(scaled: Scaled, url: str):
    """This process's Prefect calls go to `url`."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: scaled.auth})


def _submit(scaled: Scaled, url: str, prompt: str) -> str:
    """A 1-prompt job of the embedded model, its run created through the server at `url`."""
    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest

    job = str(uuid.uuid4())
    request_url = JobFiles.for_job(job, open_storage(get_settings())).write_request(HarvestRequest(model="llama-tiny", prompts=[prompt], layers=[1]))
    with _at(scaled, url):
        return start_harvest_run(job, request_url, "llama-tiny", "small", "test")


def _wait(scaled: Scaled, url: str, run_id: str, timeout: float = 60) -> str:
    from flows.submit import read_harvest_run

    deadline = time.monotonic() + timeout
    with _at(scaled, url):
        while True:
            status = read_harvest_run(run_id)
            if status.status in ("done", "failed", "cancelled") or time.monotonic() > deadline:
                return status.status
            time.sleep(0.3)


def _timeline(scaled: Scaled, url: str, run_id: str) -> str:
    """created → started → ended of a flow run, as Prefect recorded them (for the test's output)."""
    from prefect.client.orchestration import get_client

    with _at(scaled, url), get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    start, end = run.start_time, run.end_time
    return (f"created→started {(start - run.created).total_seconds():.1f} s, "
            f"started→ended {(end - start).total_seconds():.1f} s") if start and end else "not ended"


def test_two_api_servers_and_the_services_apart_on_postgresql_and_redis(scaled):
    processes = scaled.servers()
    assert set(processes) == {*scaled.urls, "services"}, processes
    assert len(scaled.urls) == 2 and scaled.urls[0] != scaled.urls[1]
    for url in scaled.urls:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        # Behind the control plane's password, as a single server is.
        assert httpx.post(f"{url}/flow_runs/filter", json={}, timeout=10).status_code == 401
    # Prefect's shared state is in Redis (its events' stream, the docket, leases), not in memory.
    assert redis.Redis.from_url(f"{REDIS}/{scaled.redis_db}").dbsize() > 0
    print(f"scaled control plane: both servers answer {scaled.servers_s:.1f} s, ready (services, objects applied) "
          f"{scaled.control_plane_s:.1f} s, its worker {scaled.ready_s:.1f} s")


def test_a_run_created_through_one_server_is_seen_through_the_other_and_runs_to_done(scaled):
    first, second = scaled.urls
    run_id = _submit(scaled, first, "The capital of France is")
    from flows.submit import read_harvest_run

    with _at(scaled, second):
        assert read_harvest_run(run_id).status in ("pending", "running", "done")
    # The worker (its order starts with the second server) takes it and runs it.
    assert _wait(scaled, second, run_id) == "done"
    assert _wait(scaled, first, run_id, timeout=5) == "done"
    print(f"first job: {_timeline(scaled, first, run_id)}")


def test_one_server_killed_the_other_serves_and_jobs_still_run(scaled):
    first, second = scaled.urls
    killed = scaled.servers()[second]
    killed_pid = killed.pid
    os.kill(killed_pid, signal.SIGKILL)  # the worker's own server
    started = time.monotonic()
    while True:  # down (the role restarts it, seconds later)
        try:
            httpx.get(f"{second}/health", timeout=2)
        except httpx.TransportError:
            break
        assert time.monotonic() - started < 5, f"{second} still answers after SIGKILL"
        time.sleep(0.05)
    assert httpx.get(f"{first}/health", timeout=10).status_code == 200
    run_id = _submit(scaled, first, "Two servers, one down")
    # The worker's forwarder moves to the first server: the run is claimed and ends done there.
    assert _wait(scaled, first, run_id) == "done"
    print(f"with {second} killed, a job ran to done in {time.monotonic() - started:.1f} s ({_timeline(scaled, first, run_id)})")
    # The role restarts its server (fleet.processes.Supervisor), on the same port.
    deadline = time.monotonic() + 60
    while True:
        restarted = scaled.servers().get(second)
        try:
            if restarted is not None and restarted.pid != killed_pid and httpx.get(f"{second}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{second} not back:\n{scaled.server.tail()}"
        time.sleep(0.5)
    assert _wait(scaled, second, run_id, timeout=5) == "done"


# --- the forwarder alone ---------------------------------------------------------------------


class _Named(http.server.ThreadingHTTPServer):
    """A loopback HTTP server answering every GET with its name."""

    def __init__(self, name: str, port: int = 0):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def test_the_forwarder_moves_to_the_next_server_and_back():
    a, b = _Named("a"), _Named("b")
    forwarder = ApiForwarder([a.url, b.url], down_s=0.5)
    try:
        assert forwarder.url.startswith("http://127.0.0.1:") and forwarder.url.endswith("/api")
        with httpx.Client(timeout=5) as client:
            assert client.get(f"{forwarder.url}/health").text == "a"
        port = a.server_address[1]
        a.close()
        with httpx.Client(timeout=5) as client:  # a new connection: a refuses, b answers
            assert client.get(f"{forwarder.url}/health").text == "b"
            assert client.get(f"{forwarder.url}/health").text == "b"
        a = _Named("a", port)  # back on its port
        time.sleep(0.6)  # past down_s
        with httpx.Client(timeout=5) as client:
            assert client.get(f"{forwarder.url}/health").text == "a"
        assert forwarder.chosen == {a.url: 2, b.url: 2}
    finally:
        forwarder.close()
        a.close()
        b.close()


def test_a_roles_order_is_stable_and_spreads_the_roles():
    urls = [f"http://prefect-api-{i}:4200/api" for i in range(1, 4)]
    assert preference(urls, "host-7-small") == preference(list(reversed(urls)), "host-7-small")
    firsts = [preference(urls, f"host-{i}-small")[0] for i in range(300)]
    assert all(60 <= firsts.count(url) <= 140 for url in urls), {url: firsts.count(url) for url in urls}
    # One server gone: only its roles move; the others keep theirs.
    for i in range(300):
        before = preference(urls, f"host-{i}-small")
        after = preference(urls[1:], f"host-{i}-small")
        assert after == [url for url in before if url != urls[0]]


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--api-servers", "2", "--redis-url", f"{REDIS}/0"], "needs PostgreSQL: set PREFECT_API_DATABASE_CONNECTION_URL"),
    (["--api-servers", "2"], "needs PostgreSQL"),
    (["--no-services", "--redis-url", f"{REDIS}/0"], "SQLite under PREFECT_HOME"),
])
def test_a_scaled_control_plane_on_sqlite_is_refused(argv, says, tmp_path):
    import subprocess

    done = subprocess.run([*HARVEST, "server", *argv], env=clean_env(HARVEST_HOME=str(tmp_path)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_more_than_one_server_without_redis_is_refused():
    from fleet.control_plane import check_scaled

    pg = "postgresql+asyncpg://postgres@127.0.0.1:5432/x"
    with pytest.raises(SystemExit, match="needs Redis.*--redis-url or HARVEST_REDIS_URL"):
        check_scaled("harvest server", pg, "", 2, True)
    with pytest.raises(SystemExit, match="not one"):
        check_scaled("harvest server", pg, "http://127.0.0.1:6379", 2, True)
    check_scaled("harvest server", pg, f"{REDIS}/0", 2, True)  # passes
    check_scaled("harvest server", "", "", 1, True)  # the default: one process on SQLite
