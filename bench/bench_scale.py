"""The control plane under a fleet's load: today's one Prefect server against the scaled one,
side by side in one run.

Each plane is the fleet's roles started as an operator starts them (README "Running as a
fleet"), on a fresh PostgreSQL database for Prefect and one for the job store:

- `one`: `harvest server` (one Prefect process, its services inside, on PostgreSQL);
- `scaled`: `harvest server --api-servers 2 --redis-url …` (two API servers, the services
  apart, on PostgreSQL and a Redis server of the bench's own), the other roles given both
  servers;
- one API replica (`harvest api`, holding the watcher lease) and one worker host
  (`harvest worker --lane small`), with their defaults.

Per plane, active jobs are added up to each `--jobs` level (held in the job store and in
Prefect: a row each, a flow run each on the `large` lane, forced to Running, so no worker takes
them and the watcher follows them all). At each level, for each `--hosts` count, simulated
worker hosts poll the `small` pool as `prefect worker` does (a heartbeat every 30 s, a poll
every `HOST_POLL_S`, 1 s; `bench/bench_polling.py`), spread over the plane's
servers, for `--seconds`; meanwhile real 2-prompt `llama-tiny` jobs run one after another
through the API (submit, long-poll to done) and a reader reads seeded jobs
(`GET /v1/harvest/{id}`) 5 times a second. Reported per point:

- polls answered and refused per second, poll p50/p95;
- the real jobs' submit-to-done p50/p95;
- job read p95;
- the watcher's ticks (count, mean and max seconds, from the replica's
  `harvest_watcher_tick_seconds`) and its lease renewals (held/lost, from
  `harvest_watcher_lease_renewals_total`);
- CPU (% of one core) and resident memory of each role's process tree.

Run: `.venv/bin/python bench/bench_scale.py [--planes one,scaled] [--jobs 100,1000,10000]
[--hosts 1,10,50,100,200] [--seconds 20] [--faults 50]` (PostgreSQL on loopback; `redis-server`).

`--faults H`: then, on the scaled plane, three more points with H hosts, each with one fault a
quarter of the way in: one Prefect API server SIGKILLed (the role restarts it), Redis
restarted empty, the services process SIGKILLed (the role restarts it). The row shows what the
fleet did meanwhile: polls refused, real jobs done and failed, job reads, the lease.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_polling import SimulatedHosts, _p  # noqa: E402

HOST_POLL_S = 1.0
"""The simulated hosts' poll: issue 45 asks for hosts polling every second, the interval shipped
until the workers were woken by Prefect's events (now `fleet.processes.WORKER_QUERY_S`, 5 s)."""

HARVEST = [sys.executable, "-m", "fleet.cli"]
PG = "postgres@127.0.0.1:5432"
SEED_LANE = "large"  # the seeded jobs' runs: on a lane whose pool no host here serves


