"""Load on the API: 50 concurrent clients for 60 s mixing submits, long-polls, reads of done
jobs and file downloads, against a whole `harvest up` stack on loopback whose job store is
PostgreSQL (a fresh schema in the `test` database at 127.0.0.1:5432, dropped at the end).

Bounded and self-stopping: the clients stop at `--seconds`; jobs still active `--drain` s
later are cancelled; the stack is stopped (SIGTERM to its process group) and the schema
dropped whatever happens. Nothing leaves 127.0.0.1.

What it prints: per route, requests, p50/p95/max latency, 5xx and 429 counts; long-polls
declined over the waiter limit (answered 200 with `X-Acs-Longpoll: declined`); and the jobs'
accounting against the charge ledger (SQL): every admitted job ended, exactly one ledger row
each, outcome = job status, a done job charged its manifest's token count (summed from the
manifest's per-shard counts), failed 0, cancelled 0 or its reservation. It exits 1
on any server error, lost job or wrong charge.

    .venv/bin/python bench/load_api.py [--clients 50] [--seconds 60] [--keys 10] [--waiters 8]

Request-rate limits are raised for the run (`HARVEST_RATE_*`): the point is the server under
load, not one key's bucket; the per-key job caps (small 3) and the waiter limit stay in force.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TERMINAL = ("done", "failed", "cancelled")


def _pg_schema() -> tuple[str, str]:
    import psycopg

    schema = f"harvest_load_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("host=127.0.0.1 port=5432 dbname=test user=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return schema, f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"


def _drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect("host=127.0.0.1 port=5432 dbname=test user=postgres", autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _prefect_database() -> tuple[str, str]:
    """A fresh PostgreSQL database for Prefect's server (production runs it on PostgreSQL)."""
    import psycopg

    name = f"prefect_load_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("host=127.0.0.1 port=5432 dbname=postgres user=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


