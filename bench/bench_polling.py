"""Worker polling, both sides: what N polling hosts cost the Prefect server, per poll interval.

A `prefect worker` asks its pool for scheduled runs every `PREFECT_WORKER_QUERY_SECONDS`
(Prefect's default 10 s; the roles ship `fleet.processes.WORKER_QUERY_S`) and sends a heartbeat
every `PREFECT_WORKER_HEARTBEAT_SECONDS` (30 s). A run waits for the next poll of a free host:
on average half the interval, at worst all of it, on top of its own start and work. This
benchmark measures the other side: a Prefect server as shipped (`fleet.prefect_server`, SQLite
under its home), and N simulated worker hosts (1, 10, 50) making exactly those two calls on
an idle pool, for each poll interval Q. Over `--seconds` per point it reports the polls per
second the server answered, the server process's CPU (psutil, % of one core), the polls' p50
and p95 latency, and the p95 of what the API's watcher does meanwhile (one `read_flow_runs`
of 50 ids per 0.5 s), which is what a user's reads wait on.

`--submit` measures both sides at once, everything as shipped: `harvest up` (the embedded
default: Prefect on SQLite, its own worker polling at the shipped interval), and while N hosts
poll its Prefect server (the stack's worker plus N-1 simulated ones on the same pool, each at
the shipped `fleet.processes.WORKER_QUERY_S`), sequential 2-prompt `llama-tiny` jobs submitted
with `POST /v1/harvest` and long-polled to `done`, as `harvest-client` would (a 503 submit sent
again after its Retry-After). Per N it reports their submit-to-done (median, min, max), the
submits refused and jobs not done, the simulated polls per second the server answered and
refused (a refused call is counted and the host polls on, as a real worker does), the server's
CPU and the machine's load average (on a shared box absolute seconds mean little without it).

Run: `.venv/bin/python bench/bench_polling.py [--hosts 1,10,50] [--intervals 1,2,5,10] [--seconds 20]`
     `.venv/bin/python bench/bench_polling.py --submit [--hosts 1,10,50] [--jobs 7] [--postgres]`
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


async def _host(
    client, name: str, interval: float, stop: float, latencies: list[float], pool: str = POOL, errors: list[str] | None = None
) -> int:
    """One simulated worker host: a heartbeat, then a poll every `interval` (as `prefect worker`).
    With `errors`, a call the server refuses (a 503 when it is overloaded) is recorded there and
    the host goes on to its next poll, as a real worker does; without, it ends the benchmark."""
    from prefect.types._datetime import now

    polls = 0
    next_beat = 0.0
    # Hosts start spread over one interval, as real ones do.
    await asyncio.sleep(interval * (hash(name) % 1000) / 1000)
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                await client.send_worker_heartbeat(pool, name, heartbeat_interval_seconds=int(HEARTBEAT_S))
                started = time.perf_counter()
            await client.get_scheduled_flow_runs_for_work_pool(pool, scheduled_before=now("UTC"))
            latencies.append(time.perf_counter() - started)
            polls += 1
        except Exception as exc:
            if errors is None:
                raise
            errors.append(f"{type(exc).__name__}: {str(exc)[:80]}")
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


# --- submit-to-done under poll load (`--submit`) ---------------------------------------------


class SimulatedHosts:
    """`n` worker hosts polling `pool` every `interval` seconds (default: the shipped
    interval), in a thread of their own, until `stop()`; `.latencies` holds every poll's
    seconds, as they come."""

    def __init__(self, n: int, pool: str, api_url: str, auth: str, interval: float | None = None):
        import threading

        from fleet.processes import WORKER_QUERY_S

        self.n, self.pool, self.api_url, self.auth = n, pool, api_url, auth
        self.interval = WORKER_QUERY_S if interval is None else interval
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="simulated-hosts")

    def _run(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        async def hosts() -> None:
            self.loop = asyncio.get_running_loop()
            self.task = asyncio.current_task()
            self.ready.set()
            async with get_client() as client:
                far = time.monotonic() + 24 * 3600
                await asyncio.gather(*(_host(client, f"simulated-{uuid.uuid4().hex[:8]}", self.interval, far, self.latencies, self.pool, self.errors)
                                       for _ in range(self.n)))

        # Prefect's settings context is per thread: enter it in this one.
        with temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: self.auth}):
            try:
                asyncio.run(hosts())
            except asyncio.CancelledError:
                pass

    def start(self) -> "SimulatedHosts":
        if self.n:
            self.thread.start()
            self.ready.wait(60)
        return self

    def stop(self) -> None:
        if self.n:
            self.loop.call_soon_threadsafe(self.task.cancel)
            self.thread.join(60)


def _prefect_server(stack_pid: int):
    """The stack's Prefect server process (`fleet.prefect_server`) and its children (the CPU it spends)."""
    import psutil

    for proc in psutil.Process(stack_pid).children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "fleet.prefect_server" in cmdline:
            return [proc, *proc.children(recursive=True)]
    raise RuntimeError("no prefect server under the stack")


