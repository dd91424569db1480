"""How the control plane's cost grows with active jobs and hosts.

The API's watcher (`api.watcher`) used to read, once per tick, every active job from the job
store, every one's Prefect run state (`api.runs.PrefectRuns.read`, pages of 200 ids), and list
each running job's `_parts/` in storage for progress. Since issue 45 a tick reads the runs
Prefect's events named plus one page (`HARVEST_WATCH_PAGE`, 200) of the active jobs, and lists
no folder for progress (the runs report it on themselves): a `watcher.tick()` here, with no
event named, is one interval's pass, one page. This benchmark builds that load for real:

- a Prefect server as shipped (`prefect server start`, SQLite), the project's pools and
  deployments applied (`flows.deploy`), and NO worker: every job's flow run waits on its pool,
  the cheapest active job to make; then each run is forced to Running (no process behind it),
  so the watcher also counts its shards, as for a job that runs;
- the job store (SQLite under the bench's HARVEST_HOME, the embedded default) with one row per
  job, owned by one API key;
- one real API replica (uvicorn on loopback) whose own watcher is idled, and the bench's
  watcher (`api.watcher.Watcher`, the same class) ticking at the shipped interval in its place;
- H simulated worker hosts polling the pool as `prefect worker` does (shipped 1 s, heartbeat
  30 s; `bench/bench_polling.py`).

For N = 10, 100, 1,000 active jobs (added cumulatively) and each H it reports: the watcher's
tick time (median of `--ticks`), Prefect reads per tick (HTTP calls of `read_flow_runs`),
storage calls per tick (fsspec calls), the p95 of `GET /v1/harvest/{id}` over real HTTP while
the watcher ticks, and the job store's rows and bytes per job (SQLite pages in use).

Run: `.venv/bin/python bench/bench_control_plane.py [--jobs 10,100,1000] [--hosts 1,10] [--ticks 5] [--seconds 6]`
(~12 min on the 2-core CI box under load, most of it making the 1,000 runs; `--jobs 10,100` takes ~2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

POOL = "small"  # the lane the jobs wait on (no worker polls it but the simulated hosts)
POLL_S = 1.0  # a worker's poll as shipped when this bench was written (now `fleet.processes.WORKER_QUERY_S`, 5 s)
HEARTBEAT_S = 30.0


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CountingFS:
    """An fsspec filesystem that counts the calls made on it (each one a storage request on S3)."""

    def __init__(self, fs):
        self._fs = fs
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        value = getattr(self._fs, name)
        if callable(value) and not name.startswith("_"):
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return value(*args, **kwargs)

            return counted
        return value


def _count_prefect_reads() -> Counter:
    """Count `read_flow_runs` HTTP calls made by the sync client (what `PrefectRuns.read` uses)."""
    from prefect.client.orchestration import SyncPrefectClient

    counts: Counter = Counter()
    original = SyncPrefectClient.read_flow_runs

    def read_flow_runs(self, *args, **kwargs):
        counts["read_flow_runs"] += 1
        return original(self, *args, **kwargs)

    SyncPrefectClient.read_flow_runs = read_flow_runs
    return counts


def _count_transactions(engine) -> Counter:
    """Count the job store's transactions (each a BEGIN IMMEDIATE on SQLite: the write lock)."""
    from sqlalchemy import event

    counts: Counter = Counter()
    event.listen(engine, "begin", lambda conn: counts.update(["begin"]))
    return counts


def _insert_jobs(engine, key_id: str, home: Path, n: int) -> list[str]:
    """n job rows as an admission leaves them (pending, no run yet)."""
    from sqlalchemy import insert

    from api.db import jobs, transaction, utcnow

    ids = [str(uuid.uuid4()) for _ in range(n)]
    rows = [
        {
            "id": job_id, "key_id": key_id, "model": "llama-tiny", "lane": POOL, "status": "pending", "n_prompts": 2,
            "layers": [1, 3], "shard_size": 32, "n_shards": 1, "shards_done": 0, "add_special_tokens": True,
            "contents": "residuals", "reserved_tokens": 24, "tokens": None, "created_at": utcnow(), "started_at": None,
            "completed_at": None, "error": None, "request_url": f"file://{home}/storage/jobs/{job_id}/request.json",
            "flow_run_id": None, "restarts": 0, "result": None, "stop_run": False,
        }
        for job_id in ids
    ]
    with transaction(engine) as conn:
        conn.execute(insert(jobs), rows)
    return ids


