"""The scaled control plane, as Prefect's guide "How to scale self-hosted Prefect" draws it:
several Prefect API server processes, Prefect's background services in a process of their
own, all on one PostgreSQL database and one Redis (through `prefect-redis`).

    process                    what it is
    Prefect API server × N     the REST API and UI (`fleet.prefect_server --no-services`):
                               holds nothing between calls, so any server answers any client;
                               the workers' polls, the runs' state writes and the API
                               replicas' calls spread over them
    Prefect services × 1       the loops that act on their own: the scheduler, late runs,
                               automations (event triggers and actions), cancellation
                               clean-up, the event persister... (`prefect server services
                               start`); one per fleet is enough, more can run through Redis
    PostgreSQL                 Prefect's objects: flow runs, deployments, pools, events
    Redis                      what the processes share besides: the event bus and its cache,
                               events' causal ordering, concurrency-slot leases, and the docket
                               (the servers' background tasks), `redis_env`

Why: one server answered 4-7 worker polls a second on a loaded box, and with 50 hosts polling
every second refused calls (bench/RESULTS.md, "Worker polling"); the services' loops shared
that one process's event loop with every call. SQLite cannot be shared by processes on several
hosts, and Prefect keeps its messaging in memory unless told otherwise: a scaled control
plane without PostgreSQL and Redis is refused before anything starts (`check_scaled`).

The first API server starts alone (it migrates the database and registers block types); the
others then start together, told not to. `harvest server --api-servers N --redis-url URL`
runs all of it on one host (`start_scaled`); the compose recipe runs each server and the
services in containers of their own (`harvest server --no-services` × N, and `harvest server
--api-servers 0`, which runs the services and applies the control plane's objects).
The clients spread over the servers with a server list (`fleet.prefect_endpoints`) or a load
balancer. The one-box default (`harvest up`, `make run`) stays one process on SQLite.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse

from fleet.processes import Managed, start_server
from harvest.addresses import local_address

__all__ = ["REDIS_MODULES", "redis_env", "check_scaled", "check_redis", "start_api_servers", "start_services",
           "prefect_database_url"]

REDIS_MODULES = {
    "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
    "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
    "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
}
"""Prefect's settings that move its shared state from one process's memory to Redis."""


def redis_env(url: str) -> dict[str, str]:
    """The environment of every process of a scaled control plane (API servers and services):
    `REDIS_MODULES`, prefect-redis's connection (PREFECT_REDIS_MESSAGING_URL) and the docket's
    (PREFECT_SERVER_DOCKET_URL), both `url`."""
    return {**REDIS_MODULES, "PREFECT_REDIS_MESSAGING_URL": url, "PREFECT_SERVER_DOCKET_URL": url}


def prefect_database_url(environ: dict[str, str]) -> str:
    """Prefect's database URL as its server reads it ('' when unset: SQLite under PREFECT_HOME)."""
    return environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or ""


def check_scaled(prog: str, database: str, redis_url: str, api_servers: int, services: bool) -> None:
    """Refuse, naming the settings, a control plane whose processes could not share their
    state: more than one API server, none (the services alone), the services apart or Redis
    given at all each need PostgreSQL and Redis. One server with its services inside, on
    SQLite or PostgreSQL, is the default and passes."""
    if api_servers < 0:
        raise SystemExit(f"{prog}: --api-servers must be 0 or more, not {api_servers}")
    if api_servers == 0 and not services:
        raise SystemExit(f"{prog}: --api-servers 0 with --no-services leaves nothing to run")
    if api_servers == 1 and services and not redis_url:
        return
    shape = (f"{api_servers} Prefect API servers" if api_servers != 1 else "one Prefect API server") + (
        "" if services else " without the services") + (" and the services apart" if services else "")
    problems = []
    dialect = database.partition(":")[0]
    if not dialect.startswith("postgresql"):
        problems.append("PostgreSQL: set PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://USER:PASSWORD@HOST:5432/DB "
                        f"({'SQLite under PREFECT_HOME, the default,' if not database else dialect} is one process's database)")
    if not redis_url:
        problems.append("Redis, which the processes share (events, leases, background tasks): give --redis-url or "
                        "HARVEST_REDIS_URL, e.g. redis://127.0.0.1:6379/0")
    elif urlparse(redis_url).scheme not in ("redis", "rediss", "unix"):
        problems.append(f"a Redis URL: {_safe(redis_url)!r} is not one (redis://HOST:6379/DB, rediss://… for TLS)")
    if problems:
        raise SystemExit(f"{prog}: a scaled control plane ({shape}) needs " + "; and ".join(problems))


def check_redis(prog: str, url: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the URL, when Redis does not answer a PING (else every Prefect process
    would start, then crash-loop on its first event)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise SystemExit(f"{prog}: Redis at {_safe(url)} does not answer ({type(exc).__name__}: {exc}); start it, or "
                         "fix --redis-url / HARVEST_REDIS_URL") from None


def _safe(url: str) -> str:
    """`url` without its password (for messages and logs)."""
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@", 1)
    return url


def start_api_servers(
    home: Path, host: str, ports: list[int], env: dict[str, str], timeout: float = 90, *, advertise: str | None = None,
    migrate: bool = True,
) -> tuple[list[Managed], list[str]]:
    """The API servers of a scaled control plane on `ports` (services off: `start_services`
    runs them), each with its PREFECT_HOME under `home`, all started at once; returns them and
    their API URLs once each answers. With `migrate`, the first migrates the database (and
    registers block types) and the others, told not to, serve only once it answers
    (`fleet.prefect_server --after`): Prefect's migrations take no lock, so two at once could
    collide, but the others' imports overlap them."""
    from concurrent.futures import ThreadPoolExecutor

    first = f"http://{local_address(host)}:{ports[0]}/api/health" if migrate and ports else None

    def one(port: int) -> tuple[Managed, str]:
        migrates = first is not None and port == ports[0]
        extra = {} if migrates else {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false", "PREFECT_API_BLOCKS_REGISTER_ON_START": "false"}
        return start_server(home / f"prefect-api-{port}", port, {**env, **extra}, timeout, host=host, advertise=advertise,
                            services=False, after=None if migrates else first)

    if not ports:
        return [], []
    with ThreadPoolExecutor(len(ports)) as pool:
        started = list(pool.map(one, ports))
    return [server for server, _ in started], [url for _, url in started]


SERVICES_READY = "Starting services"
"""What `prefect server services start` prints once its loops are set up."""


def start_services(home: Path, env: dict[str, str], timeout: float = 60) -> Managed:
    """Prefect's background services in one process (`prefect server services start`), on the
    database and Redis of `env`; returns once it says it started them."""
    from fleet.processes import SERVER_NEEDS, prefect_argv
    from harvest.credentials import handed

    home.mkdir(parents=True, exist_ok=True)
    env = {**handed({**os.environ, **env}, SERVER_NEEDS), "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the services talk to the database, not to a server
    services = Managed("prefect-services", [*prefect_argv(), "server", "services", "start"], env, home / "services.log", cwd=str(home))
    deadline = time.monotonic() + timeout
    while SERVICES_READY not in services.tail():
        services.check_running()
        if time.monotonic() > deadline:
            services.stop()
            raise TimeoutError(f"Prefect's services did not start within {timeout:.0f} s:\n{services.tail()}")
        time.sleep(0.2)
    return services