def _cpu_s(procs) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except Exception:  # a child that ended
            pass
    return total


def _one_job(base: str, key: str, n: int) -> tuple[float, int, str]:
    """Submit one 2-prompt job and long-poll it until it ends, as `harvest-client` does (a 503
    submit is sent again after its Retry-After); (seconds from the first submit to the end, how
    many submits were refused, the job's final status)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "llama-tiny", "prompts": [f"The sky is {n}", "Grass is"], "layers": [2, 4, 6]}
    started = time.perf_counter()
    refused = 0
    while (answer := httpx.post(f"{base}/harvest", json=body, headers=headers, timeout=120)).status_code == 503:
        refused += 1
        time.sleep(float(answer.headers.get("Retry-After", "5")))
    job = answer.raise_for_status().json()
    while job["status"] not in ("done", "failed", "cancelled"):
        job = httpx.get(f"{base}/harvest/{job['job_id']}", params={"wait": 30}, headers=headers, timeout=60).raise_for_status().json()
    return time.perf_counter() - started, refused, job["status"]


def submit_under_load(host_counts: list[int], jobs: int, postgres: bool = False) -> None:
    import json

    from bench.load_api import _drop_database, _prefect_database, _start_stack, _stop_stack
    from fleet.processes import WORKER_QUERY_S

    home = Path(tempfile.mkdtemp(prefix="bench-polling-submit-"))
    # Everything as shipped; the job store is the embedded default's own SQLite file, and so is
    # Prefect's unless `postgres` (the control plane's database in production).
    prefect_db, prefect_db_url = _prefect_database() if postgres else (None, None)
    proc, info = _start_stack(home, f"sqlite:///{home / 'harvest.db'}", prefect_db_url)
    rows = []
    try:
        base, key = info["ACS_API_BASE"], info["ACS_API_KEY"]
        api_url = json.loads((home / "stack.json").read_text())["prefect_api_url"]
        auth = (home / "prefect-auth").read_text().strip()
        server = _prefect_server(proc.pid)
        first = _one_job(base, key, -1)  # loads the model into the host's engine server
        print(f"   first job (loads the model): {first[0]:.2f} s, {first[2]}", flush=True)
        for hosts in host_counts:
            simulated = SimulatedHosts(hosts - 1, "small", api_url, auth).start()  # the stack's worker is one
            time.sleep(3.0)  # the simulated hosts spread over their interval
            load_before = os.getloadavg()[0]
            cpu_before, wall = _cpu_s(server), time.monotonic()
            polls_before = len(simulated.latencies)
            errors_before = len(simulated.errors)
            ran = [_one_job(base, key, n) for n in range(jobs)]
            wall = time.monotonic() - wall
            cpu = _cpu_s(server) - cpu_before
            polls = simulated.latencies[polls_before:]
            refused_polls = len(simulated.errors) - errors_before
            simulated.stop()
            times = [t for t, _, status in ran if status == "done"]
            load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
            rows.append([hosts, f"{len(polls) / wall:.1f}", refused_polls, f"{100 * cpu / wall:.0f}",
                         f"{1000 * _p(polls, 0.95):.0f}" if polls else "-",
                         f"{statistics.median(times):.2f}" if times else "-", f"{min(times):.2f}" if times else "-",
                         f"{max(times):.2f}" if times else "-", sum(r for _, r, _ in ran), jobs - len(times), load])
            print("  ", rows[-1], ", ".join(f"{t:.2f} {status}" for t, _, status in ran), simulated.errors[errors_before:][:3],
                  flush=True)
    finally:
        _stop_stack(proc)
        if prefect_db:
            _drop_database(prefect_db)
    database = "PostgreSQL" if postgres else "SQLite"
    print(f"\n`harvest up` as shipped (Prefect on {database}, worker poll {WORKER_QUERY_S:g} s), {jobs} sequential "
          "2-prompt llama-tiny jobs per row, submit (POST /v1/harvest) to done (long-poll); the stack's own worker "
          "is one of the hosts")
    header = ["hosts polling", "simulated polls/s", "polls refused", "server CPU %", "simulated poll p95 ms",
              "submit-to-done median s", "min s", "max s", "submits refused (503)", "jobs not done", "load avg 1 min"]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,10,50")
    parser.add_argument("--intervals", default="1,2,5,10")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--submit", action="store_true",
                        help="submit-to-done of small jobs on `harvest up` as shipped while --hosts hosts poll its server")
    parser.add_argument("--jobs", type=int, default=7, help="--submit: sequential jobs per host count")
    parser.add_argument("--postgres", action="store_true",
                        help="the server on a fresh PostgreSQL database at 127.0.0.1:5432 (production) instead of SQLite")
    args = parser.parse_args()
    if args.submit:
        submit_under_load([int(h) for h in args.hosts.split(",")], args.jobs, args.postgres)
        return

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
