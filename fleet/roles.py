"""The service's roles, one command each, for running it as a fleet.

    harvest server               the control plane: Prefect server, pools, deployments,
                                 schedules and liveness automations (applied idempotently);
                                 with --api-servers N --redis-url URL, scaled: N Prefect API
                                 servers and the services apart, on PostgreSQL and Redis
                                 (`fleet.control_plane`)
    harvest api                  one API replica (any number of them on one PostgreSQL)
    harvest worker --lane LANE   one worker host of a lane (its Prefect worker)

`harvest up` (`fleet.stack`) is the one-box stack built from the same parts.

Each role reads only its own configuration: `PREFECT_API_URL`, or a scaled control plane's
server list `HARVEST_PREFECT_API_URLS` (api, worker: `fleet.prefect_endpoints`),
`HARVEST_DATABASE_URL` (api), `HARVEST_STORAGE_URL` with `HARVEST_S3_ENDPOINT_URL` and the
AWS variables (api, worker), Prefect's `PREFECT_API_DATABASE_CONNECTION_URL` (server), and
`HARVEST_HOME` as the host's own scratch: model cache, logs, Prefect's home. The control
plane requires a password (`flows.prefect_auth`): `harvest server` takes
`PREFECT_SERVER_API_AUTH_STRING` or generates one into its HARVEST_HOME; the other roles send
`PREFECT_API_AUTH_STRING` (or the one in their HARVEST_HOME, on one host). Each runs its
children with `HARVEST_HOME` as working directory, and flow code is imported from the
installed package (deployments have module entrypoints and no pull steps), so no role reads
the source checkout or another role's files. Each child is handed only the secrets it uses
(`fleet.processes`: a worker's runs never hold the job store's URL or the metrics token).
Each prints its ready line(s) on stdout once it answers, and stops cleanly on SIGTERM or
Ctrl-C, leaving no child process.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

from fleet.control_plane import check_redis, check_scaled, prefect_database_url, redis_env, start_api_servers, start_services
from fleet.placeholders import refuse_placeholder_secrets
from fleet.prefect_endpoints import ApiForwarder, parse_api_urls, preference
from fleet.processes import API_NEEDS, RUN_COMMAND, Managed, free_port, say, serve, start_server, start_worker, wait_http
from fleet.proxies import uvicorn_proxy_args
from flows.prefect_auth import SERVER_ENV, client_auth, server_auth, use_client_auth
from harvest.addresses import advertised, local_address
from harvest.credentials import handed
from harvest.private_files import private_dirs
from harvest.metrics import MULTIPROC_ENV
from harvest.metrics_export import fresh_directory

__all__ = [
    "start_control_plane",
    "start_scaled_control_plane",
    "API_APP",
    "api_command",
    "start_api_replica",
    "start_worker_host",
    "server_main",
    "api_main",
    "worker_main",
]


def _prefect_home(home: Path) -> Path:
    return Path(os.environ.get("PREFECT_HOME") or home / "prefect")


def start_control_plane(home: Path, host: str, port: int, timeout: float = 90) -> tuple[Managed, str]:
    """The Prefect server (its database from PREFECT_API_DATABASE_CONNECTION_URL, else SQLite
    under PREFECT_HOME), with basic auth on (`flows.prefect_auth.server_auth`), then pools,
    deployments, schedules and liveness automations."""
    auth = server_auth(home)
    use_client_auth(auth)  # our own deploy calls
    env = {"HARVEST_HOME": str(home), SERVER_ENV: auth}
    server, api_url = start_server(_prefect_home(home), port, env, timeout, host=host, advertise=advertised(host))
    apply_control_plane(api_url)
    return server, api_url


def start_scaled_control_plane(
    home: Path, host: str, port: int, api_servers: int, redis_url: str, *, services: bool = True, timeout: float = 90,
) -> tuple[list[Managed], list[str]]:
    """This host's share of a scaled control plane (`fleet.control_plane`; checked first by
    `check_scaled`): `api_servers` Prefect API servers on `port`, `port`+1, … (their services
    off) and, with `services`, Prefect's services in a process of their own, which then applies
    the control plane's objects through a server: this host's first, or with none here the
    servers of HARVEST_PREFECT_API_URLS / PREFECT_API_URL. Returns the processes and this
    host's API URLs."""
    from concurrent.futures import ThreadPoolExecutor

    auth = server_auth(home)
    use_client_auth(auth)  # our own deploy calls
    env = {"HARVEST_HOME": str(home), SERVER_ENV: auth, **redis_env(redis_url)}
    prefect_home = _prefect_home(home)
    ports = [port + i for i in range(api_servers)]
    with ThreadPoolExecutor(3) as pool:
        # The deploy's imports (the flows: torch, transformers; seconds) while the servers start.
        imports = pool.submit(_import_for_apply) if services else None
        servers = pool.submit(start_api_servers, prefect_home, host, ports, env, timeout, advertise=advertised(host))
        if services:
            if ports:  # the services need the database migrated: by the first server
                wait_http(f"http://{local_address(host)}:{ports[0]}/api/health", timeout)
            services_started = pool.submit(start_services, prefect_home / "services", env, timeout)
        processes, urls = servers.result()
        if services:
            processes.append(services_started.result())
            imports.result()
    if services:
        apply_control_plane(urls[0] if urls else _prefect_api_url("harvest server", f"{socket.gethostname()}-services"))
    return processes, urls


