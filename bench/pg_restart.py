"""The job store's PostgreSQL server restarted under load: jobs in flight finish, none is charged twice.

    .venv/bin/python bench/pg_restart.py [--keys 3] [--jobs-per-key 3] [--down 5]

Starts a PostgreSQL server of its own (initdb + pg_ctl from /usr/lib/postgresql/15/bin, as the
`postgres` user, in a scratch folder, on a free port of 127.0.0.1; never the machine's shared
server at :5432), and `harvest up` as shipped with its job store there
(`HARVEST_DATABASE_URL`; Prefect on its embedded SQLite). It submits `--jobs-per-key` jobs for
each of `--keys` keys (each a few shards long), waits until some run, then stops the
PostgreSQL server (`pg_ctl stop -m fast`: every connection cut), keeps it down `--down`
seconds while clients go on reading their jobs and submitting more, and starts it again. Then
every job is followed to its end and the ledger checked (`bench.load_api._check_ledger`): one
charge row per job, outcome equal to its status, a done job charged the tokens of its
manifest, a failed one 0. Answers during the outage are counted by status; a 5xx other than
the documented 503s (`harvest_unavailable`, `replica_busy`), or no answer,
is reported. Exits 1 on a ledger problem or a job not ended.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.load_api import TERMINAL, _check_ledger, _start_stack, _stop_stack  # noqa: E402 - after the path

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    """A PostgreSQL server in `folder`, owned by the `postgres` user (initdb refuses root)."""

    def __init__(self, folder: Path, port: int):
        self.folder = folder
        self.data = folder / "data"
        self.port = port

    def _as_postgres(self, *argv: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *argv], check=True, capture_output=True, text=True)

    def init(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"


def _free_port() -> int:
    from fleet.processes import free_port

    return free_port()


class Clients:
    """Each key's submits and reads, with every answer counted by phase and status."""

    def __init__(self, base: str, keys: list[str]):
        self.base = base
        self.keys = keys
        self.phase = "before"
        self.answers: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.failures: list[str] = []
        self.jobs: dict[str, str] = {}  # job id -> key
        self.lock = threading.Lock()

    def call(self, client: httpx.Client, method: str, url: str, key: str, **kwargs) -> httpx.Response | None:
        try:
            answer = client.request(method, url, headers={"Authorization": f"Bearer {key}"}, **kwargs)
        except httpx.HTTPError as exc:
            with self.lock:
                self.answers[self.phase]["no answer"] += 1
                self.failures.append(f"{self.phase} {method} {url}: {type(exc).__name__} {exc}")
            return None
        label = str(answer.status_code)
        if answer.status_code >= 400:
            try:
                label += " " + answer.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
        with self.lock:
            self.answers[self.phase][label] += 1
            documented = answer.status_code == 503 and any(c in label for c in ("harvest_unavailable", "replica_busy"))
            if answer.status_code >= 500 and not documented:
                self.failures.append(f"{self.phase} {method} {url}: {answer.status_code} {answer.text[:200]}")
        return answer

    def submit(self, client: httpx.Client, key: str, n: int) -> str | None:
        body = {"model": "llama-tiny", "prompts": [f"restart job {n} prompt {i} " + "words " * 60 for i in range(8)],
                "shard_size": 2, "layers": "all"}
        answer = self.call(client, "POST", f"{self.base}/harvest", key, json=body)
        if answer is not None and answer.status_code == 202:
            with self.lock:
                self.jobs[answer.json()["job_id"]] = key
            return answer.json()["job_id"]
        return None

    def statuses(self, client: httpx.Client) -> dict[str, str]:
        seen = {}
        for job_id, key in list(self.jobs.items()):
            answer = self.call(client, "GET", f"{self.base}/harvest/{job_id}", key)
            if answer is not None and answer.status_code == 200:
                seen[job_id] = answer.json()["status"]
        return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--jobs-per-key", type=int, default=3)
    parser.add_argument("--down", type=float, default=5.0, help="seconds the PostgreSQL server stays down")
    parser.add_argument("--drain", type=float, default=600, help="seconds for every job to end")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="harvest-pg-restart-"))
    os.chmod(scratch, 0o755)
    pg = PrivatePostgres(scratch / "pg", _free_port())
    pg.init()
    pg.start()
    proc = None
    try:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={pg.port} dbname=postgres user=postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE harvest")
        db_url = pg.url("harvest")
        home = scratch / "home"
        home.mkdir()
        started = time.monotonic()
        proc, info = _start_stack(home, db_url, None)
        base = info["ACS_API_BASE"]
        print(f"stack ready in {time.monotonic() - started:.0f} s: {base}; job store {db_url}", flush=True)
        from api.auth import create_key
        from api.db import make_engine

        engine = make_engine(db_url)
        made = [create_key(f"restart-{k}", engine=engine) for k in range(args.keys)]
        engine.dispose()
        keys = [key for key, _ in made]
        key_of = {record.id: key for key, record in made}
        clients = Clients(base, keys)
        unanswered: set[str] = set()
        with httpx.Client(timeout=120) as client:
            for n in range(args.jobs_per_key):
                for key in keys:
                    clients.submit(client, key, n)
            # Restart once some run (a job in flight), not before.
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                seen = clients.statuses(client)
                if sum(s == "running" for s in seen.values()) >= 1:
                    break
                time.sleep(1)
            in_flight = {j: s for j, s in clients.statuses(client).items() if s not in TERMINAL}
            print(f"{len(clients.jobs)} jobs submitted; at the restart {len(in_flight)} not ended "
                  f"({', '.join(f'{s} {sum(v == s for v in in_flight.values())}' for s in sorted(set(in_flight.values())))})", flush=True)

            clients.phase = "outage"
            stop_reads = threading.Event()

            def outage_traffic():
                with httpx.Client(timeout=60) as reader:
                    n = 100
                    while not stop_reads.is_set():
                        clients.statuses(reader)
                        clients.submit(reader, keys[n % len(keys)], n)
                        n += 1
                        stop_reads.wait(0.5)

            traffic = threading.Thread(target=outage_traffic, daemon=True)
            down_at = time.monotonic()
            pg.stop("fast")
            traffic.start()
            time.sleep(args.down)
            pg.start()
            up_at = time.monotonic()
            time.sleep(5)  # the clients keep going a little after it is back
            stop_reads.set()
            traffic.join(120)
            clients.phase = "after"
            print(f"PostgreSQL down {up_at - down_at:.1f} s (pg_ctl stop -m fast, start)", flush=True)

            # Every job of the store, those whose submit was not answered 202 included (a
            # submit answered 503 records its job failed; one cut by the outage may have one).
            from sqlalchemy import create_engine, text

            store = create_engine(db_url)
            with store.connect() as conn:
                for job_id, key_id in conn.execute(text("SELECT id, key_id FROM jobs")).all():
                    if str(job_id) not in clients.jobs:
                        clients.jobs[str(job_id)] = key_of[key_id]
                        unanswered.add(str(job_id))
            store.dispose()
            deadline = time.monotonic() + args.drain
            ended: dict[str, dict] = {}
            while time.monotonic() < deadline and len(ended) < len(clients.jobs):
                for job_id, key in list(clients.jobs.items()):
                    if job_id in ended:
                        continue
                    answer = clients.call(client, "GET", f"{base}/harvest/{job_id}", key, params={"wait": 5})
                    if answer is not None and answer.status_code == 200 and answer.json()["status"] in TERMINAL:
                        ended[job_id] = answer.json()
                time.sleep(0.5)
            for job_id, key in clients.jobs.items():  # what did not end, as it stands
                if job_id not in ended:
                    answer = clients.call(client, "GET", f"{base}/harvest/{job_id}", key)
                    ended[job_id] = answer.json() if answer is not None and answer.status_code == 200 else {"status": "unknown", "job_id": job_id}
        problems = _check_ledger(db_url, home, ended)
        by_status = defaultdict(int)
        for body in ended.values():
            by_status[body["status"]] += 1
        print(f"\njobs: {len(ended)}, {len(unanswered)} of them unknown to their client (its submit not answered 202: "
              + ", ".join(f"{ended[j]['status']}" for j in sorted(unanswered)) + "; "
              + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())) + "); "
              f"{len(in_flight)} were in flight at the restart: " +
              ", ".join(f"{ended[j]['status']}" for j in sorted(in_flight)))
        for body in ended.values():
            if body["status"] == "failed":
                print(f"  failed {body['job_id']}: {json.dumps(body.get('error'))[:300]}")
        for phase in ("before", "outage", "after"):
            print(f"answers {phase}: " + ", ".join(f"{k}: {v}" for k, v in sorted(clients.answers[phase].items())))
        print(f"ledger: {len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems[:20]))
        print(f"5xx other than documented 503s, or no answer: {len(clients.failures)}" +
              "".join(f"\n  {f}" for f in clients.failures[:20]))
        not_ended = [j for j, b in ended.items() if b["status"] not in TERMINAL]
        return 1 if problems or not_ended else 0
    finally:
        if proc is not None:
            _stop_stack(proc)
        try:
            pg.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