def _start_runs(engine, ids: list[str], key_id: str, home: Path) -> list[str]:
    """Each job's flow run, started as the API starts it; then forced to Running (no process)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from api.runs import PrefectRuns
    from api.store import attach_run
    from harvest.settings import get_settings

    runs = PrefectRuns(get_settings())

    def start(job_id: str) -> str:
        from flows.submit import RunStartTimeout

        for attempt in range(5):  # a busy box may pass the start bound; a start is idempotent per job
            try:
                run_id = runs.start(job_id, f"file://{home}/storage/jobs/{job_id}/request.json", "llama-tiny", POOL, key_id)
                break
            except RunStartTimeout:
                if attempt == 4:
                    raise
        attach_run(job_id, run_id, engine)
        return run_id

    with ThreadPoolExecutor(4) as pool:  # each thread in this context: Prefect's settings live in it
        contexts = [contextvars.copy_context() for _ in ids]
        run_ids = list(pool.map(lambda context, job_id: context.run(start, job_id), contexts, ids))

    async def force_running() -> None:
        async with get_client() as client:
            gate = asyncio.Semaphore(8)

            async def one(run_id: str) -> None:
                async with gate:
                    await client.set_flow_run_state(run_id, Running(), force=True)

            await asyncio.gather(*(one(r) for r in run_ids))

    asyncio.run(force_running())
    return run_ids


def _hosts(n: int, stop: threading.Event) -> threading.Thread:
    """n simulated worker hosts polling the pool (as `bench/bench_polling.py`), in one thread."""

    async def host(client, name: str) -> None:
        from prefect.types._datetime import now

        await asyncio.sleep(POLL_S * (hash(name) % 1000) / 1000)
        next_beat = 0.0
        while not stop.is_set():
            if time.monotonic() >= next_beat:
                await client.send_worker_heartbeat(POOL, name, heartbeat_interval_seconds=int(HEARTBEAT_S))
                next_beat = time.monotonic() + HEARTBEAT_S
            started = time.perf_counter()
            await client.get_scheduled_flow_runs_for_work_pool(POOL, scheduled_before=now("UTC"))
            await asyncio.sleep(max(0.0, POLL_S - (time.perf_counter() - started)))

    async def all_hosts() -> None:
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            await asyncio.gather(*(host(client, f"bench-host-{i}") for i in range(n)))

    context = contextvars.copy_context()  # Prefect's settings (the bench's server) live in it
    thread = threading.Thread(target=lambda: context.run(asyncio.run, all_hosts()), daemon=True)
    thread.start()
    return thread


def _store_size(engine) -> tuple[int, int]:
    """(rows in every table, bytes in use) of the job store (SQLite pages minus the free list)."""
    from sqlalchemy import inspect, text

    with engine.connect() as conn:
        rows = sum(conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in inspect(engine).get_table_names())
        pages = conn.execute(text("PRAGMA page_count")).scalar_one() - conn.execute(text("PRAGMA freelist_count")).scalar_one()
        size = conn.execute(text("PRAGMA page_size")).scalar_one()
    return rows, pages * size


def _point(watcher, fs: CountingFS, reads: Counter, txns: Counter, base: str, key: str, job_ids: list[str], hosts: int, ticks: int, seconds: float) -> dict:
    """Tick the watcher `ticks` times and read jobs over HTTP for `seconds`, with `hosts` polling."""
    import httpx

    stop = threading.Event()
    poller = _hosts(hosts, stop)
    time.sleep(1.5)  # the hosts' first heartbeats and polls
    watcher.tick()  # warm-up: records the forced Running states once
    tick_s, prefect_reads, storage_calls, store_txns = [], [], [], []
    kinds_before = Counter(fs.calls)
    for _ in range(ticks):
        before_reads, before_fs, before_txns = reads["read_flow_runs"], sum(fs.calls.values()), txns["begin"]
        started = time.perf_counter()
        watcher.tick()
        tick_s.append(time.perf_counter() - started)
        prefect_reads.append(reads["read_flow_runs"] - before_reads)
        storage_calls.append(sum(fs.calls.values()) - before_fs)
        store_txns.append(txns["begin"] - before_txns)
        time.sleep(max(0.0, 1.0 - tick_s[-1]))  # the shipped watch interval, 1 s
    # API reads while the watcher keeps ticking at its interval.
    ticking = threading.Event()

    def keep_ticking() -> None:
        while not ticking.is_set():
            started = time.perf_counter()
            watcher.tick()
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))

    ticker = threading.Thread(target=contextvars.copy_context().run, args=(keep_ticking,), daemon=True)
    ticker.start()
    latencies: list[float] = []
    errors = 0
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            started = time.perf_counter()
            answer = client.get(f"/harvest/{job_ids[i % len(job_ids)]}")
            latencies.append(time.perf_counter() - started)
            errors += answer.status_code != 200
            i += 1
            time.sleep(0.05)
    ticking.set()
    ticker.join()
    stop.set()
    poller.join(timeout=10)
    return {
        "tick_s": statistics.median(tick_s), "prefect_reads": statistics.median(prefect_reads),
        "storage_calls": statistics.median(storage_calls), "store_txns": statistics.median(store_txns), "read_p95_s": _p(latencies, 0.95), "reads": len(latencies),
        "read_errors": errors, "storage_by_call": dict(fs.calls - kinds_before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="10,100,1000", help="active jobs, cumulative")
    parser.add_argument("--hosts", default="1,10", help="simulated worker hosts polling the pool")
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0, help="API read sampling per point")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    os.environ.update(HARVEST_HOME=str(home), PREFECT_LOGGING_LEVEL="WARNING")
    (home / "logs").mkdir()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from api.auth import create_key
    from api.db import JobStore
    from api.runs import PrefectRuns
    from api.settings import ApiSettings
    from api.watcher import Watcher
    from flows.deploy import apply_sync
    from fleet.processes import RUN_COMMAND, free_port, start_server
    from fleet.roles import start_api_replica
    from harvest.lanes import load_lanes
    from harvest.settings import get_settings
    from harvest.storage import Storage, open_storage

    reads = _count_prefect_reads()
    server, api_url = start_server(home / "prefect", free_port(), {"HARVEST_HOME": str(home)}, 120)
    os.environ["PREFECT_API_URL"] = api_url
    api = None
    rows_out = []
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            apply_sync(load_lanes(get_settings()), run_command=RUN_COMMAND)
            # The store the replica opens too (the bench's HARVEST_HOME), migrated before it starts.
            store = JobStore.from_settings(get_settings(ApiSettings)).migrate()
            key, record = create_key("bench", small=100_000, rate_read_per_s=1000.0, rate_read_burst=1000,
                                     engine=store.db)
            # The replica's own watcher idles; the bench's watcher ticks in its place.
            api, base = start_api_replica(home, "127.0.0.1", free_port(), env={"HARVEST_WATCH_INTERVAL_S": "3600"})
            root = open_storage(get_settings())
            fs = CountingFS(root.fs)
            watcher = Watcher(PrefectRuns(get_settings()), Storage(root.url, fs, root.root), store, interval=1.0, max_waiters=100, lease=None)
            rows0, bytes0 = _store_size(store.db)
            txns = _count_transactions(store.db)
            job_ids: list[str] = []
            for target in (int(n) for n in args.jobs.split(",")):
                started = time.monotonic()
                new = _insert_jobs(store.db, record.id, home, target - len(job_ids))
                _start_runs(store.db, new, record.id, home)
                job_ids += new
                print(f"{target} active jobs made in {time.monotonic() - started:.1f} s", flush=True)
                rows, size = _store_size(store.db)
                for hosts in (int(h) for h in args.hosts.split(",")):
                    point = _point(watcher, fs, reads, txns, base, key, job_ids, hosts, args.ticks, args.seconds)
                    row = {"jobs": target, "hosts": hosts, **point,
                           "rows_per_job": (rows - rows0) / target, "bytes_per_job": (size - bytes0) / target}
                    print("  ", json.dumps(row), flush=True)
                    rows_out.append(row)
    finally:
        if api is not None:
            api.stop()
        server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=2))
    print("\nPrefect server (SQLite, as shipped), job store SQLite; every active job's run Running, no worker")
    header = ["active jobs", "hosts", "tick ms", "Prefect reads/tick", "storage calls/tick", "store transactions/tick", "API read p95 ms",
              "store rows/job", "store bytes/job"]
    print("| " + " | ".join(header) + " |")
    print("|---:|" + "---:|" * (len(header) - 1))
    for r in rows_out:
        print(f"| {r['jobs']} | {r['hosts']} | {1000 * r['tick_s']:.0f} | {r['prefect_reads']:g} | {r['storage_calls']:g} | {r['store_txns']:g} | "
              f"{1000 * r['read_p95_s']:.0f} | {r['rows_per_job']:.2f} | {r['bytes_per_job']:.0f} |")


if __name__ == "__main__":
    main()
