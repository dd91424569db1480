"""Worker polling, both sides: what N polling hosts cost the Prefect server, per poll interval.

A `prefect worker` asks its pool for scheduled runs every `PREFECT_WORKER_QUERY_SECONDS`
(Prefect's default 10 s; the roles ship `fleet.processes.WORKER_QUERY_S`) and sends a heartbeat
every `PREFECT_WORKER_HEARTBEAT_SECONDS` (30 s). A run waits for the next poll of a free host:
on average half the interval, at worst all of it, on top of its own start and work. This
benchmark measures the other side: a Prefect server as shipped (`prefect server start`, SQLite
under its home), and N simulated worker hosts (1, 10, 50) making exactly those two calls on
an idle pool, for each poll interval Q. Over `--seconds` per point it reports the polls per
second the server answered, the server process's CPU (psutil, % of one core), the polls' p50
and p95 latency, and the p95 of what the API's watcher does meanwhile (one `read_flow_runs`
of 50 ids per 0.5 s), which is what a user's reads wait on.

The submit-to-done side is `bench/bench_warm.py --section latency` (shipped defaults: no
`PREFECT_*` overrides).

Run: `.venv/bin/python bench/bench_polling.py [--hosts 1,10,50] [--intervals 1,2,5,10] [--seconds 20]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEARTBEAT_S = 30.0
POOL = "bench-polling"


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _host(client, name: str, interval: float, stop: float, latencies: list[float]) -> int:
    """One simulated worker host: a heartbeat, then a poll every `interval` (as `prefect worker`)."""
    from prefect.types._datetime import now

    polls = 0
    next_beat = 0.0
    # Hosts start spread over one interval, as real ones do.
    await asyncio.sleep(interval * (hash(name) % 1000) / 1000)
    while time.monotonic() < stop:
        if time.monotonic() >= next_beat:
            await client.send_worker_heartbeat(POOL, name, heartbeat_interval_seconds=int(HEARTBEAT_S))
            next_beat = time.monotonic() + HEARTBEAT_S
        started = time.perf_counter()
        await client.get_scheduled_flow_runs_for_work_pool(POOL, scheduled_before=now("UTC"))
        latencies.append(time.perf_counter() - started)
        polls += 1
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
    return polls


async def _watcher(client, stop: float, latencies: list[float]) -> None:
    """What the API's watcher does each tick: read the active runs' states in one call."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    ids = [uuid.uuid4() for _ in range(50)]
    while time.monotonic() < stop:
        started = time.perf_counter()
        await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.5)


async def _point(hosts: int, interval: float, seconds: float, server_pid: int) -> list:
    import psutil
    from prefect.client.orchestration import get_client

    proc = psutil.Process(server_pid)
    procs = [proc, *proc.children(recursive=True)]
    polls: list[float] = []
    reads: list[float] = []
    async with get_client() as client:
        stop = time.monotonic() + seconds
        cpu_before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        wall = time.monotonic()
        counts = await asyncio.gather(
            *(_host(client, f"host-{hosts}-{interval}-{i}", interval, stop, polls) for i in range(hosts)),
            _watcher(client, stop, reads),
        )
        wall = time.monotonic() - wall
        cpu = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - cpu_before
    n = sum(c for c in counts if c)
    return [hosts, f"{interval:g}", f"{n / wall:.1f}", f"{100 * cpu / wall:.0f}", f"{1000 * statistics.median(polls):.1f}",
            f"{1000 * _p(polls, 0.95):.1f}", f"{1000 * _p(reads, 0.95):.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,10,50")
    parser.add_argument("--intervals", default="1,2,5,10")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--postgres", action="store_true",
                        help="the server on a fresh PostgreSQL database at 127.0.0.1:5432 (production) instead of SQLite")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="bench-polling-"))
    os.environ["HARVEST_HOME"] = str(home)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from fleet.processes import free_port, start_server

    server_env = {"HARVEST_HOME": str(home)}
    database = "SQLite, as shipped"
    if args.postgres:
        import psycopg

        name = f"bench_polling_{uuid.uuid4().hex[:8]}"
        with psycopg.connect("host=127.0.0.1 port=5432 dbname=postgres user=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
        database = "PostgreSQL"
    server, api_url = start_server(home / "prefect", free_port(), server_env, 120)
    rows = []
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
            for hosts in (int(h) for h in args.hosts.split(",")):
                for interval in (float(q) for q in args.intervals.split(",")):
                    row = asyncio.run(_point(hosts, interval, args.seconds, server.pid))
                    print("  ", row, flush=True)
                    rows.append(row)
    finally:
        server.stop()
    print(f"\nPrefect server ({database}), idle pool, {args.seconds:g} s per point; "
          "a run waits on average half the poll interval for a host to ask for it")
    header = ["hosts", "poll s", "polls/s", "server CPU %", "poll p50 ms", "poll p95 ms", "watcher read p95 ms"]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
