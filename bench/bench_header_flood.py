"""Header floods against an API replica (issue 44, item 3): what they cost it, and another key.

Two loads, each for `--seconds`, from an attacker process of its own at nice 19 (it stands for
other machines: it takes only the CPU the stack leaves), with no key:

- flood: `--flood` connections (500) each sending one header line that never ends, 16 KiB a
  write as fast as the replica reads; a connection the replica cuts is opened again at once.
- half-open: `--half-open` connections (5,000) each sending a request line and one header, then
  nothing; one the replica closes is opened again at once.

Meanwhile two victims, other keys, read their done jobs (`GET /v1/harvest/{id}`, 5 a second
each): one on a new connection each time, one on a kept connection (httpx's pool; uvicorn
keeps an idle one 5 s), as they did just before at idle. Reported per load: the replica's peak
RSS above its idle RSS (psutil, every 0.1 s; target ≤ 64 MiB), each victim's p50/p95 against
idle (target p95 ≤ 2×), and what the attacker saw (connections opened, cut, answers).

The replica is `harvest up`'s, as `make run` starts it (`api.http_server`: h11, heads bounded).
Beside it, on the same stack (job store, Prefect, workers), the bench starts the command every
replica ran before (`python -m uvicorn --factory api.app:create_app`: httptools, as uvicorn
picks it when installed) and puts it through the same loads, with each flood connection held
at `--former-cap` bytes (its replica would take any amount; 64 MB grew it by 64 MB). Then what
the parser costs on a quiet stack, side by side, alternating between the two replicas:
`GET /health` on a kept connection (500 each, the HTTP layer alone), a warm
2-prompt job's submit-to-done (`--jobs` each, read every 0.2 s) and `/v1/completions`
(`--inline` each; p50/p95).

The attacker needs a file descriptor a connection: the bench raises its soft RLIMIT_NOFILE to
the hard limit before it starts anything (the stack inherits it) and prints both, and the
replica's.

    .venv/bin/python bench/bench_header_flood.py [--seconds 30] [--flood 500] [--half-open 5000]
    .venv/bin/python bench/bench_header_flood.py --base http://HOST:PORT/v1 --key KEY --pid PID
        (a replica already running, e.g. `harvest api`: its loads only, no comparison)

Exits 1 when the shipped replica misses a target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 1 << 20
TERMINAL = ("done", "failed", "cancelled")
FORMER = "python -m uvicorn --factory api.app:create_app (httptools)"
SHIPPED = "harvest up's replica (api.http_server, h11 bounded)"


# --- the attacker (a process of its own) -----------------------------------------------------

async def _connect(host: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _answer(sock: socket.socket, wait_s: float) -> str:
    """The status of what the replica sent back ("none": nothing, or lost to its reset)."""
    try:
        answer = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 64), wait_s)
    except (OSError, asyncio.TimeoutError):
        return "none"
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") and answer.count(b" ") >= 2 else "none"


async def _until_stop_or(work, stop: asyncio.Event) -> asyncio.Future:
    """Wait for `work` or the end of the load, whichever comes first; `work`'s future (cancelled
    if the load ended first)."""
    work, ended = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait([work, ended], return_when=asyncio.FIRST_COMPLETED)
    for future in (work, ended):
        if not future.done():
            future.cancel()
    return work


async def _flood_one(host: str, port: int, cap: int, stop: asyncio.Event, stats: dict) -> None:
    """One header line that never ends (up to `cap` bytes, then held); opened again when cut.
    `sent` counts what the kernel took (the replica's reads plus the sockets' buffers)."""
    loop = asyncio.get_running_loop()
    prefix, chunk = b"GET /v1/models HTTP/1.1\r\nHost: bench\r\nX-Flood: ", b"a" * (16 << 10)
    while not stop.is_set():
        try:
            sock = await _connect(host, port)
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(0.1)
            continue
        stats["opened"] += 1
        sent = 0
        try:
            await loop.sock_sendall(sock, prefix)
            while sent < cap and not stop.is_set():
                await loop.sock_sendall(sock, chunk)
                sent += len(chunk)
            if sent >= cap:  # held, as the former replica keeps it: until the end, or a close
                stats["held"] += 1
                await _until_stop_or(loop.sock_recv(sock, 1), stop)
        except OSError:
            pass
        stats["sent"] += sent
        if not stop.is_set():
            stats["cut"] += 1
            status = await _answer(sock, 0.2)
            stats["answers"][status] = stats["answers"].get(status, 0) + 1
        sock.close()


async def _half_open_one(host: str, port: int, stop: asyncio.Event, stats: dict) -> None:
    """A request line and one header, then nothing, until the replica answers or closes;
    opened again then."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            sock = await _connect(host, port)
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(1)
            continue
        stats["opened"] += 1
        stats["open_now"] += 1
        stats["open_peak"] = max(stats["open_peak"], stats["open_now"])
        try:
            await loop.sock_sendall(sock, b"GET /v1/harvest HTTP/1.1\r\nHost: bench\r\n")
            read = await _until_stop_or(loop.sock_recv(sock, 64), stop)
            if read.done() and not read.cancelled() and not stop.is_set():
                stats["cut"] += 1
                answer = read.result() if not read.exception() else b""
                status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
                stats["answers"][status] = stats["answers"].get(status, 0) + 1
        except OSError:
            if not stop.is_set():
                stats["cut"] += 1
        stats["open_now"] -= 1
        sock.close()