class Role:
    """One role's process, its stdout read line by line (ready lines), in its own session."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], home: Path):
        home.mkdir(parents=True, exist_ok=True)
        self.name, self.home = name, home
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, env=env, cwd=home, stdout=subprocess.PIPE, stderr=open(home / "stderr.log", "wb"),
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if line.startswith(prefix):
                    return line[len(prefix):]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.home / "stderr.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} never printed {prefix!r}:\n{tail}")
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HARVEST_", "ACS_"))}
    env.update(HARVEST_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def _database(name: str, drop: bool = False) -> None:
    import psycopg

    with psycopg.connect(f"postgresql://{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' if drop else f'CREATE DATABASE "{name}"')


class PrivateRedis:
    """A Redis server of the bench's own on a free loopback port (nothing kept on disk), so a
    fault can restart it without touching the machine's."""

    def __init__(self, home: Path):
        from fleet.processes import free_port

        self.port = free_port()
        self.argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.log = home / "redis.log"
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-500:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Plane:
    """A control plane (`one` or `scaled`) with one API replica and one worker host."""

    def __init__(self, kind: str, root: Path):
        from fleet.processes import free_port

        self.kind, self.root = kind, root
        self.prefect_db, self.jobs_db = f"bench_scale_{kind}_{uuid.uuid4().hex[:6]}", f"bench_scale_jobs_{uuid.uuid4().hex[:6]}"
        self.redis = PrivateRedis(root) if kind == "scaled" else None
        self.roles: list[Role] = []
        self.storage = f"file://{root / 'storage'}"
        self.store_url = f"postgresql+psycopg://{PG}/{self.jobs_db}"
        self.metrics_token = secrets.token_hex(16)
        _database(self.prefect_db)
        _database(self.jobs_db)
        argv = [*HARVEST, "server", "--port", str(free_port())]
        if kind == "scaled":
            port = free_port()
            while not _port_free(port + 1):
                port = free_port()
            argv = [*HARVEST, "server", "--port", str(port), "--api-servers", "2", "--redis-url", self.redis.url]
        server = self._role("server", argv, PREFECT_API_DATABASE_CONNECTION_URL=f"postgresql+asyncpg://{PG}/{self.prefect_db}")
        if kind == "scaled":
            self.urls = server.wait_for("HARVEST_PREFECT_API_URLS=").split(",")
            prefect = {"HARVEST_PREFECT_API_URLS": ",".join(self.urls)}
        else:
            self.urls = [server.wait_for("PREFECT_API_URL=")]
            prefect = {"PREFECT_API_URL": self.urls[0]}
        self.auth = (root / "server" / "prefect-auth").read_text().strip()
        prefect["PREFECT_API_AUTH_STRING"] = self.auth
        common = {**prefect, "HARVEST_STORAGE_URL": self.storage, "HARVEST_DATABASE_URL": self.store_url}
        api = self._role("api", [*HARVEST, "api", "--port", str(free_port())], HARVEST_METRICS_TOKEN=self.metrics_token, **common)
        self.base = api.wait_for("ACS_API_BASE=")
        worker = self._role("worker", [*HARVEST, "worker", "--lane", "small", "--metrics-port", "0"], **common)
        worker.wait_for("WORKER_READY")
        created = subprocess.run(
            [*HARVEST, "keys", "create", "--name", "bench-scale", "--read-per-s", "1000", "--read-burst", "1000",
             "--submit-per-s", "100", "--submit-burst", "100"],
            env=_env(root / "admin", HARVEST_DATABASE_URL=self.store_url), capture_output=True, text=True, check=True,
        )
        self.key = created.stdout.strip().splitlines()[-1].strip()
        self.seeded: list[str] = []

    def _role(self, name: str, argv: list[str], **env: str) -> Role:
        role = Role(name, argv, _env(self.root / name, **env), self.root / name)
        self.roles.append(role)
        return role

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def close(self) -> None:
        for role in reversed(self.roles):
            role.stop()
        for name in (self.prefect_db, self.jobs_db):
            _database(name, drop=True)
        if self.redis is not None:
            self.redis.stop()

    # --- active jobs, held in the store and in Prefect ----------------------------------
    def seed(self, total: int) -> None:
        """Active jobs up to `total`: job rows (running) and their flow runs (forced Running)."""
        from sqlalchemy import create_engine, insert, select

        from api.db import api_keys, jobs, utcnow
        from flows.submit import astart_harvest_run
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
        from prefect.states import Running

        new = [str(uuid.uuid4()) for _ in range(total - len(self.seeded))]
        if not new:
            return
        engine = create_engine(self.store_url)
        with engine.begin() as conn:
            key_id = conn.execute(select(api_keys.c.id).where(api_keys.c.name == "bench-scale")).scalar_one()

        async def start_all() -> dict[str, str]:
            gate = asyncio.Semaphore(8)
            runs: dict[str, str] = {}

            async def one(job_id: str, client) -> None:
                async with gate:
                    run_id = await astart_harvest_run(job_id, f"{self.storage}/jobs/{job_id}/request.json", "llama-tiny",
                                                      SEED_LANE, key_id)
                    await client.set_flow_run_state(run_id, Running(), force=True)
                    runs[job_id] = str(run_id)

            async with get_client() as client:
                await asyncio.gather(*(one(j, client) for j in new))
            return runs

        # The runs first, then the rows naming them: a row without its run for long is an
        # orphan to the watcher (a replica that died mid-submit), which would start it itself.
        started = time.monotonic()
        with temporary_settings({PREFECT_API_URL: self.urls[0], PREFECT_API_AUTH_STRING: self.auth}):
            runs = asyncio.run(start_all())
        with engine.begin() as conn:
            conn.execute(insert(jobs), [{
                "id": job_id, "key_id": key_id, "model": "llama-tiny", "lane": SEED_LANE, "status": "running", "n_prompts": 2,
                "layers": [1, 3], "shard_size": 32, "n_shards": 1, "shards_done": 0, "add_special_tokens": True,
                "contents": "residuals", "reserved_tokens": 24, "tokens": None, "created_at": utcnow(), "started_at": utcnow(),
                "completed_at": None, "error": None, "request_url": f"{self.storage}/jobs/{job_id}/request.json",
                "flow_run_id": runs[job_id], "restarts": 0, "result": None, "stop_run": False,
            } for job_id in new])
        engine.dispose()
        self.seeded += new
        print(f"   {self.kind}: {len(new)} active jobs added in {time.monotonic() - started:.0f} s ({len(self.seeded)} held)",
              flush=True)

    # --- readings ---------------------------------------------------------------------------
    def watcher(self) -> dict[str, float]:
        text = httpx.get(self.base.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {self.metrics_token}"},
                         timeout=30).raise_for_status().text
        found = {"ticks": 0.0, "tick_s": 0.0, "held": 0.0, "lost": 0.0}
        for line in text.splitlines():
            if line.startswith("harvest_watcher_tick_seconds_count"):
                found["ticks"] = float(line.split()[-1])
            elif line.startswith("harvest_watcher_tick_seconds_sum"):
                found["tick_s"] = float(line.split()[-1])
            elif m := re.match(r'harvest_watcher_lease_renewals_total\{outcome="(held|lost)"\} (\S+)', line):
                found[m.group(1)] = float(m.group(2))
        return found

    def _per_role(self, reading) -> dict[str, float]:
        """`reading(process)` summed over each role's process tree (a process that ended counts 0)."""
        out = {}
        for role in self.roles:
            total = 0.0
            for proc in role.tree():
                try:
                    total += reading(proc)
                except psutil.Error:
                    pass
            out[role.name] = total
        return out

    def cpu(self) -> dict[str, float]:
        def seconds(proc):
            t = proc.cpu_times()
            return t.user + t.system + t.children_user + t.children_system

        return self._per_role(seconds)

    def rss_mib(self) -> dict[str, float]:
        return self._per_role(lambda proc: proc.memory_info().rss / 2**20)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _real_jobs(plane: Plane, stop: threading.Event, out: list[float], failed: list[str], refused: list[float]) -> None:
    """Sequential 2-prompt jobs, as `harvest-client` sends them: a submit answered 503 is sent
    again after its Retry-After (each counted in `refused`); its time runs from the first."""
    headers = {"Authorization": f"Bearer {plane.key}"}
    with httpx.Client(base_url=plane.base, headers=headers, timeout=120) as http:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"model": "llama-tiny", "prompts": [f"The sky is {n}", "Grass is"], "layers": [2, 4, 6]}
            started = time.perf_counter()
            try:
                while (answer := http.post("/harvest", json=body)).status_code == 503:
                    refused.append(time.perf_counter())
                    time.sleep(float(answer.headers.get("Retry-After", "5")))
                job = answer.raise_for_status().json()
                while job["status"] not in ("done", "failed", "cancelled"):
                    job = http.get(f"/harvest/{job['job_id']}", params={"wait": 30}).raise_for_status().json()
            except httpx.HTTPError as exc:
                failed.append(str(exc)[:80])
                continue
            if job["status"] == "done":
                out.append(time.perf_counter() - started)
            else:
                failed.append(f"{job['status']}: {job.get('error')}")


