"""A worker host's `/metrics` exporter: what its flow runs and engine servers counted, and the
memory of each of its processes.

The host's processes are short-lived (a flow run per job, forked from the run starter) or
detached (engine servers), so none of them can be scraped itself: the role gives the whole
tree one counts directory (`start_worker(metrics_dir=…)` sets PROMETHEUS_MULTIPROC_DIR for the
starter, which every run and engine server inherits; `harvest.metrics` says why), and this
exporter, a thread of the role's own process, sums it on each scrape
(`harvest.metrics_export`). It binds 127.0.0.1 by default (`harvest worker --metrics-host`),
and every scrape must carry the metrics token as `Authorization: Bearer …`, whatever the
address: a scraper on the fleet's network (compose's Prometheus) needs the bind, never less.

Its port: `HARVEST_METRICS_PORT` (9464) unless given. Two `harvest worker` roles on one
machine (one per lane, say) both start with their defaults: when the default port is taken,
the exporter moves aside to the next free one (`MOVE_ASIDE` ports up, then any) and the role's
stderr line names the address it took. A port the operator chose (`--metrics-port` or
`HARVEST_METRICS_PORT`) is never moved: taken, the role refuses to start, naming the address
and both ways to choose another (`MetricsPortTaken`), since a scraper is configured for it.

Process kinds (`harvest_process_*{process}`): `supervisor` (the `harvest worker` role),
`run_starter`, `prefect_worker`, `launcher` (the per-run stub the worker starts), `flow_run`,
`engine_server` (found by their pid files under `<home>/engines/`, whichever process started
them), `other`. In `harvest up` both lanes' exporters share the box's engine servers: each
lists them, and an engine's loads count on the exporter of the lane whose run started it.
"""

from __future__ import annotations

import errno
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from pathlib import Path

import psutil

from fleet.processes import POOL_WORKER_MODULE, STARTER_MODULE
from harvest.metrics_export import authorized, exposition, host_registry, process_tree
from harvest.warm.protocol import GroupFiles

__all__ = ["Exporter", "MetricsPortTaken", "worker_processes", "serve_worker_metrics"]

MOVE_ASIDE = 16
"""Ports past a taken default port tried, in order, before any free one."""


class MetricsPortTaken(SystemExit):
    """The port an operator chose for /metrics is in use: the role stops, saying so."""


def _listen(host: str, port: int, handler, *, chosen: bool) -> ThreadingHTTPServer:
    """A server on host:port; the default port moved aside when taken (module docstring)."""
    candidates = [port] if chosen or port == 0 else [*range(port, min(port + MOVE_ASIDE, 65536)), 0]
    for candidate in candidates:
        try:
            return ThreadingHTTPServer((host, candidate), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            if chosen:
                raise MetricsPortTaken(
                    f"/metrics cannot listen on {host}:{port}: the address is already in use (another `harvest "
                    f"worker` on this machine?). Give this one another port with --metrics-port or "
                    f"HARVEST_METRICS_PORT (0: no /metrics)."
                ) from None
    raise AssertionError("port 0 is always free")


def _kind(process: psutil.Process, root: int) -> str:
    try:
        command = process.cmdline()
    except psutil.Error:
        return "other"
    line = " ".join(command)
    if "harvest.warm.server" in line:
        return "engine_server"
    if STARTER_MODULE in line:
        if process.pid == root:
            return "run_starter"
        # A run forked from the starter keeps its command line; the launcher has no --socket.
        return "flow_run" if "--socket" in command else "launcher"
    if "prefect.engine" in line:
        return "flow_run"  # a run started the slow way (no starter)
    if POOL_WORKER_MODULE in line or ("prefect" in line and "worker" in command and "start" in command):
        return "prefect_worker"
    return "other"


def worker_processes(worker_pid: Callable[[], int], home: Path, supervisor_pid: int | None = None):
    """The host's processes with their kinds: the role's (`supervisor_pid`), the worker's
    tree (`worker_pid`: its run starter, or its Prefect worker where it has none) and the
    engine servers of `home`. Returns a function, read again on each scrape (`worker_pid()`
    too: a worker that died is restarted under another pid)."""

    def listing():
        seen: set[int] = set()
        if supervisor_pid is not None:
            try:
                seen.add(supervisor_pid)
                yield "supervisor", psutil.Process(supervisor_pid)
            except psutil.Error:
                pass
        root_pid = worker_pid()
        try:
            root = psutil.Process(root_pid)
        except psutil.Error:
            root = None
        for process in process_tree(root) if root is not None else []:
            if process.pid not in seen:
                seen.add(process.pid)
                yield _kind(process, root_pid), process
        engines = Path(home) / "engines"
        for pid_file in engines.glob("*.pid") if engines.is_dir() else []:
            pid = GroupFiles(home, pid_file.stem).server_pid()
            if pid is not None and pid not in seen:
                seen.add(pid)
                try:
                    yield "engine_server", psutil.Process(pid)
                except psutil.Error:
                    pass

    return listing


class Exporter:
    """`GET /metrics` of one registry on host:port (port 0: a free one), in a daemon thread;
    401 without the token."""

    def __init__(self, registry, token: str, host: str = "127.0.0.1", port: int = 0, *, chosen: bool = True):
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    return self._answer(404, b"only /metrics here\n", "text/plain")
                if not authorized(self.headers.get("Authorization"), exporter.token):
                    return self._answer(401, b"/metrics needs the metrics token as 'Authorization: Bearer TOKEN'\n",
                                        "text/plain", {"WWW-Authenticate": "Bearer"})
                body, content_type = exposition(exporter.registry)
                self._answer(200, body, content_type)

            def _answer(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # scrapes every 15 s would flood the role's stderr
                pass

        self.registry = registry
        self.token = token
        self.server = _listen(host, port, Handler, chosen=chosen)
        self.server.daemon_threads = True
        self.host = host
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-exporter", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_worker_metrics(
    worker_pid: Callable[[], int], home: Path, directory: Path, token: str, *, host: str = "127.0.0.1", port: int = 0,
    supervisor: bool = False, chosen: bool = True,
) -> Exporter:
    """The worker host's exporter over its counts `directory` (what `start_worker` gave its
    tree); `worker_pid()`: its worker's pid now (`Managed.pid`); `supervisor`: this process is
    the host's role (list it as such); `chosen`: `port` is the operator's, never moved aside."""
    processes = worker_processes(worker_pid, home, os.getpid() if supervisor else None)
    return Exporter(host_registry(Path(directory), processes), token, host, port, chosen=chosen)