async def _attack(kind: str, host: str, port: int, connections: int, seconds: float, cap: int) -> dict:
    stats = {"opened": 0, "cut": 0, "sent": 0, "held": 0, "connect_errors": 0, "open_now": 0, "open_peak": 0, "answers": {}}
    stop = asyncio.Event()
    tasks = []
    for n in range(connections):  # 250 new connections every 50 ms: within the listen backlog
        one = _flood_one(host, port, cap, stop, stats) if kind == "flood" else _half_open_one(host, port, stop, stats)
        tasks.append(asyncio.ensure_future(one))
        if n % 250 == 249:
            await asyncio.sleep(0.05)
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    stats.pop("open_now")
    return stats


def attacker_main(args: argparse.Namespace) -> None:
    os.nice(19)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    stats = asyncio.run(_attack(args.attacker, "127.0.0.1", args.port, args.connections, args.seconds, args.cap))
    print(json.dumps(stats), flush=True)


# --- measuring --------------------------------------------------------------------------------

class RssSampler(threading.Thread):
    """The replica's RSS every 0.1 s; `peak_since(mark)`."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.process.memory_info().rss))
            except psutil.Error:
                return
            self.stop.wait(0.1)

    def now(self) -> int:
        return self.process.memory_info().rss

    def peak_since(self, since: float) -> int:
        return max((rss for at, rss in self.samples if at >= since), default=self.now())


def victim_reads(base: str, key: str, job_id: str, seconds: float, kept: bool, per_s: float = 5.0) -> tuple[list[float], int]:
    """GET the job every 1/per_s s, on a new connection each or on one `kept` (uvicorn keeps
    an idle one 5 s); (latencies in ms, failures)."""
    latencies, failures = [], 0
    limits = httpx.Limits(max_keepalive_connections=None if kept else 0)
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30, limits=limits) as client:
        deadline = time.monotonic() + seconds
        while (now := time.monotonic()) < deadline:
            try:
                answer = client.get(f"{base}/harvest/{job_id}")
                if answer.status_code == 200:
                    latencies.append((time.monotonic() - now) * 1000)
                else:
                    failures += 1
            except httpx.HTTPError:
                failures += 1
            time.sleep(max(0.0, now + 1 / per_s - time.monotonic()))
    return latencies, failures


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _victims(base: str, victims: list[tuple[str, str]], seconds: float) -> dict[bool, tuple[list[float], int]]:
    """Both victims at once: the first on new connections, the second on a kept one."""
    out: dict[bool, tuple[list[float], int]] = {}
    threads = [threading.Thread(target=lambda kept=kept, key=key, job=job: out.__setitem__(kept, victim_reads(base, key, job, seconds, kept)))
               for kept, (key, job) in ((False, victims[0]), (True, victims[1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def run_load(kind: str, base: str, port: int, pid: int, victims: list[tuple[str, str]], args, cap: int) -> dict:
    """Idle reads, then the load with the same reads; the figures of both."""
    sampler = RssSampler(pid)
    sampler.start()
    try:
        time.sleep(1)
        idle_rss = sampler.now()
        idle = _victims(base, victims, args.idle_seconds)
        connections = args.flood if kind == "flood" else args.half_open
        attacker = subprocess.Popen([sys.executable, __file__, "--attacker", kind, "--port", str(port), "--connections",
                                     str(connections), "--seconds", str(args.seconds), "--cap", str(cap)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
        started = time.monotonic()
        time.sleep(2)  # the connections open
        loaded = _victims(base, victims, args.seconds - 2)
        stats = json.loads(attacker.communicate(timeout=args.seconds + 90)[0].strip().splitlines()[-1])
        peak = sampler.peak_since(started)
        time.sleep(2)
        after = sampler.now()
    finally:
        sampler.stop.set()
    figures = {"kind": kind, "connections": connections, "idle_rss": idle_rss, "peak_rss": peak, "after_rss": after, "attacker": stats}
    for kept, name in ((False, "new"), (True, "kept")):
        (quiet, quiet_failures), (busy, busy_failures) = idle[kept], loaded[kept]
        figures[name] = {"idle_p50": _p(quiet, 0.5), "idle_p95": _p(quiet, 0.95), "p50": _p(busy, 0.5), "p95": _p(busy, 0.95),
                         "n": len(busy), "failures": busy_failures + quiet_failures}
    return figures


def _job(client: httpx.Client, base: str, prompts: list[str], poll_s: float | None = None) -> tuple[str, float]:
    """A job to done: (its id, submit to done in s). Long-polled, or read every `poll_s` (the
    side by side: a long-poll is woken by the replica holding the watcher's lease, which only
    one of the two does, so the other would wait for its own check)."""
    started = time.monotonic()
    job = client.post(f"{base}/harvest", json={"model": "llama-tiny", "prompts": prompts, "layers": [2, 5]})
    job.raise_for_status()
    job_id = job.json()["job_id"]
    params = {"wait": 20} if poll_s is None else {}
    while (body := client.get(f"{base}/harvest/{job_id}", params=params).json())["status"] not in TERMINAL:
        if poll_s:
            time.sleep(poll_s)
    assert body["status"] == "done", body
    return job_id, time.monotonic() - started


def side_by_side(bases: dict[str, str], keys: dict[str, str], jobs: int, inline: int) -> dict[str, dict]:
    """Warm jobs' submit-to-done and inline completions' latency, alternating between replicas."""
    clients = {name: httpx.Client(headers={"Authorization": f"Bearer {keys[name]}"}, timeout=300) for name in bases}
    out = {name: {"jobs": [], "inline": []} for name in bases}
    try:
        for n in range(jobs):
            for name, base in bases.items():
                out[name]["jobs"].append(_job(clients[name], base, [f"side by side {n}", "and a second prompt"], poll_s=0.2)[1])
        for _ in range(10):  # the parser alone: GET /health on a kept connection, 50 at a time each
            for name, base in bases.items():
                for _ in range(50):
                    started = time.perf_counter()
                    clients[name].get(f"{base.removesuffix('/v1')}/health").raise_for_status()
                    out[name].setdefault("health", []).append((time.perf_counter() - started) * 1000)
        body = {"model": "llama-tiny", "prompt": "The capital of France is", "max_tokens": 8, "output_residual_stream": [0]}
        for _ in range(inline):
            for name, base in bases.items():
                started = time.monotonic()
                clients[name].post(f"{base}/completions", json=body).raise_for_status()
                out[name]["inline"].append((time.monotonic() - started) * 1000)
    finally:
        for client in clients.values():
            client.close()
    return out


# --- the stack -------------------------------------------------------------------------------

def _listener(port: int) -> int:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise RuntimeError(f"nothing listens on {port}")


@contextmanager
def former_replica(home: Path, prefect_ui: str):
    """The command every replica ran before, on the same stack: (base, pid)."""
    from fleet.processes import free_port
    from flows.prefect_auth import CLIENT_ENV, client_auth

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HARVEST_", "ACS_"))}
    env.update(HARVEST_HOME=str(home), PREFECT_HOME=str(home / "prefect"), HARVEST_PORT=str(port),
               PREFECT_API_URL=f"{prefect_ui}/api", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env[CLIENT_ENV] = client_auth(home) or ""
    log = open(home / "former-api.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--host", "127.0.0.1",
                             "--port", str(port), "--no-proxy-headers"], cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (home / "former-api.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _keys(home: Path, count: int) -> list[str]:
    from api.auth import create_key
    from api.db import make_engine

    engine = make_engine(f"sqlite:///{home / 'harvest.db'}")
    try:
        return [create_key(f"flood-{n}", engine=engine)[0] for n in range(count)]
    finally:
        engine.dispose()


# --- the report ------------------------------------------------------------------------------

def _row(name: str, r: dict) -> str:
    a = r["attacker"]
    answers = ", ".join(f"{k} ×{v}" for k, v in sorted(a["answers"].items())) or "none"
    seen = f"opened {a['opened']:,}, cut {a['cut']:,} ({answers})"
    if r["kind"] == "flood":
        seen += f", {a['sent'] / MIB:,.0f} MiB sent (socket buffers included), {a['held']} held at the cap"
    else:
        seen += f", at most {a['open_peak']:,} open at once"
    if a["connect_errors"]:
        seen += f", {a['connect_errors']:,} connects refused"
    new, kept = r["new"], r["kept"]
    return (f"| {name} | {r['kind']} ×{r['connections']:,} | {r['idle_rss'] / MIB:,.0f} | "
            f"+{(r['peak_rss'] - r['idle_rss']) / MIB:,.1f} | +{(r['after_rss'] - r['idle_rss']) / MIB:,.1f} | "
            f"{new['idle_p50']:.1f} / {new['idle_p95']:.1f} → {new['p50']:.1f} / {new['p95']:.1f} (**{new['p95'] / new['idle_p95']:.2f}×**) | "
            f"{kept['idle_p50']:.1f} / {kept['idle_p95']:.1f} → {kept['p50']:.1f} / {kept['p95']:.1f} (**{kept['p95'] / kept['idle_p95']:.2f}×**) | "
            f"{new['failures'] + kept['failures']} of {new['n'] + kept['n']} | {seen} |")


def report(results: list[tuple[str, dict]], sides: dict | None) -> bool:
    print("\n| replica | load | idle RSS MiB | peak above idle MiB | 2 s after | victim on new connections: p50 / p95 ms, idle → loaded | "
          "victim on a kept connection: the same | victim failures | attacker saw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    for name, r in results:
        print(_row(name, r))
        if name == SHIPPED:
            ok &= r["peak_rss"] - r["idle_rss"] <= 64 * MIB
            ok &= all(r[v]["p95"] <= 2 * r[v]["idle_p95"] and r[v]["failures"] == 0 for v in ("new", "kept"))
    if sides:
        print("\n| replica | `GET /health`, kept connection: p50 / p95 ms (n) | warm 2-prompt job, submit to done s "
              "(median; each) | inline p50 / p95 ms (n) |")
        print("|---|---:|---|---:|")
        for name, side in sides.items():
            jobs, health = side["jobs"], side["health"]
            each = ", ".join(f"{j:.2f}" for j in jobs)
            print(f"| {name} | {_p(health, 0.5):.2f} / {_p(health, 0.95):.2f} ({len(health)}) | {statistics.median(jobs):.2f} ({each}) | "
                  f"{_p(side['inline'], 0.5):.1f} / {_p(side['inline'], 0.95):.1f} ({len(side['inline'])}) |")
    print("\ntargets (shipped replica: peak ≤ 64 MiB above idle, victims' p95 ≤ 2× idle, no failures):", "met" if ok else "MISSED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30, help="each load's length")
    parser.add_argument("--idle-seconds", type=float, default=20, help="the victim's idle reads before each load")
    parser.add_argument("--flood", type=int, default=500)
    parser.add_argument("--half-open", type=int, default=5000)
    parser.add_argument("--former-cap", type=int, default=1 << 20, help="bytes a flood connection sends the former replica")
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--inline", type=int, default=40)
    parser.add_argument("--base"), parser.add_argument("--key"), parser.add_argument("--pid", type=int)
    # the attacker process
    parser.add_argument("--attacker", choices=["flood", "half-open"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, default=1 << 62, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attacker:
        attacker_main(args)
        return 0

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"RLIMIT_NOFILE: soft {soft} raised to {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} (hard {hard})", flush=True)
    unbounded = 1 << 62
    results: list[tuple[str, dict]] = []
    sides = None
    if args.base:
        from urllib.parse import urlparse

        # its own jobs for the reads (both victims with the one key: each at half its read rate)
        with httpx.Client(headers={"Authorization": f"Bearer {args.key}"}, timeout=300) as client:
            victims = [(args.key, _job(client, args.base, [f"a job to read {n}", "and a second prompt"])[0]) for n in range(2)]
        port = urlparse(args.base).port
        for kind in ("flood", "half-open"):
            results.append((SHIPPED, run_load(kind, args.base, port, args.pid, victims, args, unbounded)))
        return 0 if report(results, None) else 1

    from bench.stack import harvest_up

    with tempfile.TemporaryDirectory(prefix="header-flood-") as tmp, ExitStack() as stack:
        home = Path(tmp)
        base, _ = stack.enter_context(harvest_up(home))
        prefect_ui = json.loads((home / "stack.json").read_text())["PREFECT_UI"]
        former_base, former_pid = stack.enter_context(former_replica(home, prefect_ui))
        shipped_pid = _listener(int(base.rsplit(":", 1)[1].split("/")[0]))
        print(f"replica fd limits: shipped {psutil.Process(shipped_pid).rlimit(psutil.RLIMIT_NOFILE)}, "
              f"former {psutil.Process(former_pid).rlimit(psutil.RLIMIT_NOFILE)}", flush=True)
        *victim_keys, shipped_key, former_key = _keys(home, 4)
        victims = []
        for key in victim_keys:  # the engines warm up too
            with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
                job_id, took = _job(client, base, ["a job to read", "and a second prompt"])
            victims.append((key, job_id))
            print(f"a victim's job done in {took:.1f} s", flush=True)
        bases = {SHIPPED: base, FORMER: former_base}
        side_by_side(bases, {SHIPPED: shipped_key, FORMER: former_key}, 1, 2)  # both replicas' inline engines warm
        sides = side_by_side(bases, {SHIPPED: shipped_key, FORMER: former_key}, args.jobs, args.inline)
        for name, replica_base, pid, cap in ((SHIPPED, base, shipped_pid, unbounded), (FORMER, former_base, former_pid, args.former_cap)):
            port = int(replica_base.rsplit(":", 1)[1].split("/")[0])
            for kind in ("flood", "half-open"):
                print(f"{name}: {kind} …", flush=True)
                results.append((name, run_load(kind, replica_base, port, pid, victims, args, cap)))
                print(_row(name, results[-1][1]), flush=True)
    return 0 if report(results, sides) else 1


if __name__ == "__main__":
    sys.exit(main())