def _reads(plane: Plane, stop: threading.Event, out: list[float], errors: list[str]) -> None:
    headers = {"Authorization": f"Bearer {plane.key}"}
    with httpx.Client(base_url=plane.base, headers=headers, timeout=30) as http:
        while not stop.is_set():
            job_id = random.choice(plane.seeded)
            started = time.perf_counter()
            answer = http.get(f"/harvest/{job_id}")
            out.append(time.perf_counter() - started)
            if answer.status_code != 200:
                errors.append(str(answer.status_code))
            stop.wait(0.2)


def _server_processes(plane: Plane) -> dict[str, psutil.Process]:
    """The control plane's Prefect API servers (by port) and its services process ("services")."""
    found = {}
    for proc in plane.role("server").tree():
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "fleet.prefect_server" in cmd:
            found[cmd[cmd.index("--port") + 1]] = proc
        elif cmd[-3:] == ["server", "services", "start"]:
            found["services"] = proc
    return found


def kill_one_api_server(plane: Plane) -> None:
    port = sorted(p for p in _server_processes(plane) if p != "services")[-1]
    _server_processes(plane)[port].kill()


def restart_redis(plane: Plane) -> None:
    plane.redis.stop()
    time.sleep(1.0)
    plane.redis.start()


def kill_the_services(plane: Plane) -> None:
    _server_processes(plane)["services"].kill()


FAULTS = {"kill one API server": kill_one_api_server, "restart Redis": restart_redis, "kill the services": kill_the_services}


