"""Process supervision for every role and `harvest up`: starting the children (the Prefect
server, one worker per lane under its run starter, the API), watching them, restarting one that
dies (`Supervisor`), and stopping them all (`serve` runs a role in the foreground).

Shared by the roles, `harvest up` and the test fixtures, so the tests start things exactly as
users do.

Stopping is the delicate part: a `prefect worker` turns the first
SIGTERM into SIGINT and keeps polling, so `stop()` signals twice, then SIGKILLs; and flow-run
processes are started by the worker in sessions of their own, so a process-group kill misses
them. `stop()` therefore snapshots the whole descendant tree first and kills what is left of
it at the end. Nothing started here outlives a `stop()`.

Each child is handed its environment, never the role's whole one: the role's, less the secrets
the child does not use (`harvest.credentials.handed`, with `SERVER_NEEDS`, `WORKER_NEEDS`,
`API_NEEDS`). A worker host's Prefect worker, and so its flow runs, never holds the job store's
URL, the metrics token (the role's own exporter keeps it) or the link-signing key.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil

from harvest.addresses import local_address
from harvest.cpu_share import with_passive_waits
from harvest.credentials import PREFECT_CLIENT, PREFECT_DATABASE, PREFECT_REDIS, STORAGE, handed
from harvest.private_files import open_private_log
from harvest.metrics import MULTIPROC_ENV
from harvest.metrics_export import fresh_directory

__all__ = [
    "Managed", "Supervisor", "serve", "say", "WORKER_QUERY_S", "STARTER_MODULE", "POOL_WORKER_MODULE", "RUN_COMMAND", "free_port", "start_server", "start_worker", "wait_http",
    "descendants", "SERVER_NEEDS", "WORKER_NEEDS", "API_NEEDS", "prefect_argv",
]

SERVER_NEEDS = ("PREFECT_SERVER_API_AUTH_STRING", *PREFECT_DATABASE, *PREFECT_REDIS, *PREFECT_CLIENT)
"""The secrets a Prefect server process (or the services' process) is handed: its password, its
database and, scaled, its Redis (and the client's copy of the password, the same string). No
storage, job store or metrics token."""
WORKER_NEEDS = (*PREFECT_CLIENT, *STORAGE)
"""The secrets a worker host's Prefect worker is handed, and so every flow run it starts: the
Prefect API (to poll, report, and start helper runs) and the bucket (to read requests and
write shards). Its engine servers get less still (`harvest.warm.client.engine_server_env`)."""
API_NEEDS = (*PREFECT_CLIENT, *STORAGE, "HARVEST_DATABASE_URL", "HARVEST_SIGNING_SECRET", "HARVEST_METRICS_TOKEN")
"""The secrets an API replica's uvicorn is handed: the Prefect API (it starts and cancels
runs), the bucket (request.json, reads, presigning), the job store, the links' key and the
token of its own /metrics. Never Prefect's database or the server's side of the password."""


WORKER_QUERY_S = 5.0
"""How often a worker asks its pool for scheduled runs (PREFECT_WORKER_QUERY_SECONDS), as
shipped to every worker the roles start. A host's worker (`fleet.pool_worker`) takes a run when
Prefect's event stream says one was scheduled or a slot came free, so the poll only catches
what an event missed (a run that came due, a stream that broke). Each poll is a write on the
Prefect server (bench/RESULTS.md, "Worker polling"): at 5 s a host costs the server a fifth of
what the 1 s shipped before did, and a warm job through `make run` took no longer
(bench/RESULTS.md, "Through make run", 2026-12-07 18:50). Prefect's own default is 10 s. An
operator's PREFECT_WORKER_QUERY_SECONDS wins."""

STARTER_MODULE = "fleet.run_starter"
"""The run starter (a worker host's fork server) and its launcher, run as `python -m`."""
POOL_WORKER_MODULE = "fleet.pool_worker"
"""A host's Prefect process worker, woken by Prefect's events as well as its poll, run as `python -m`."""
RUN_COMMAND = f"python -m {STARTER_MODULE}"
"""The harvest deployments' `command` job variable (`flows.deploy` is handed it): the launcher,
which forks the run from its host's starter, or becomes `python -m prefect.engine` where there
is none."""


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(consecutive: int = 1) -> int:
    """A port free now on 127.0.0.1 (with the `consecutive - 1` after it), for a server about to
    bind it.

    Drawn from below the kernel's ephemeral range: a port found by binding port 0 comes from
    that range, and before the server binds it any outgoing connection on the machine, or
    another `bind(0)`, can take it (the server then dies with "address already in use"). Ports
    below the range are handed out by no one but their binders.
    """
    import random

    floor = _ephemeral_floor()
    for _ in range(200):
        port = random.randrange(max(1024, floor - 12000), floor - consecutive)
        held: list[socket.socket] = []
        try:
            for offset in range(consecutive):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {consecutive} consecutive free ports below {floor}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class Managed:
    """One child process (in its own session) and how to stop it and everything it started.

    Every instance is listed in `Managed.started`, so a supervisor interrupted half-way
    through starting things can still stop all of them. `restart()` starts the same command
    again in the same object (a supervisor restarting a child that died).
    """

    started: list["Managed"] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, *, signals: int = 1, cwd: str | None = None):
        self.name = name
        self.signals = signals
        self.log_path = log
        self._command = (argv, env, cwd)
        self._log = open_private_log(log)  # owner-only from the first byte (`harvest.private_files`)
        self.proc = self._popen()
        Managed.started.append(self)

    def _popen(self) -> subprocess.Popen:
        argv, env, cwd = self._command
        return subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True
        )

    def restart(self) -> None:
        """Start the same command again once the process has exited, after killing whatever of
        its session is left (e.g. the Prefect worker of a run starter that was killed), so the
        new one never runs beside an old one."""
        if self.alive():
            raise RuntimeError(f"{self.name} (pid {self.pid}) is still running")
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log.closed:
            self._log = open_private_log(self.log_path)
        self.proc = self._popen()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (twice for a worker), wait, then SIGKILL whatever of the tree is left."""
        tree = descendants(self.pid)
        for i in range(self.signals):
            if not self.alive():
                break
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout if i == self.signals - 1 else 1.0)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=5)
        self.kill_tree(tree)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the process and its whole tree at once (a machine lost, in tests)."""
        tree = descendants(self.pid)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.kill_tree(tree)
        self.proc.wait(timeout=5)
        self._log.close()

    @staticmethod
    def kill_tree(tree: list[psutil.Process]) -> None:
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=5)

    def check_running(self) -> None:
        """Raise, with its log's tail, if the process has exited (a start that failed)."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_http(url: str, timeout: float, proc: Managed | None = None, *, ok_only: bool = False) -> None:
    """Wait until `url` answers HTTP (any status below 500; with `ok_only`, a 2xx)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # one client: each makes a TLS context (~20 ms of CPU)
        while time.monotonic() < deadline:
            if proc is not None:
                proc.check_running()
            try:
                status = client.get(url).status_code
                if status < 300 or (status < 500 and not ok_only):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s" + (f":\n{proc.tail()}" if proc else ""))