def _drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect("host=127.0.0.1 port=5432 dbname=postgres user=postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start_stack(home: Path, db_url: str, prefect_db_url: str | None, **settings: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """`harvest up` in its own session on a fresh home and job store, as shipped but for
    `settings` (what a benchmark measures), read until it prints its addresses."""
    from fleet.processes import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "HARVEST_"))}
    # Where it lives and listens, nothing else: the engine, Prefect's log levels (a run's INFO
    # lines are API writes too) and the rest as `make run` has them.
    env.update(
        HARVEST_HOME=str(home), PREFECT_HOME=str(home / "prefect"), HARVEST_DATABASE_URL=db_url,
        HARVEST_PORT=str(free_port()), HARVEST_PREFECT_PORT=str(free_port()),
        **settings,
    )
    if prefect_db_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = prefect_db_url
    log = open(home / "up.log", "w")
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "harvest"), "up"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True)
    info: dict[str, str] = {}
    deadline = time.monotonic() + 300
    while "PREFECT_UI" not in info:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"harvest up exited {proc.poll()}: see {home / 'up.log'}")
        name, _, value = line.strip().partition("=")
        info[name] = value
        if time.monotonic() > deadline:
            raise RuntimeError("harvest up was not ready in 300 s")
    return proc, info


def _stop_stack(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


class Load:
    """The clients' shared record: latencies per route, statuses, jobs admitted per key."""

    def __init__(self, base: str, keys: list[str]):
        self.base = base
        self.keys = keys
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.statuses: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.declined = 0
        self.admitted: dict[str, str] = {}  # job id -> key
        self.done: dict[str, list[str]] = defaultdict(list)  # key -> done job ids
        self.links: list[str] = []
        self.failures: list[str] = []
        self.overloaded: dict[str, int] = defaultdict(int)  # documented 503 + Retry-After, by code

    def record(self, route: str, answer: httpx.Response, seconds: float) -> None:
        self.latency[route].append(seconds)
        self.statuses[route][answer.status_code] += 1
        if answer.status_code == 503 and "retry-after" in answer.headers:
            # The documented overload answer (a busy replica, a run start past its bound): the
            # client is told when to come back and nothing was charged; the ledger checks that.
            self.overloaded[_error_code(answer)] += 1
        elif answer.status_code >= 500:
            self.failures.append(f"{route}: {answer.status_code} {answer.text[:200]}")

    async def call(self, client: httpx.AsyncClient, route: str, method: str, url: str, **kwargs) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            answer = await client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:  # no answer at all counts as a server failure
            self.statuses[route][0] += 1
            self.failures.append(f"{route}: {type(exc).__name__} {exc}")
            return None
        self.record(route, answer, time.perf_counter() - started)
        return answer

    def remember_done(self, key: str, body: dict) -> None:
        if body.get("status") == "done" and body.get("result") and body["result"].get("shard_urls"):
            if body["job_id"] not in self.done[key]:
                self.done[key].append(body["job_id"])
            self.links.extend([body["result"]["manifest_url"], body["result"]["shard_urls"][0]])
            del self.links[:-200]


async def _client(load: Load, n: int, stop_at: float) -> None:
    key = load.keys[n % len(load.keys)]
    auth = {"Authorization": f"Bearer {key}"}
    rng = random.Random(n)
    mine: list[str] = []  # this client's jobs not yet seen ended
    async with httpx.AsyncClient(headers=auth, timeout=90) as client:
        while time.monotonic() < stop_at:
            action = rng.choices(("submit", "longpoll", "read", "download"), weights=(15, 25, 35, 25))[0]
            if action == "submit" or (action == "longpoll" and not mine):
                body = {"model": "llama-tiny", "prompts": [f"load {n} {rng.random():.6f}", "and one more"], "layers": [2, 5]}
                answer = await load.call(client, "POST /v1/harvest", "POST", f"{load.base}/harvest", json=body)
                if answer is not None and answer.status_code == 202:
                    job_id = answer.json()["job_id"]
                    load.admitted[job_id] = key
                    mine.append(job_id)
            elif action == "longpoll":
                job_id = rng.choice(mine)
                wait = rng.choice((2, 5, 10))
                answer = await load.call(client, "GET /v1/harvest/{id}?wait=N", "GET", f"{load.base}/harvest/{job_id}",
                                         params={"wait": wait})
                if answer is not None and answer.status_code == 200:
                    if answer.headers.get("X-Acs-Longpoll") == "declined":
                        load.declined += 1
                        assert answer.headers.get("Retry-After") == "3"
                        await asyncio.sleep(rng.uniform(0.2, 1.0))  # a polite client backs off (less than Retry-After, to press)
                    body = answer.json()
                    if body["status"] in TERMINAL:
                        mine.remove(job_id)
                        load.remember_done(key, body)
            elif action == "read":
                done = load.done[key]
                if not done:
                    await asyncio.sleep(0.2)
                    continue
                answer = await load.call(client, "GET /v1/harvest/{id} (done)", "GET", f"{load.base}/harvest/{rng.choice(done)}")
                if answer is not None and answer.status_code == 200:
                    load.remember_done(key, answer.json())
            else:
                if not load.links:
                    await asyncio.sleep(0.2)
                    continue
                await load.call(client, "GET file link", "GET", rng.choice(load.links), headers={"Authorization": ""})


async def _wait_done(base: str, key: str, job_id: str, timeout: float) -> dict:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=90) as client:
        deadline = time.monotonic() + timeout
        while True:
            answer = await client.get(f"{base}/harvest/{job_id}", params={"wait": 20})
            if answer.status_code == 429:  # the key's reads in flight on this replica: as a client does
                await asyncio.sleep(float(answer.headers.get("Retry-After", 1)))
                continue
            body = answer.json()
            if body["status"] in TERMINAL or time.monotonic() > deadline:
                return body