def point(plane: Plane, hosts: int, seconds: float, fault=None) -> dict:
    # The worker host is one of the hosts; the rest are simulated, spread over the servers.
    per_server = [len(range(i, hosts - 1, len(plane.urls))) for i in range(len(plane.urls))]
    simulated = [SimulatedHosts(n, "small", url, plane.auth, HOST_POLL_S).start() for n, url in zip(per_server, plane.urls)]
    time.sleep(2.0)  # the simulated hosts spread over their interval
    stop = threading.Event()
    jobs: list[float] = []
    failed: list[str] = []
    submits_refused: list[float] = []
    reads: list[float] = []
    read_errors: list[str] = []
    before_polls = [len(s.latencies) for s in simulated]
    before_errors = [len(s.errors) for s in simulated]
    watcher, cpu, wall = plane.watcher(), plane.cpu(), time.monotonic()
    threads = [threading.Thread(target=_real_jobs, args=(plane, stop, jobs, failed, submits_refused)),
               threading.Thread(target=_reads, args=(plane, stop, reads, read_errors))]
    for t in threads:
        t.start()
    if fault is not None:  # a quarter into the point, so the rest shows the recovery
        time.sleep(seconds / 4)
        fault(plane)
        time.sleep(seconds * 3 / 4)
    else:
        time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(180)
    wall = time.monotonic() - wall
    watcher_after, cpu_after, rss = plane.watcher(), plane.cpu(), plane.rss_mib()
    polls = [x for s, b in zip(simulated, before_polls) for x in s.latencies[b:]]
    refused = sum(len(s.errors) - b for s, b in zip(simulated, before_errors))
    for s in simulated:
        s.stop()
    ticks = watcher_after["ticks"] - watcher["ticks"]
    return {
        "hosts": hosts, "polls/s": len(polls) / wall, "refused/s": refused / wall,
        "poll p50 ms": 1000 * _p(polls, 0.5) if polls else float("nan"), "poll p95 ms": 1000 * _p(polls, 0.95) if polls else float("nan"),
        "jobs done": len(jobs), "jobs failed": len(failed), "submits refused": len(submits_refused),
        "job p50 s": statistics.median(jobs) if jobs else float("nan"), "job p95 s": _p(jobs, 0.95),
        "read p95 ms": 1000 * _p(reads, 0.95), "read errors": len(read_errors),
        "ticks": ticks, "tick mean ms": 1000 * (watcher_after["tick_s"] - watcher["tick_s"]) / ticks if ticks else float("nan"),
        "renewals held": watcher_after["held"] - watcher["held"], "lease lost": watcher_after["lost"] - watcher["lost"],
        **{f"CPU % {name}": 100 * (cpu_after[name] - cpu[name]) / wall for name in cpu},
        **{f"MiB {name}": rss[name] for name in rss},
        "load": os.getloadavg()[0], "failures": failed[:2] + read_errors[:2],
    }


def _say(row: tuple[str, int, dict]) -> None:
    plane, total, figures = row
    print("  ", plane, total, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planes", default="one,scaled")
    parser.add_argument("--jobs", default="100,1000,10000")
    parser.add_argument("--hosts", default="1,10,50,100,200")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--faults", type=int, default=0, metavar="HOSTS",
                        help="then, on the scaled plane at the last --jobs level with HOSTS hosts polling, one point per fault")
    args = parser.parse_args()
    rows: list[tuple[str, int, dict]] = []
    for kind in args.planes.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"bench-scale-{kind}-"))
        plane = Plane(kind, root)
        print(f"{kind}: {', '.join(plane.urls)}; API {plane.base}", flush=True)
        try:
            # The first job loads the model into the worker host's engine server.
            headers = {"Authorization": f"Bearer {plane.key}"}
            job = httpx.post(f"{plane.base}/harvest", json={"model": "llama-tiny", "prompts": ["warm"], "layers": [1]},
                             headers=headers, timeout=120).raise_for_status().json()
            while job["status"] not in ("done", "failed", "cancelled"):
                job = httpx.get(f"{plane.base}/harvest/{job['job_id']}", params={"wait": 30}, headers=headers, timeout=60).json()
            for total in (int(j) for j in args.jobs.split(",")):
                plane.seed(total)
                for hosts in (int(h) for h in args.hosts.split(",")):
                    rows.append((kind, total, point(plane, hosts, args.seconds)))
                    _say(rows[-1])
            if kind == "scaled" and args.faults:
                for name, fault in FAULTS.items():
                    rows.append((f"scaled, {name}", total, point(plane, args.faults, max(args.seconds, 40.0), fault)))
                    _say(rows[-1])
        finally:
            plane.close()
    columns = ["hosts", "polls/s", "refused/s", "poll p50 ms", "poll p95 ms", "job p50 s", "job p95 s", "jobs done",
               "jobs failed", "submits refused", "read p95 ms", "ticks", "tick mean ms", "renewals held", "lease lost", "CPU % server",
               "CPU % api", "CPU % worker", "MiB server", "MiB api", "MiB worker", "load"]
    print("\n| plane | active jobs | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for kind, total, row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print(f"| {kind} | {total} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