# A run starter imports for a few seconds before it listens; runs that come sooner start the slow way.
STARTER_TIMEOUT_S = 90.0


def _wait_for_starter(socket_path: Path, proc: Managed, timeout: float) -> None:
    """Until the run starter listens, so the host's first runs fork too."""
    deadline = time.monotonic() + timeout
    while not socket_path.exists():
        proc.check_running()
        if time.monotonic() > deadline or "run starter: not serving" in proc.tail():
            return  # it still works: each run starts as a fresh process
        time.sleep(0.2)


def prefect_argv() -> list[str]:
    """Prefect's CLI, run by this interpreter."""
    return [sys.executable, "-m", "prefect"]


def start_server(
    home: Path, port: int, env: dict[str, str] | None = None, timeout: float = 60, *, host: str = "127.0.0.1",
    advertise: str | None = None, services: bool = True, after: str | None = None,
) -> tuple[Managed, str]:
    """Prefect's server on host:port (`fleet.prefect_server`: `prefect server start`'s app with a
    short `Retry-After` on its 503s), PREFECT_HOME = `home`; with `services` False, the API alone
    (a scaled control plane's server: `fleet.control_plane` runs the services apart); with `after`
    (a URL), serving only once that answers (its imports done meanwhile).

    Its database is Prefect's own setting: PREFECT_API_DATABASE_CONNECTION_URL (PostgreSQL in
    production) when set, else SQLite under `home`. Returns the process and the API URL (at the
    `advertise` address, default `host`), once the API answers (~10 s cold). Of the secrets it
    is handed only its own (`SERVER_NEEDS`).
    """
    api_url = f"http://{advertise or host}:{port}/api"
    env = {
        **handed({**os.environ, **(env or {})}, SERVER_NEEDS),
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api_url,
    }
    env.pop("PREFECT_API_URL", None)  # the server must not try to talk to another server
    server = Managed(
        "prefect-server",
        [sys.executable, "-m", "fleet.prefect_server", "--host", host, "--port", str(port), *([] if services else ["--no-services"]),
         *(["--after", after] if after else [])],
        env,
        home / "server.log",
        cwd=str(home),
    )
    try:
        wait_http(f"http://{local_address(host)}:{port}/api/health", timeout, server)
    except Exception:
        server.stop()
        raise
    return server, api_url