def _seed(base: str, keys: list[str], load: Load) -> None:
    """One done job per key before the clock starts, so reads and downloads have targets."""
    async def seed_all():
        jobs = []
        async with httpx.AsyncClient(timeout=90) as client:
            for key in keys:
                answer = await client.post(f"{base}/harvest", headers={"Authorization": f"Bearer {key}"},
                                           json={"model": "llama-tiny", "prompts": ["seed prompt"], "layers": [2, 5]})
                assert answer.status_code == 202, answer.text
                load.admitted[answer.json()["job_id"]] = key
                jobs.append((key, answer.json()["job_id"]))
        bodies = await asyncio.gather(*(_wait_done(base, key, job_id, 300) for key, job_id in jobs))
        for (key, _), body in zip(jobs, bodies):
            assert body["status"] == "done", body
            load.remember_done(key, body)

    asyncio.run(seed_all())


def _stored_jobs(db_url: str, key_by_id: dict[str, str]) -> dict[str, str]:
    """Every job in the job store (job id -> its key), whether or not its client heard a 202."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, key_id FROM jobs")).all()
    engine.dispose()
    return {job_id: key_by_id[key_id] for job_id, key_id in rows}


def _drain(base: str, jobs: dict[str, str], seconds: float) -> dict[str, dict]:
    """Every stored job to an end: wait `seconds`, then cancel what is still active."""
    async def drain_all():
        bodies = await asyncio.gather(*(_wait_done(base, key, job_id, seconds) for job_id, key in jobs.items()))
        ended = {b["job_id"]: b for b in bodies}
        async with httpx.AsyncClient(timeout=90) as client:
            for job_id, body in list(ended.items()):
                if body["status"] not in TERMINAL:
                    key = jobs[job_id]
                    answer = await client.delete(f"{base}/harvest/{job_id}", headers={"Authorization": f"Bearer {key}"})
                    ended[job_id] = answer.json() if answer.status_code == 200 else (await _wait_done(base, key, job_id, 60))
        return ended

    return asyncio.run(drain_all())


def _check_ledger(db_url: str, home: Path, ended: dict[str, dict]) -> list[str]:
    """Every admitted job: one ledger row, outcome = status, the right tokens."""
    from sqlalchemy import create_engine, text

    problems = []
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT job_id, outcome, tokens_charged FROM charge_ledger")).all()
        reserved = dict(conn.execute(text("SELECT id, reserved_tokens FROM jobs")).all())
    engine.dispose()
    ledger = defaultdict(list)
    for job_id, outcome, tokens in rows:
        ledger[job_id].append((outcome, tokens))
    for job_id, body in ended.items():
        charges = ledger.get(job_id, [])
        if body["status"] not in TERMINAL:
            problems.append(f"{job_id}: still {body['status']}")
            continue
        if len(charges) != 1:
            problems.append(f"{job_id}: {len(charges)} ledger rows")
            continue
        outcome, tokens = charges[0]
        if outcome != body["status"]:
            problems.append(f"{job_id}: ledger says {outcome}, job {body['status']}")
        if body["status"] == "done":
            manifest = json.loads((home / "storage" / "jobs" / job_id / "manifest.json").read_text())
            expected = {sum(sum(s["token_counts"]) for s in manifest["shards"])}
        elif body["status"] == "failed":
            expected = {0}
        else:
            expected = {0, reserved[job_id]}
        if tokens not in expected:
            problems.append(f"{job_id}: charged {tokens}, expected {sorted(expected)}")
    unknown = set(ledger) - set(ended)
    if unknown:
        problems.append(f"ledger rows for jobs not in the job store: {sorted(unknown)[:5]}")
    return problems


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--waiters", type=int, default=8, help="the API's long-poll waiter limit for the run")
    parser.add_argument("--drain", type=float, default=240, help="seconds for admitted jobs to end before they are cancelled")
    parser.add_argument("--prefect-db", choices=("postgresql", "sqlite"), default="postgresql",
                        help="Prefect server's database: PostgreSQL as in production, or harvest up's embedded SQLite")
    args = parser.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="harvest-load-"))
    schema, db_url = _pg_schema()
    prefect_db, prefect_url = _prefect_database() if args.prefect_db == "postgresql" else (None, None)
    proc = None
    try:
        started = time.monotonic()
        proc, info = _start_stack(
            home, db_url, prefect_url, HARVEST_LONGPOLL_MAX_WAITERS=str(args.waiters),
            # The point is the server under load, not one key's bucket: request rates raised.
            HARVEST_RATE_SUBMIT_PER_S="1000", HARVEST_RATE_SUBMIT_BURST="1000",
            HARVEST_RATE_READ_PER_S="10000", HARVEST_RATE_READ_BURST="10000",
        )
        print(f"stack ready in {time.monotonic() - started:.0f} s: {info['ACS_API_BASE']}", flush=True)
        from api.auth import create_key
        from api.db import make_engine

        engine = make_engine(db_url)
        made = [create_key(f"load-{i}", engine=engine, small=3) for i in range(args.keys)]
        engine.dispose()
        keys = [key for key, _ in made]
        key_by_id = {record.id: key for key, record in made}
        load = Load(info["ACS_API_BASE"], keys)
        _seed(load.base, keys, load)
        print(f"seeded {len(load.admitted)} done jobs; {args.clients} clients for {args.seconds:.0f} s", flush=True)

        async def run_clients():
            stop_at = time.monotonic() + args.seconds
            await asyncio.gather(*(_client(load, n, stop_at) for n in range(args.clients)))

        clock = time.monotonic()
        asyncio.run(run_clients())
        load_s = time.monotonic() - clock
        stored = _stored_jobs(db_url, key_by_id)
        unanswered = sorted(set(stored) - set(load.admitted))  # admitted, but the client got no 202 (timeout)
        missing = sorted(set(load.admitted) - set(stored))  # answered 202, not in the store: lost
        ended = _drain(load.base, stored, args.drain)
        problems = _check_ledger(db_url, home, ended) + [f"{j}: answered 202, not in the job store" for j in missing]

        total = sum(len(v) for v in load.latency.values())
        print(f"\nPrefect server on {args.prefect_db}; {total} requests in {load_s:.1f} s ({total / load_s:.0f}/s), {args.clients} clients, {args.keys} keys, "
              f"waiter limit {args.waiters}\n")
        print("| route | requests | p50 ms | p95 ms | max ms | 5xx | 429 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for route in sorted(load.latency):
            ms = [s * 1000 for s in load.latency[route]]
            codes = load.statuses[route]
            server_errors = sum(c for s, c in codes.items() if s >= 500 or s == 0)
            print(f"| {route} | {len(ms)} | {statistics.median(ms):.0f} | {_percentile(ms, 0.95):.0f} | {max(ms):.0f} | "
                  f"{server_errors} | {codes.get(429, 0)} |")
        statuses = defaultdict(int)
        for body in ended.values():
            statuses[body["status"]] += 1
        print(f"\nlong-polls declined over the waiter limit (200 + X-Acs-Longpoll: declined): {load.declined}")
        print(f"jobs in the store {len(ended)}: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
        print(f"  of which the client heard no 202 (a 503 with Retry-After, or a timeout): {len(unanswered)}"
              + "".join(f"\n    {j}: {ended[j]['status']}, {ended[j].get('error')}" for j in unanswered[:10]))
        print(f"ledger: {len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems[:20]))
        print("documented 503s with Retry-After, by code: "
              + (", ".join(f"{code} {n}" for code, n in sorted(load.overloaded.items())) or "none"))
        print(f"server errors / no answer: {len(load.failures)}" + "".join(f"\n  {f}" for f in load.failures[:20]))
        print(f"429 answers by code are expected (per-key cap small=3): "
              f"{sum(c.get(429, 0) for c in load.statuses.values())}")
        return 1 if problems or load.failures else 0
    finally:
        if proc is not None:
            _stop_stack(proc)
        _drop_schema(schema)
        if prefect_db:
            _drop_database(prefect_db)


def _error_code(answer: httpx.Response) -> str:
    try:
        return answer.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