def _import_for_apply() -> None:
    """What `apply_control_plane` imports: the deploy, and the flows it loads by entrypoint."""
    import flows.corpus_refresh  # noqa: F401  (imports flows.harvest: torch, transformers)
    import flows.deploy  # noqa: F401
    import flows.liveness  # noqa: F401
    import flows.retention  # noqa: F401


def apply_control_plane(api_url: str) -> list[str]:
    """Everything the control plane declares, applied to the server at `api_url` (idempotent);
    the harvest deployments run their flow runs through this fleet's launcher (RUN_COMMAND)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import apply_sync
    from flows.liveness import apply_automations_sync
    from harvest.lanes import load_lanes
    from harvest.settings import get_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        names = apply_sync(load_lanes(get_settings()), run_command=RUN_COMMAND)
        pools = sorted({name.split("harvest-", 1)[1] for name in names if "/harvest-" in name})
        names += apply_automations_sync(pools)
    return names


API_APP = "api.app:create_app"
"""The app factory an API replica runs (`api_command`)."""


def api_command(app: str, host: str, port: int, *, trusted_proxies: str = "", log_level: str | None = None) -> list[str]:
    """The command line of one API replica process: the app factory `app` under uvicorn with
    the replica's HTTP parsing bounds (`api.http_server`, read from its own environment), proxy
    headers believed only from `trusted_proxies` (`fleet.proxies`: HARVEST_TRUSTED_PROXIES as
    the operator set it for the role; none by default). `start_api_replica` and the tests'
    `ApiServer` run it."""
    return [sys.executable, "-m", "api.http_server", app, "--host", host, "--port", str(port),
            *uvicorn_proxy_args(trusted_proxies),
            *(["--log-level", log_level] if log_level else [])]


def start_api_replica(
    home: Path, host: str, port: int, env: dict[str, str] | None = None, timeout: float = 90, *, app: str = API_APP,
    trusted_proxies: str = "",
) -> tuple[Managed, str]:
    """One uvicorn API process on host:port running the factory `app` (`api_command`, with
    `trusted_proxies`); returns it and its `ACS_API_BASE` once it answers."""
    api = Managed(
        "api",
        api_command(app, host, port, trusted_proxies=trusted_proxies),
        {**handed({**os.environ, **(env or {})}, API_NEEDS), "HARVEST_HOME": str(home), "HARVEST_PORT": str(port),
         # its counts directory, its children's too (`api.metrics`, `harvest.metrics`)
         MULTIPROC_ENV: str(fresh_directory(home / "metrics" / f"api-{port}"))},
        home / "logs" / f"api-{port}.log",
        cwd=str(home),
    )
    wait_http(f"http://{local_address(host)}:{port}/health", timeout, api)
    return api, f"http://{advertised(host)}:{port}/v1"


def start_worker_host(
    home: Path, lane: str, api_url: str, *, env: dict[str, str] | None = None, health_port: int | None = None,
    name: str | None = None, timeout: float = 90, gpus: list[str] | None = None, gpus_per_run: int | None = None,
    slots: int | None = None, metrics: tuple[str, int, bool] | None = None,
) -> Managed:
    """This host's Prefect worker on the lane's pool, with heartbeats on (`flows.liveness`);
    returns once its health check says it polls.

    The host's slots (`harvest.placement.host_slots`): `gpus` (default: every visible GPU) in
    groups of `gpus_per_run` (default: the lane's, `harvest.lanes`), or `slots` places without
    devices (a CPU host; default one). The worker runs with `--limit <slots>`, so it never runs
    more flow runs at once than the host has slots; its flow runs get the table in
    HARVEST_SLOTS and each claims one; the count is published for the lane's automatic
    scale-out (`flows.placement.publish_host`).

    `metrics` (host, port; port 0: a free one): this process serves the host's `/metrics`
    there (`fleet.metrics`), over the counts its worker, runs and engine servers write.
    """
    from flows.liveness import HEARTBEAT_ENV
    from flows.placement import publish_host
    from harvest.placement import describe_slots, host_slots
    from harvest.warm.protocol import unix_socket_path

    table = host_slots(gpus, gpus_per_run or _lane_gpus_per_run(lane), slots)
    health_port = health_port or free_port()
    worker_env = {
        **(env or {}),
        **HEARTBEAT_ENV,
        "HARVEST_HOME": str(home),
        "HARVEST_SLOTS": json.dumps(table),
        "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
        "PREFECT_WORKER_WEBSERVER_PORT": str(health_port),
    }
    name = name or f"{socket.gethostname()}-{lane}-{os.getpid()}"
    worker = start_worker(
        lane, api_url, home / "logs" / f"worker-{lane}.log", worker_env, name=name, healthcheck=True, cwd=str(home), limit=len(table),
        run_starter=unix_socket_path(home / "engines", f"runs-{lane}-{secrets.token_hex(4)}"),
        metrics_dir=home / "metrics" / f"worker-{lane}" if metrics else None,
    )
    wait_http(f"http://127.0.0.1:{health_port}/health", timeout, worker, ok_only=True)
    publish_host(lane, name, table, api_url)
    say("harvest worker", f"{name} on lane {lane}: {describe_slots(table)}")
    if metrics:
        from fleet.metrics import serve_worker_metrics
        from harvest.metrics_export import metrics_token
        from harvest.settings import get_settings

        host, port, chosen = metrics
        try:
            exporter = serve_worker_metrics(lambda: worker.pid, home, home / "metrics" / f"worker-{lane}",
                                            metrics_token(get_settings()), host=host, port=port, supervisor=True, chosen=chosen)
        except SystemExit:
            worker.stop()  # the role stops, leaving nothing of it running
            raise
        moved = "" if port in (0, exporter.port) else f"; {port} was taken"
        say("harvest worker", f"metrics of lane {lane} at {exporter.url} (bound to {exporter.host}{moved}; the metrics token required)")
    return worker


def _lane_gpus_per_run(lane: str) -> int:
    """GPUs per run of a lane declared in the lanes file (1 for a lane it does not declare)."""
    from harvest.lanes import load_lanes
    from harvest.settings import get_settings

    declared = load_lanes(get_settings()).get(lane)
    return declared.gpus_per_run if declared is not None else 1


def _home() -> Path:
    from harvest.settings import get_settings

    home = get_settings().home
    private_dirs(home / "logs")  # new folders 0700: logs are the service's alone
    return home


def _prefect_api_url(prog: str, name: str) -> str:
    """The Prefect API of this role's own calls and of every child it starts: PREFECT_API_URL
    (one server, or a load balancer in front of several), or, given a scaled control plane's
    HARVEST_PREFECT_API_URLS, a forwarder on 127.0.0.1 to those servers in the order of this
    role's `name`, moving to the next when one is down (`fleet.prefect_endpoints`; it runs as
    long as the role), put in PREFECT_API_URL for the children."""
    from fleet.settings import FleetSettings
    from harvest.settings import get_settings

    url = os.environ.get("PREFECT_API_URL")
    listed = get_settings(FleetSettings).prefect_api_urls
    if listed and url:
        raise SystemExit(f"{prog}: both PREFECT_API_URL and HARVEST_PREFECT_API_URLS are set: give one (a load "
                         "balancer's URL, or the servers' list)")
    if listed:
        order = preference(parse_api_urls(listed), name)
        url = ApiForwarder(order).url
        os.environ["PREFECT_API_URL"] = url
        if "prefect.context" in sys.modules:  # Prefect read its settings at import: read them again
            from prefect.context import refresh_global_settings_context

            refresh_global_settings_context()
        say(prog, f"Prefect API servers, in {name}'s order: {', '.join(order)} (its children reach them at {url})")
    if not url:
        raise SystemExit(f"{prog}: set PREFECT_API_URL to the control plane's (what `harvest server` printed), or "
                         "HARVEST_PREFECT_API_URLS to a scaled control plane's servers")
    auth = client_auth(_home())
    if auth is None:
        say(prog, "no PREFECT_API_AUTH_STRING: a control plane with its password on (as `harvest server` "
                  "runs) answers 401; set it to the server's PREFECT_SERVER_API_AUTH_STRING")
    else:
        use_client_auth(auth)  # this role's own calls and every child's
    return url


def server_main(argv: list[str]) -> int:
    from fleet.settings import FleetSettings
    from harvest.settings import get_settings

    parser = argparse.ArgumentParser(prog="harvest server", description="The control plane: Prefect server, pools, deployments, automations.")
    parser.add_argument("--host", help="address to bind and advertise (default HARVEST_PREFECT_HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default HARVEST_PREFECT_PORT, 4200; a scaled control plane's "
                        "further API servers take the next ports)")
    parser.add_argument("--api-servers", type=int, help="Prefect API server processes (default HARVEST_PREFECT_API_SERVERS, "
                        "1); more than one, or 0 (the services alone), needs --redis-url and PostgreSQL")
    parser.add_argument("--redis-url", help="Redis of a scaled control plane, e.g. redis://127.0.0.1:6379/0 (default "
                        "HARVEST_REDIS_URL): the services run in a process of their own")
    parser.add_argument("--no-services", action="store_true", help="run no Prefect services here (another `harvest "
                        "server` of the same control plane runs them); needs --redis-url")
    args = parser.parse_args(argv[1:])
    settings = get_settings(FleetSettings)
    host, port = args.host or settings.prefect_host, args.port or settings.prefect_port
    api_servers = settings.prefect_api_servers if args.api_servers is None else args.api_servers
    redis_url = args.redis_url or settings.redis_url
    services = not args.no_services
    check_scaled("harvest server", prefect_database_url(dict(os.environ)), redis_url, api_servers, services)
    if api_servers == 0 and services and not (settings.prefect_api_urls or os.environ.get("PREFECT_API_URL")):
        raise SystemExit("harvest server: --api-servers 0 runs the services alone and applies the control plane through "
                         "its API servers: set HARVEST_PREFECT_API_URLS (or PREFECT_API_URL) to them")
    if redis_url:
        check_redis("harvest server", redis_url)

    def start() -> dict[str, str]:
        started = time.monotonic()
        if not redis_url:  # one process, its services inside it (the default)
            _, api_url = start_control_plane(_home(), host, port)
            urls = [api_url]
        else:
            _, urls = start_scaled_control_plane(_home(), host, port, api_servers, redis_url, services=services)
        say("harvest server", f"ready in {time.monotonic() - started:.1f} s" + ("" if urls else " (the services alone)"))
        if not urls:
            return {"PREFECT_SERVICES": "running"}
        lines = {"PREFECT_API_URL": urls[0], "PREFECT_UI": urls[0].removesuffix("/api")}
        return {**lines, "HARVEST_PREFECT_API_URLS": ",".join(urls)} if redis_url else lines

    return serve("harvest server", start)


def api_main(argv: list[str]) -> int:
    from fleet.settings import FleetSettings
    from harvest.settings import get_settings

    parser = argparse.ArgumentParser(prog="harvest api", description="One API replica.")
    parser.add_argument("--host", help="address to bind (default HARVEST_HOST, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default HARVEST_PORT, 8000)")
    args = parser.parse_args(argv[1:])
    settings = get_settings(FleetSettings)
    port = args.port or settings.port
    _prefect_api_url("harvest api", f"{socket.gethostname()}-api-{port}")

    def start() -> dict[str, str]:
        _, base = start_api_replica(_home(), args.host or settings.host, port, trusted_proxies=settings.trusted_proxies)
        return {"ACS_API_BASE": base}

    return serve("harvest api", start)


def worker_main(argv: list[str]) -> int:
    from harvest.placement import parse_gpus

    parser = argparse.ArgumentParser(prog="harvest worker", description="One worker host of a lane.")
    parser.add_argument("--lane", required=True, help="the lane (work pool) this host serves, e.g. small")
    parser.add_argument("--name", help="worker name in the Prefect UI (default <hostname>-<lane>-<pid>)")
    parser.add_argument("--health-port", type=int, help="port of the worker's /health on 127.0.0.1 (default a free one)")
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs this host gives the lane, e.g. 0,1,2,3 (default: all visible: "
                         "CUDA_VISIBLE_DEVICES, else nvidia-smi -L)")
    devices.add_argument("--slots", type=int, help="runs at once on a host without GPUs (default 1)")
    parser.add_argument("--gpus-per-run", type=int, help="GPUs in one run's slot (default: the lane's gpus_per_run)")
    parser.add_argument("--metrics-host", help="address of the host's /metrics (default HARVEST_METRICS_HOST, 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int, help="port of the host's /metrics (default HARVEST_METRICS_PORT, 9464, moved to a free one when taken; a port given here or in HARVEST_METRICS_PORT is never moved; 0: none)")
    args = parser.parse_args(argv[1:])
    from harvest.settings import get_settings

    settings = get_settings()
    metrics_port = settings.metrics_port if args.metrics_port is None else args.metrics_port
    # A port the operator named is kept (refused if taken); the default moves aside (fleet.metrics).
    chosen = args.metrics_port is not None or "metrics_port" in settings.model_fields_set
    name = args.name or f"{socket.gethostname()}-{args.lane}-{os.getpid()}"
    # The servers' order follows the host and lane, not the pid: a restarted role goes back to its own.
    api_url = _prefect_api_url("harvest worker", args.name or f"{socket.gethostname()}-{args.lane}")

    def start() -> list[str]:
        start_worker_host(_home(), args.lane, api_url, health_port=args.health_port, name=name,
                          gpus=parse_gpus(args.gpus), gpus_per_run=args.gpus_per_run, slots=args.slots,
                          metrics=(args.metrics_host or settings.metrics_host, metrics_port, chosen) if metrics_port else None)
        return [f"WORKER_READY lane={args.lane}"]

    def stop() -> None:
        from flows.placement import forget_host
        from harvest.warm.protocol import stop_engine_servers

        stop_engine_servers(_home())  # this host's warm engines go with its worker
        try:
            forget_host(args.lane, name, api_url)
        except Exception:  # the control plane may be gone first; an OFFLINE worker is not counted
            pass

    return serve("harvest worker", start, on_stop=stop)


def main(argv: list[str]) -> int:
    """`harvest server|api|worker …` (the CLI hands over the whole argv); a secret still holding
    the example's placeholder is refused before anything starts (`fleet.placeholders`)."""
    refuse_placeholder_secrets(f"harvest {argv[0]}")
    return {"server": server_main, "api": api_main, "worker": worker_main}[argv[0]](argv)