def start_worker(
    pool: str, api_url: str, log: Path, env: dict[str, str] | None = None, name: str | None = None, *,
    healthcheck: bool = False, cwd: str | None = None, limit: int | None = None, run_starter: Path | None = None,
    metrics_dir: Path | None = None,
) -> Managed:
    """A process worker polling `pool`; its flow runs inherit `env` (e.g. HARVEST_ENGINE=hf)
    over this process's environment, less the secrets a run does not use (`WORKER_NEEDS`).

    healthcheck: serve `/health` on PREFECT_WORKER_WEBSERVER_HOST/PORT (a load balancer's or a
    supervisor's view of whether the worker still polls).
    limit: flow runs at once on this worker (`--limit`; Prefect holds a slot for the run
    process's whole life), e.g. the host's slots.
    run_starter: a Unix socket path: the worker runs under `fleet.run_starter`, which forks its
    flow runs from a preloaded process listening there (a worker host's runs start in ms).
    metrics_dir: the host's counts directory, emptied and given to the whole tree (its runs
    and engine servers) as PROMETHEUS_MULTIPROC_DIR, for `fleet.metrics` to read.
    """
    # The harvest deployments' run command (RUN_COMMAND) says `python`: this interpreter's.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    # The shipped poll interval unless the operator (or a caller) sets one (WORKER_QUERY_S).
    # Its runs' tensor work (statistics; forward passes where no engine server serves them)
    # with OpenMP's idle threads sleeping (`harvest.cpu_share.with_passive_waits`).
    # Only the secrets a run uses (WORKER_NEEDS): not the job store's, not the metrics token.
    env = with_passive_waits(handed({"PREFECT_WORKER_QUERY_SECONDS": str(WORKER_QUERY_S), **os.environ, **(env or {}),
                                     "PREFECT_API_URL": api_url, "PATH": path}, WORKER_NEEDS))
    if metrics_dir is not None:
        env[MULTIPROC_ENV] = str(fresh_directory(metrics_dir))
    # Prefect's process worker, woken by Prefect's events as well as its poll (`fleet.pool_worker`).
    argv = [sys.executable, "-m", POOL_WORKER_MODULE, "--pool", pool]
    if name:
        argv += ["--name", name]
    if healthcheck:
        argv.append("--with-healthcheck")
    if limit is not None:
        argv += ["--limit", str(limit)]
    if run_starter is None:
        return Managed(f"worker-{pool}", argv, env, log, signals=2, cwd=cwd)
    argv = [sys.executable, "-m", STARTER_MODULE, "--socket", str(run_starter), "--", *argv]
    # A starter killed outright leaves its socket file: gone first, so the wait below sees this
    # starter's own (it would remove that file itself before listening anyway).
    Path(run_starter).unlink(missing_ok=True)
    worker = Managed(f"worker-{pool}", argv, env, log, signals=2, cwd=cwd)
    _wait_for_starter(Path(run_starter), worker, STARTER_TIMEOUT_S)
    return worker


