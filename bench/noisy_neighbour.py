"""A noisy neighbour: what one key sending the worst legal requests does to another key.

Against a whole `harvest up` stack on loopback whose job store and Prefect server are on
PostgreSQL (fresh ones at 127.0.0.1:5432, dropped at the end), with the service's default
request rates and caps, two phases of `--seconds` each on the same stack:

1. baseline: the victim key alone runs small jobs (submit, long-poll to done) and reads
   (its done job, its list page);
2. attack: the same victim, while the attacker key, from another client address
   (127.0.0.2), sends at its full allowed rate the worst legal requests of every route:
   the largest harvest bodies of the longest prompts (refused for their tokens), harvests of
   the largest shard bytes (`layers: "all"`, `shard_size` 4096, prompts at `max_model_len`,
   up to the 2,000,000-token cap), the longest inline generation with every layer's
   activations, list pages of 100, long-polls of 60 s, and bad file links and bad keys
   without a valid key.

The attacker's client runs in a process and session of its own whose scheduling group is
lowered to nice 19 (`--attacker-nice`): it stands for another machine, so it takes only what
the service leaves of this one's CPU, and its own work never stalls the victim's client.

It prints the victim's submit-to-done and read p50/p95 in each phase and their ratio (target
≤ 2×), every process's peak RSS (psutil over the stack's processes, engine servers
included) by role against its documented bound, answers by status per route (a 5xx other
than the documented 503s `harvest_unavailable` and `replica_busy` is a failure), and the
ledger: every job ended with exactly one charge row of the right tokens, and the attacker's
activation usage equal to the positions its responses carried. Exits 1 on a failure.

    .venv/bin/python bench/noisy_neighbour.py [--seconds 60] [--scale 1.0]

`--scale` < 1 shrinks the attacker's refused bodies, `--shard-scale` < 1 its largest shard
(on a shared machine: at 1.0 a single shard is ~8 GB, and on a branch without bounded
shards its engine server needs several times that); the report says what ran. Everything
else is as shipped (the worker's poll included). `--without inline,bodies` leaves attacks out,
to find which one costs the victim what (the target is for the whole attack); `--timelines N`
prints the N slowest victim runs under attack with their task runs' times (which step waited).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.load_api import (  # noqa: E402 - after the path
    TERMINAL,
    _check_ledger,
    _drop_database,
    _drop_schema,
    _percentile,
    _pg_schema,
    _prefect_database,
    _start_stack,
    _stop_stack,
)

DOCUMENTED_503 = {"harvest_unavailable", "replica_busy"}
ATTACKER_ADDRESS = "127.0.0.2"  # another client address on loopback: the per-address limits are its own
WORDS = "the residual stream carries every feature a probe reads and every token adds its own part".split()

# Bounds the README documents for each process ("Memory of each process"), in short.
BOUNDS = {
    "api": "imports + submits ≤ a few × HARVEST_ADMISSION_BYTES + inline ≤ HARVEST_INLINE_RESPONSE_BUDGET_BYTES",
    "api-assessor": "imports + tokenizers + one submit (~3 × its body); with the api within 4 × HARVEST_ADMISSION_BYTES",
    "checkpoint-build": "once per host and built-in model, on its first submit: torch + the model's weights; ends when built",
    "inline-engine": "its model + one batch's generations (their residuals within the replica's HARVEST_INLINE_RESPONSE_BUDGET_BYTES)",
    "run": "imports + one piece (HARVEST_ENGINE_PIECE_BYTES) + S3 parts (HARVEST_S3_PART_BYTES)",
    "engine-server": "models + one pass of HARVEST_ENGINE_BATCH_TOKENS and its captures (~3 × HARVEST_ENGINE_PIECE_BYTES on the CPU)",
    "run-starter": "fixed: imports, no model",
    "run-launcher": "fixed: the standard library only",
    "worker": "fixed: Prefect's worker",
    "prefect-server": "fixed per request: prompts never reach it",
    "harvest-up": "fixed: supervision, output to log files",
}


POSTGRES = "postgresql (whole server)"
"""Not the service's own processes: the PostgreSQL server its job store and Prefect share
(every database's backends), sampled for its CPU only."""


def _role(process: psutil.Process) -> str:
    try:
        line = " ".join(process.cmdline())
        if process.name() == "postgres":
            return POSTGRES
    except psutil.Error:
        return "gone"
    if "fleet.run_starter" in line:
        # The starter (`--socket`), the runs it forks (same command line, the starter their
        # parent), and the launchers the worker starts per run (no `--socket`; standard library only).
        if "--socket" not in line:
            return "run-launcher"
        try:
            parent = process.parent()
            return "run" if parent is not None and "fleet.run_starter" in " ".join(parent.cmdline()) else "run-starter"
        except psutil.Error:
            return "run-starter"
    for needle, role in (("api.inline_process", "inline-engine"), ("api.admission_process --build", "checkpoint-build"),
                         ("api.admission_process", "api-assessor"),
                         ("api.app", "api"), ("uvicorn", "api"),
                         ("harvest.warm.server", "engine-server"), ("fleet.run_starter", "run-starter"),
                         ("fleet.prefect_server", "prefect-server"), ("prefect server", "prefect-server"),
                         ("prefect worker", "worker"), ("fleet.pool_worker", "worker"), ("harvest up", "harvest-up"), ("harvest worker", "worker"),
                         ("harvest server", "prefect-server"), ("harvest api", "api")):
        if needle in line:
            return role
    return "run" if "flow" in line or "prefect" in line else line[:40]


class RssSampler(threading.Thread):
    """Peak RSS per process of the stack (its process tree, plus detached processes whose
    HARVEST_HOME is the stack's), sampled every `interval` s."""

    def __init__(self, root_pid: int, home: Path, interval: float = 0.5):
        super().__init__(daemon=True)
        self.root = root_pid
        self.home = str(home)
        self.interval = interval
        self.peak: dict[int, tuple[str, int]] = {}  # pid -> (role, peak bytes)
        self.cpu: dict[int, float] = {}  # pid -> CPU seconds (user + system) at its last sample
        self.stop = threading.Event()
        self._ours: dict[int, bool] = {}

    def _members(self) -> list[psutil.Process]:
        try:
            tree = psutil.Process(self.root)
            members = {p.pid: p for p in [tree, *tree.children(recursive=True)]}
        except psutil.Error:
            members = {}
        for process in psutil.process_iter():
            if process.pid in members:
                continue
            if process.pid not in self._ours:
                try:
                    self._ours[process.pid] = process.name() == "postgres" or process.environ().get("HARVEST_HOME") == self.home
                except psutil.Error:
                    self._ours[process.pid] = False
            if self._ours[process.pid]:
                members[process.pid] = process
        return list(members.values())

    def run(self) -> None:
        while not self.stop.is_set():
            for process in self._members():
                try:
                    rss = process.memory_info().rss
                    times = process.cpu_times()
                    self.cpu[process.pid] = times.user + times.system
                except psutil.Error:
                    continue
                role, peak = self.peak.get(process.pid, (None, 0))
                if role is None:
                    role = _role(process)
                self.peak[process.pid] = (role, max(peak, rss))
            self.stop.wait(self.interval)

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (processes seen, largest peak RSS of one of them)."""
        roles: dict[str, tuple[int, int]] = {}
        for role, peak in self.peak.values():
            seen, top = roles.get(role, (0, 0))
            roles[role] = (seen + 1, max(top, peak))
        return roles

    def cpu_by_role(self) -> dict[str, float]:
        """role -> CPU seconds its processes used so far (as last sampled)."""
        used: dict[str, float] = defaultdict(float)
        for pid, seconds in self.cpu.items():
            used[self.peak.get(pid, ("?", 0))[0]] += seconds
        return dict(used)


class Record:
    """Latencies and statuses per (who, route); the victim's submit-to-done times."""

    def __init__(self):
        self.latency: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.statuses: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.failures: list[str] = []
        self.turnaround: list[float] = []
        self.stages: list[tuple[float, float]] = []  # each done victim job: (created → started, started → completed) s
        self.victim_jobs: list[str] = []  # the victim's done jobs, in order
        self.positions_returned = 0
        self.lingering: list[asyncio.Future] = []  # inline requests let finish past the clock
        self.client_cpu_s = 0.0  # the attacker's client process's own CPU seconds (its phase)

    def plain(self) -> dict:
        """What another process's record hands back (picklable)."""
        return {"latency": dict(self.latency), "statuses": {k: dict(v) for k, v in self.statuses.items()},
                "failures": self.failures, "positions_returned": self.positions_returned,
                "client_cpu_s": self.client_cpu_s}

    def merge(self, other: dict) -> None:
        for route, values in other["latency"].items():
            self.latency[route].extend(values)
        for route, counts in other["statuses"].items():
            for label, n in counts.items():
                self.statuses[route][label] += n
        self.failures.extend(other["failures"])
        self.positions_returned += other["positions_returned"]
        self.client_cpu_s += other["client_cpu_s"]

    async def call(self, who: str, route: str, client: httpx.AsyncClient, method: str, url: str, **kwargs) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            answer = await client.request(method, url, **kwargs)
        except asyncio.CancelledError:  # the attacker hung up at the clock
            self.statuses[(who, route)]["cut at the clock"] += 1
            raise
        except httpx.HTTPError as exc:
            self.statuses[(who, route)]["no answer"] += 1
            self.failures.append(f"{who} {route}: {type(exc).__name__} {exc}")
            return None
        self.latency[(who, route)].append(time.perf_counter() - started)
        code = answer.status_code
        label = str(code)
        if code >= 500:
            try:
                error_code = answer.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                error_code = "?"
            label = f"{code} {error_code}"
            if not (code == 503 and error_code in DOCUMENTED_503):
                self.failures.append(f"{who} {route}: {code} {answer.text[:200]}")
        self.statuses[(who, route)][label] += 1
        return answer


# --- the victim -------------------------------------------------------------------------------

def _when(stamp: str):
    """A timestamp as Prefect's API writes it (ISO 8601, Z for UTC)."""
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _prefect_auth(home: Path) -> dict[str, str]:
    from flows.prefect_auth import basic_header

    return basic_header((home / "prefect-auth").read_text().strip())


def _first_states(prefect_ui: str, auth: dict[str, str], run_id: str) -> dict:
    """When a flow run first entered each state type, from Prefect's own record ({} when it
    cannot be read)."""
    answer = httpx.get(f"{prefect_ui}/api/flow_run_states/", params={"flow_run_id": run_id}, headers=auth, timeout=30)
    first: dict = {}
    if answer.status_code == 200:
        for state in sorted(answer.json(), key=lambda st: st["timestamp"]):
            first.setdefault(state["type"], _when(state["timestamp"]))
    return first


def _job_rows(db_url: str) -> dict[str, tuple]:
    """Each job's flow run id, created_at and completed_at, from the job store."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = {r[0]: (r[1], r[2], r[3]) for r in conn.execute(text("SELECT id, flow_run_id, created_at, completed_at FROM jobs")).all()}
    engine.dispose()
    return rows


def _prefect_steps(home: Path, prefect_ui: str, db_url: str, job_ids: list[str]) -> dict[str, list[float]]:
    """Where a victim job's wait went, from Prefect's own record of its run: API (job created →
    its flow run created), queue (→ Pending: a worker took it), start (→ Running: the run's
    process started the flow), run (→ Completed), and from the job store: watcher (→ the job
    recorded done). Seconds per step, one value per job."""
    from datetime import datetime, timezone

    def utc(moment: datetime) -> datetime:
        return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)  # the store keeps UTC

    rows = _job_rows(db_url)
    auth = _prefect_auth(home)
    steps: dict[str, list[float]] = defaultdict(list)
    for job_id in job_ids:
        run_id, created, completed = rows[job_id]
        created, completed = (utc(stamp if isinstance(stamp, datetime) else _when(str(stamp))) for stamp in (created, completed))
        first = _first_states(prefect_ui, auth, run_id)
        if not {"SCHEDULED", "PENDING", "RUNNING", "COMPLETED"} <= set(first):
            continue
        steps["API"].append((first["SCHEDULED"] - created).total_seconds())
        steps["queue"].append((first["PENDING"] - first["SCHEDULED"]).total_seconds())
        steps["start"].append((first["RUNNING"] - first["PENDING"]).total_seconds())
        steps["run"].append((first["COMPLETED"] - first["RUNNING"]).total_seconds())
        steps["watcher"].append((completed - first["COMPLETED"]).total_seconds())
    return steps


def _slowest_runs(home: Path, prefect_ui: str, db_url: str, job_ids: list[str], count: int) -> list[str]:
    """The `count` victim runs longest from Running to Completed, each with its task runs'
    start and end (seconds after Running), from Prefect's own record: which step of a slow
    run waited (`--timelines`)."""
    rows = _job_rows(db_url)
    auth = _prefect_auth(home)
    timelines = []
    for job_id in job_ids:
        run_id = str(rows[job_id][0])
        first = _first_states(prefect_ui, auth, run_id)
        if not {"RUNNING", "COMPLETED"} <= set(first):
            continue
        tasks = httpx.post(f"{prefect_ui}/api/task_runs/filter", headers=auth, timeout=30,
                           json={"task_runs": {"flow_run_id": {"any_": [run_id]}}}).json()
        steps = sorted((_when(t["start_time"]), _when(t["end_time"]), t["name"]) for t in tasks
                       if t.get("start_time") and t.get("end_time"))
        since = lambda moment: (moment - first["RUNNING"]).total_seconds()  # noqa: E731
        line = ", ".join(f"{name} {since(start):.2f}-{since(end):.2f}" for start, end, name in steps)
        timelines.append((since(first["COMPLETED"]), f"job {job_id[:8]}: run {since(first['COMPLETED']):.2f} s; tasks {line}"))
    return [line for _, line in sorted(timelines, reverse=True)[:count]]


def _stages(job: dict) -> tuple[float, float]:
    """(waiting: created → started, running: started → completed) of a done job, in seconds."""
    created, started, completed = (_when(job[k]) for k in ("created_at", "started_at", "completed_at"))
    return (started - created).total_seconds(), (completed - started).total_seconds()


async def victim(base: str, key: str, record: Record, stop_at: float, done_jobs: list[str]) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    rng = random.Random(1)
    async with httpx.AsyncClient(headers=auth, timeout=120) as client:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            body = {"model": "llama-tiny", "prompts": [f"victim {rng.random():.6f}", "and a second prompt"], "layers": [2, 5]}
            answer = await record.call("victim", "POST /v1/harvest", client, "POST", f"{base}/harvest", json=body)
            if answer is None or answer.status_code != 202:
                await asyncio.sleep(1)
                continue
            job_id = answer.json()["job_id"]
            status = "pending"
            while status not in TERMINAL and time.monotonic() < stop_at + 120:
                polled = await record.call("victim", "GET /v1/harvest/{id}?wait=20", client, "GET",
                                           f"{base}/harvest/{job_id}", params={"wait": 20})
                if polled is None or polled.status_code != 200:
                    await asyncio.sleep(1)
                    continue
                if polled.headers.get("X-Acs-Longpoll") == "declined":
                    await asyncio.sleep(float(polled.headers.get("Retry-After", 3)))
                status = polled.json()["status"]
            if status == "done":
                record.turnaround.append(time.monotonic() - started)
                record.stages.append(_stages(polled.json()))
                record.victim_jobs.append(job_id)
                done_jobs.append(job_id)
            # reads between jobs: the done job (with its links) and the first page of the list
            for _ in range(3):
                if done_jobs:
                    await record.call("victim", "read", client, "GET", f"{base}/harvest/{done_jobs[-1]}")
                await record.call("victim", "read", client, "GET", f"{base}/harvest", params={"limit": 20})


# --- the attacker -------------------------------------------------------------------------------

def _text(chars: int, rng: random.Random) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def attack_bodies(scale: float, shard_scale: float, rng: random.Random) -> dict[str, bytes]:
    """The attacker's request bodies, made once (JSON bytes).

    `scale` shrinks the characters of the refused bodies' prompts (at 0.21 and more they are
    still over the 2,000,000-token cap); `shard_scale` the number of prompts of the largest
    shard (1.0: 976 prompts cut to the 2,048-token context, all 8 layers: ~8 GB in one shard).
    """
    big_prompt = _text(int(12_000 * scale) or 1, rng)
    too_many_tokens = {"model": "llama-tiny", "prompts": [big_prompt] * 4000, "layers": "all"}
    # Prompts past the model's context (cut to its 2,048 tokens), as many as fit under the
    # 2,000,000-token cap, all layers, every prompt in one shard.
    at_context = _text(2048 * 8, rng)
    largest_shard = {"model": "llama-tiny", "prompts": [at_context] * max(1, int(976 * shard_scale)),
                     "layers": "all", "shard_size": 4096}
    inline = {"model": "llama-tiny", "prompt": [7], "max_tokens": 2047, "temperature": 0, "output_residual_stream": True}
    return {name: json.dumps(body).encode() for name, body in
            (("too_many_tokens", too_many_tokens), ("largest_shard", largest_shard), ("inline", inline))}


ATTACKS = ("bodies", "shards", "inline", "lists", "long-polls", "no-key")


async def attacker(base: str, key: str, record: Record, stop_at: float, bodies: dict[str, bytes], waiters: int,
                   attacks: tuple[str, ...] = ATTACKS, flood: bool = False) -> None:
    """Every attack at once. Each loop sends its next request as soon as the service allows
    it: at once after an answer, after the `Retry-After` of a 429 or of a declined long-poll
    (the key's full allowed rate). With `flood`, it ignores those too and sends at once
    whatever the answer: beyond its allowed rate, so outside the 2x target; it shows what a
    refusal costs the replica."""
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    # A connection for each request: a client at nice 19 on a busy box may read an answer
    # seconds after the server sent it, so its idle clock for a kept connection lags the
    # server's (uvicorn closes one idle 5 s) and it would write requests on connections already
    # closed (98 'Server disconnected' in one run with kept connections, 1 with a 1 s expiry).
    transport = lambda: httpx.AsyncHTTPTransport(local_address=ATTACKER_ADDRESS,  # noqa: E731
                                                 limits=httpx.Limits(max_keepalive_connections=0))
    jobs: list[str] = []

    async def obey(answer: httpx.Response | None) -> None:
        """Wait as long as the answer asks (nothing under `flood`)."""
        if flood or answer is None:
            return
        if answer.status_code == 429 or answer.headers.get("X-Acs-Longpoll") == "declined":
            await asyncio.sleep(float(answer.headers.get("Retry-After", 1)))

    async def submitter(name: str) -> None:
        async with httpx.AsyncClient(headers=auth, timeout=300, transport=transport()) as client:
            while time.monotonic() < stop_at:
                answer = await record.call("attacker", f"POST /v1/harvest ({name})", client, "POST", f"{base}/harvest",
                                           content=bodies[name])
                if answer is not None and answer.status_code == 202:
                    jobs.append(answer.json()["job_id"])
                await obey(answer)

    async def inline() -> None:
        client = httpx.AsyncClient(headers=auth, timeout=900, transport=transport())  # outlives the clock (lingering)
        while time.monotonic() < stop_at:
            # Not cut at the clock: its positions must be read from its answer for the ledger check.
            call = asyncio.ensure_future(record.call("attacker", "POST /v1/completions (activations)", client, "POST",
                                                     f"{base}/completions", content=bodies["inline"]))
            record.lingering.append(call)
            answer = await asyncio.shield(call)
            if answer is not None and answer.status_code == 200:
                usage = answer.json()["usage"]
                record.positions_returned += usage["prompt_tokens"] + usage["completion_tokens"] - 1
                answer._counted = True
            else:
                await obey(answer)

    async def lister() -> None:
        async with httpx.AsyncClient(headers=auth, timeout=120, transport=transport()) as client:
            while time.monotonic() < stop_at:
                await obey(await record.call("attacker", "GET /v1/harvest?limit=100", client, "GET", f"{base}/harvest",
                                             params={"limit": 100}))

    async def long_poller() -> None:
        async with httpx.AsyncClient(headers=auth, timeout=120, transport=transport()) as client:
            while time.monotonic() < stop_at:
                if not jobs:
                    await asyncio.sleep(0.5)
                    continue
                await obey(await record.call("attacker", "GET /v1/harvest/{id}?wait=60", client, "GET",
                                             f"{base}/harvest/{jobs[-1]}", params={"wait": 60}))

    async def no_key() -> None:
        async with httpx.AsyncClient(timeout=60, transport=transport()) as client:
            while time.monotonic() < stop_at:
                job = uuid.uuid4()
                await obey(await record.call("no key", "GET /v1/files (bad link)", client, "GET",
                                             f"{base}/files/{job}/manifest.json", params={"expires": "1", "signature": "0" * 64}))
                await obey(await record.call("no key", "GET /v1/harvest/{id} (bad key)", client, "GET", f"{base}/harvest/{job}",
                                             headers={"Authorization": "Bearer acs_" + uuid.uuid4().hex}))

    work = {
        "bodies": lambda: [submitter("too_many_tokens"), submitter("too_many_tokens")],
        "shards": lambda: [submitter("largest_shard")],
        "inline": lambda: [inline(), inline()],
        "lists": lambda: [lister()],
        "long-polls": lambda: [long_poller() for _ in range(waiters)],
        "no-key": lambda: [no_key(), no_key()],
    }
    await asyncio.gather(*(call for name in attacks for call in work[name]()))


# --- one run -------------------------------------------------------------------------------------

async def _until(work, seconds: float) -> None:
    """The attacker stops at the clock, requests in flight included (its clients hang up)."""
    try:
        await asyncio.wait_for(work, seconds)
    except asyncio.TimeoutError:
        pass


def _attacker_process(base: str, key: str, seconds: float, bodies, waiters: int, attacks: tuple[str, ...],
                      flood: bool, nice: int, out) -> None:
    """The attacker's client, in a process and session of its own (multiprocessing target).

    A real attacker's client runs on its own machine: here it shares the service's two cores,
    so its session's group is lowered to `nice` (19 by default): it takes what the service
    leaves, and its own work (building 12 MiB bodies, parsing 8 MiB inline answers) neither
    slows the service nor stalls the victim's client loop, whose clock would count it."""
    os.setsid()
    if nice:
        from harvest.cpu_share import lower_priority

        lower_priority(nice, session=True)
    record = Record()
    cpu_at_start = sum(psutil.Process().cpu_times()[:2])

    async def run():
        stop_at = time.monotonic() + seconds
        await _until(attacker(base, key, record, stop_at, bodies, waiters, attacks, flood), seconds + 2)
        for call in record.lingering:
            answer = await call
            if answer is not None and answer.status_code == 200 and not getattr(answer, "_counted", False):
                usage = answer.json()["usage"]
                record.positions_returned += usage["prompt_tokens"] + usage["completion_tokens"] - 1
                answer._counted = True

    out.send("ready")  # both clocks start together: the victim's waits for this
    asyncio.run(run())
    record.client_cpu_s = sum(psutil.Process().cpu_times()[:2]) - cpu_at_start
    out.send(record.plain())
    out.close()


def _phase(base: str, victim_key: str, attacker_key: str | None, seconds: float, bodies, waiters: int,
           attacks: tuple[str, ...] = ATTACKS, flood: bool = False, attacker_nice: int = 19) -> Record:
    record = Record()
    done: list[str] = []
    attacker_client = answers = None
    if attacker_key is not None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # this process has threads (the sampler)
        answers, sent = context.Pipe(duplex=False)
        attacker_client = context.Process(target=_attacker_process, args=(base, attacker_key, seconds, bodies, waiters,
                                                                         attacks, flood, attacker_nice, sent))
        attacker_client.start()
        sent.close()
        if answers.recv() != "ready":
            raise RuntimeError("the attacker's client did not start")

    async def run():
        await victim(base, victim_key, record, time.monotonic() + seconds, done)

    asyncio.run(run())
    if attacker_client is not None:
        record.merge(answers.recv())  # after its lingering inline answers are in
        attacker_client.join()
    return record


def _warm_up(base: str, key: str) -> None:
    """One job to done and one inline completion first: both phases measure warm engines."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(headers=auth, timeout=600) as client:
        job = client.post(f"{base}/harvest", json={"model": "llama-tiny", "prompts": ["warm up"], "layers": [2, 5]}).json()
        while client.get(f"{base}/harvest/{job['job_id']}", params={"wait": 20}).json()["status"] not in TERMINAL:
            pass
        client.post(f"{base}/completions", json={"model": "llama-tiny", "prompt": [7], "max_tokens": 2, "output_residual_stream": [0]})


def _drain(base: str, jobs: dict[str, str], wait_s: float) -> dict[str, dict]:
    """Every stored job to an end: cancel what is active after `wait_s`. Reads as a polite
    client does: a few at a time per key (a replica works on a bounded number of one key's
    reads at once) and after the Retry-After of a 429."""
    shares: dict[str, asyncio.Semaphore] = {}

    async def call(client: httpx.AsyncClient, method: str, url: str, key: str, **kwargs) -> dict:
        async with shares.setdefault(key, asyncio.Semaphore(4)):
            while True:
                answer = await client.request(method, url, headers={"Authorization": f"Bearer {key}"}, **kwargs)
                if answer.status_code != 429:
                    return answer.json()
                await asyncio.sleep(float(answer.headers.get("retry-after", "1")))

    async def one(client: httpx.AsyncClient, job_id: str, key: str) -> dict:
        url = f"{base}/harvest/{job_id}"
        deadline = time.monotonic() + wait_s
        body = await call(client, "GET", url, key)
        while body["status"] not in TERMINAL and time.monotonic() < deadline:
            body = await call(client, "GET", url, key, params={"wait": 10})
        if body["status"] not in TERMINAL:
            await call(client, "DELETE", url, key)
            for _ in range(60):
                body = await call(client, "GET", url, key)
                if body["status"] in TERMINAL:
                    break
                await asyncio.sleep(1)
        return body

    async def all_of_them():
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            bodies = await asyncio.gather(*(one(client, job_id, key) for job_id, key in jobs.items()))
        return {b["job_id"]: b for b in bodies}

    return asyncio.run(all_of_them())


def _table(record: Record) -> list[str]:
    lines = ["| who | route | requests | p50 ms | p95 ms | answers |", "|---|---|---:|---:|---:|---|"]
    for (who, route) in sorted(record.statuses):
        ms = [s * 1000 for s in record.latency.get((who, route), [])] or [float("nan")]
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(record.statuses[(who, route)].items()))
        lines.append(f"| {who} | {route} | {len(record.latency.get((who, route), []))} | {statistics.median(ms):.0f} | "
                     f"{_percentile(ms, 0.95):.0f} | {answers} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the attacker's refused bodies (shared machines)")
    parser.add_argument("--shard-scale", type=float, default=1.0, help="shrink the attacker's largest shard (shared machines)")
    parser.add_argument("--drain", type=float, default=60, help="seconds for jobs to end before they are cancelled")
    parser.add_argument("--without", default="", help=f"leave out attacks to find which one costs the victim "
                        f"(comma-separated: {', '.join(ATTACKS)}); the target is measured with none left out")
    parser.add_argument("--attacker-nice", type=int, default=19, help="the attacker's client process's session "
                        "priority (it stands for another machine; 0: it competes with the service for this one's CPU)")
    parser.add_argument("--timelines", type=int, default=0, help="print this many of the slowest victim runs "
                        "under attack with their task runs' times, from Prefect")
    parser.add_argument("--flood", action="store_true", help="the attacker ignores Retry-After (beyond its allowed "
                        "rate, outside the target): what refusals cost the replica")
    args = parser.parse_args(argv)
    left_out = {name.strip() for name in args.without.split(",") if name.strip()}
    if left_out - set(ATTACKS):
        parser.error(f"--without: unknown attack(s) {sorted(left_out - set(ATTACKS))}; known: {', '.join(ATTACKS)}")
    attacks = tuple(name for name in ATTACKS if name not in left_out)

    home = Path(tempfile.mkdtemp(prefix="harvest-noisy-"))
    schema, db_url = _pg_schema()
    prefect_db, prefect_url = _prefect_database()
    proc = sampler = None
    try:
        proc, info = _start_stack(home, db_url, prefect_url)
        base = info["ACS_API_BASE"]
        sampler = RssSampler(proc.pid, home)
        sampler.start()
        from api.auth import create_key
        from api.db import make_engine
        from api.settings import ApiSettings

        waiters = ApiSettings().longpoll_max_waiters
        engine = make_engine(db_url)
        victim_key, victim_record = create_key("victim", engine=engine)
        attacker_key, attacker_record = create_key("attacker", engine=engine)
        engine.dispose()
        bodies = attack_bodies(args.scale, args.shard_scale, random.Random(0))
        sizes = ", ".join(f"{k} {len(v) / 2**20:.1f} MiB" for k, v in bodies.items())
        print(f"stack ready: {base}; attacker bodies: {sizes}", flush=True)

        _warm_up(base, victim_key)
        cpu_start = sampler.cpu_by_role()
        load = {"start": os.getloadavg()[0]}  # the host is shared: the ratio is side by side, the load says how busy
        baseline = _phase(base, victim_key, None, args.seconds, bodies, waiters)
        load["baseline"] = os.getloadavg()[0]
        cpu_before = sampler.cpu_by_role()
        print(f"baseline done: {len(baseline.turnaround)} victim jobs, load average {load['baseline']:.1f}", flush=True)
        attack = _phase(base, victim_key, attacker_key, args.seconds, bodies, waiters, attacks, args.flood,
                        args.attacker_nice)
        load["attack"] = os.getloadavg()[0]
        cpu_attack = sampler.cpu_by_role()
        print(f"attack done: {len(attack.turnaround)} victim jobs, load average {load['attack']:.1f}", flush=True)

        from sqlalchemy import create_engine, text

        engine = create_engine(db_url)
        with engine.connect() as conn:
            stored = dict(conn.execute(text("SELECT id, key_id FROM jobs")).all())
        keys = {victim_record.id: victim_key, attacker_record.id: attacker_key}
        ended = _drain(base, {job_id: keys[key_id] for job_id, key_id in stored.items()}, args.drain)
        with engine.connect() as conn:  # every inline answer is in: the quota holds are settled
            used = conn.execute(text("SELECT coalesce(sum(activations), 0) FROM usage WHERE key_id = :k"),
                                {"k": attacker_record.id}).scalar_one()
        engine.dispose()
        problems = _check_ledger(db_url, home, ended)
        if int(used) != attack.positions_returned:
            problems.append(f"attacker activation usage {used} != positions its responses carried {attack.positions_returned}")
        sampler.stop.set()

        def p95(values):
            return _percentile(values, 0.95) if values else float("nan")

        reads = lambda r: r.latency.get(("victim", "read"), [])  # noqa: E731
        print(f"\nnoisy neighbour, {args.seconds:.0f} s per phase, attacker scale {args.scale}, shard scale "
              f"{args.shard_scale}: {sizes}; attacks: {', '.join(attacks)}{' (flood: Retry-After ignored)' if args.flood else ''}; 1-min load average at start / end of baseline / end of attack: "
              f"{load['start']:.1f} / {load['baseline']:.1f} / {load['attack']:.1f}\n")
        print("| victim | baseline p50 / p95 | under attack p50 / p95 | p95 ratio |")
        print("|---|---:|---:|---:|")
        for name, before, after in (("submit → done (s)", baseline.turnaround, attack.turnaround),
                                    ("read (ms)", [s * 1000 for s in reads(baseline)], [s * 1000 for s in reads(attack)])):
            ratio = p95(after) / p95(before) if before and after else float("nan")
            print(f"| {name} ({len(before)} / {len(after)}) | {statistics.median(before or [float('nan')]):.2f} / {p95(before):.2f} | "
                  f"{statistics.median(after or [float('nan')]):.2f} / {p95(after):.2f} | {ratio:.2f}× |")
        for name, phase in (("baseline", baseline), ("under attack", attack)):
            steps = _prefect_steps(home, info["PREFECT_UI"], db_url, phase.victim_jobs)
            if steps:
                print(f"victim jobs {name}, from Prefect's states, p50 / max s: " + "; ".join(
                    f"{step} {statistics.median(v):.2f} / {max(v):.2f}" for step, v in steps.items()))
            if args.timelines and phase is attack:
                print("\n".join(_slowest_runs(home, info["PREFECT_UI"], db_url, phase.victim_jobs, args.timelines)))
            if phase.stages:
                waiting, running = zip(*phase.stages)
                print(f"victim jobs {name}: waiting (created → started) p50 {statistics.median(waiting):.2f} s, "
                      f"max {max(waiting):.2f} s; running (started → completed) p50 {statistics.median(running):.2f} s, "
                      f"max {max(running):.2f} s")
        print("\nunder attack, every route:\n")
        print("\n".join(_table(attack)))
        print(f"\nthe attacker's client: its own process and session at nice {args.attacker_nice}, "
              f"{attack.client_cpu_s:.1f} CPU s in the attack phase (not counted below)")
        print("\n| process (role) | processes | peak RSS of one | documented bound | CPU s baseline / attack |\n|---|---:|---:|---|---:|")
        for role, (seen, peak) in sorted(sampler.by_role().items()):
            before_s = cpu_before.get(role, 0.0) - cpu_start.get(role, 0.0)
            cpu_s = cpu_attack.get(role, 0.0) - cpu_before.get(role, 0.0)
            bound = "not the service's: sampled for its CPU" if role == POSTGRES else BOUNDS.get(role) or "none on this branch"
            print(f"| {role} | {seen} | {peak / 2**20:.0f} MiB | {bound} | {before_s:.1f} / {cpu_s:.1f} |")
        statuses = defaultdict(int)
        for body in ended.values():
            statuses[body["status"]] += 1
        print(f"\njobs: {len(ended)} (" + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())) + ")")
        print(f"ledger: {len(problems)} problem(s)" + "".join(f"\n  {p}" for p in problems[:20]))
        failures = baseline.failures + attack.failures
        print(f"5xx other than documented 503s, or no answer: {len(failures)}" + "".join(f"\n  {f}" for f in failures[:20]))
        return 1 if problems or failures else 0
    finally:
        if sampler is not None:
            sampler.stop.set()
        if proc is not None:
            _stop_stack(proc)
        _drop_schema(schema)
        _drop_database(prefect_db)


if __name__ == "__main__":
    sys.exit(main())