def say(prog: str, text: str) -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


class Supervisor:
    """The children of one role (or of `harvest up`): watched, restarted one by one when they
    die, and stopped together.

    A child that dies (an API replica OOM-killed, a worker crashed) is started again on its own
    command, port and log, while the others keep running: at most `restart_limit` times within
    `restart_window_s` (settings); one more death means it cannot stay up, and the supervisor
    stops everything and exits 1, saying which child and where its log is.
    """

    # Stop order: API first (no new jobs), then workers (and their flow runs), the server last.
    ORDER = {"api": 0, "prefect-server": 2, "prefect-services": 3}

    def __init__(self, prog: str, restart_limit: int, restart_window_s: float):
        self.prog = prog
        self.stopping = threading.Event()
        self.restart_limit = restart_limit
        self.restart_window_s = restart_window_s
        self.restarts: dict[int, list[float]] = {}  # id(child) -> monotonic times of its restarts

    def watch(self) -> int:
        """Block, restarting children that die, until one dies too often (→ 1); a signal
        unwinds it with KeyboardInterrupt."""
        while not self.stopping.wait(1.0):
            for child in list(Managed.started):
                if not child.alive() and not self.restart(child):
                    return 1
        return 0

    def restart(self, child: Managed) -> bool:
        """Restart a child that exited; False when it has used up its restarts."""
        now = time.monotonic()
        recent = [t for t in self.restarts.get(id(child), []) if now - t < self.restart_window_s]
        code = child.proc.returncode
        if len(recent) >= self.restart_limit:
            say(self.prog, f"{child.name} exited with {code} after {len(recent)} restarts in {self.restart_window_s:.0f} s; "
                           f"stopping (log: {child.log_path})")
            return False
        child.restart()
        self.restarts[id(child)] = [*recent, now]
        say(self.prog, f"{child.name} exited with {code}; restarted as pid {child.pid} "
                       f"({len(recent) + 1} of {self.restart_limit} in {self.restart_window_s:.0f} s; log: {child.log_path})")
        return True

    def down(self) -> None:
        self.stopping.set()
        # `Managed.started` also holds a child whose start was interrupted before it answered.
        for child in sorted(Managed.started, key=lambda c: self.ORDER.get(c.name, 1)):
            if child.alive():
                child.stop()


def serve(prog: str, start: Callable[[], dict[str, str] | list[str]], on_stop: Callable[[], None] | None = None) -> int:
    """Run a role in the foreground: start it, print its ready lines, watch it, stop it.

    `start` returns the lines to print (a dict prints as NAME=value) once everything answers.
    """
    from fleet.settings import FleetSettings
    from harvest.settings import get_settings

    settings = get_settings(FleetSettings)  # the role's process: its operator's settings
    supervisor = Supervisor(prog, settings.restart_limit, settings.restart_window_s)

    def on_signal(signum, frame):
        # Never take a lock here (no Event.set): the handler runs in the main thread, possibly
        # inside `stopping.wait`, which holds the event's lock, and would deadlock. Ignore any
        # further signal (make forwards one, an impatient Ctrl-C) so nothing can cut the stop
        # short, then unwind; the `finally` below stops every child.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        ready = start()
        lines = [f"{k}={v}" for k, v in ready.items()] if isinstance(ready, dict) else ready
        for line in lines:
            print(line, flush=True)
        code = supervisor.watch()
    except KeyboardInterrupt:
        code = 0
    except Exception as exc:
        say(prog, f"failed to start: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        # Also when a child died (no signal): `down` is bounded (SIGKILL after a grace), so let
        # nothing interrupt it and orphan the children.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        say(prog, "stopping")
        supervisor.down()
        if on_stop is not None:
            on_stop()
        say(prog, "stopped")
    return code
