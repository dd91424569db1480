"""Peak RSS of each process of `make run` under the legal request that costs it most.

    .venv/bin/python bench/memory_worst.py [--prompts 64] [--inline 64] [--slow-readers 64] [--bodies 8]
        [--bodies-model llama-tiny] [--only shard,inline,slowread,bodies]

Starts `harvest up` as shipped (`bench.stack.harvest_up`: the roles and their defaults, a home
of its own, SQLite job store, local storage, llama-tiny) and sends, one phase at a time so each
peak belongs to its request, the worst legal request of each process kind, derived from the
documented limits (README, "Bounds"):

1. engine server and flow run: one harvest of `--prompts` prompts at the model's context
   (`max_model_len`, 2,048 tokens for llama-tiny; each prompt 16,384 characters, cut to it),
   `layers: "all"`, `shard_size` 4096: every prompt in ONE shard, the largest shard bytes a
   prompt count gives (at 976 prompts, 2,000,000 tokens, the per-job cap: ~8 GB). The server's
   peak is one forward pass of `HARVEST_ENGINE_BATCH_TOKENS` and its captures, whatever the
   shard's length: the bench prints the server's RSS after every eighth of the job, so a
   growth with the prompts shows (issue 36 saw 2,390 MiB at 244 prompts, 2,040-3,287 at 488);
2. inline engine and API replica: `--inline` concurrent completions of one token generating
   2,047 (prompt + generation = `max_model_len`) with every layer's residual stream: 8 MiB a
   response as counted by `HARVEST_INLINE_RESPONSE_BUDGET_BYTES` (512 MiB: 64 in flight), in
   batches of the inline batcher's 65,536 tokens (32 rows); spread over keys to stay within
   each key's submit burst;
3. API replica, slow readers: `--slow-readers` inline completions like phase 2's, each sent on
   a socket (4 KiB receive buffer) that reads nothing for `--slow-hold` s, past two of the
   server's send timeout (`api.send_timeout`); meanwhile another key's completion, read as
   usual. Prints what the slow sockets found when they read at last (cut or still open);
4. API replica and its assessing children: `--bodies` concurrent 48 MiB submits (4,000 prompts
   of 12,000 characters, under the 50 MB body cap, refused for their tokens), two per key, of
   `--bodies-model` (llama-tiny's refused from their characters; smollm2-135m's, whose longest
   token is 81 characters, counted by the tokenizer to the cap first, and its checkpoint built
   on its first submit). Another key reads its own job (`GET /v1/harvest/{id}`, every 150 ms,
   a process of its own) for `--idle-reads` s before the flood and all through it: read p50/p95
   idle and during, side by side (target: p95 within 2×). Its job, of the bodies' model, is
   submitted first (and cancelled), so a model built on first use is built before the reads.

`--only` runs some phases (comma-separated), e.g. `--only bodies`.

Every process of the stack (its tree, plus detached ones whose HARVEST_HOME is the stack's) is
sampled every 0.1 s with psutil (RSS of each process by itself, children counted as processes
of their own role, as the README's table does). Prints a table per phase and overall, and the
engine server's RSS a few seconds after its shard ended. On the shared 2-core dev box the
defaults take far longer than 10 minutes (the engine server and the inline engine run at a
lower CPU priority and wait for the other suites); `--prompts 24 --inline 32 --inline-tokens
256` took 9 minutes there (bench/RESULTS.md, "Memory of each process").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.noisy_neighbour import POSTGRES, _role, _text  # noqa: E402 - after the path
from bench.stack import harvest_up  # noqa: E402

MiB = 1 << 20
TERMINAL = {"done", "failed", "cancelled"}


class Sampler(threading.Thread):
    """Peak RSS per process of the stack, per phase; the engine server's RSS over time."""

    def __init__(self, home: Path, interval: float = 0.1):
        super().__init__(daemon=True)
        self.home = str(home)
        self.interval = interval
        self.phase = "start"
        self.peaks: dict[str, dict[int, tuple[str, int]]] = defaultdict(dict)  # phase -> pid -> (role, peak)
        self.latest: dict[int, tuple[str, int]] = {}
        self.stop = threading.Event()
        self._ours: dict[int, bool] = {}
        self._roles: dict[int, tuple[tuple[str, ...], str]] = {}  # pid -> (command line, role)

    def members(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter():
            if process.pid not in self._ours:
                try:
                    self._ours[process.pid] = process.environ().get("HARVEST_HOME") == self.home
                except psutil.Error:
                    self._ours[process.pid] = False
            if self._ours[process.pid]:
                found.append(process)
        return found

    def run(self) -> None:
        while not self.stop.is_set():
            latest = {}
            for process in self.members():
                try:
                    rss = process.memory_info().rss
                except psutil.Error:
                    continue
                role = self._role(process)
                if role in ("gone", POSTGRES):
                    continue
                latest[process.pid] = (role, rss)
                peaks = self.peaks[self.phase]
                peaks[process.pid] = (role, max(peaks.get(process.pid, (role, 0))[1], rss))
            self.latest = latest
            self.stop.wait(self.interval)

    def _role(self, process: psutil.Process) -> str:
        """The process's role, read again whenever its command line changes: a child seen
        between its fork and its exec still shows its parent's (an engine server started by a
        run would otherwise be counted as a run for good)."""
        try:
            command = tuple(process.cmdline())
        except psutil.Error:
            return "gone"
        known = self._roles.get(process.pid)
        if known is None or known[0] != command:
            known = self._roles[process.pid] = (command, _role(process))
        return known[1]

    def now(self, role: str) -> int:
        """The largest current RSS of a process of `role` (0 when none runs)."""
        return max((rss for r, rss in self.latest.values() if r == role), default=0)

    def by_role(self, phase: str | None = None) -> dict[str, tuple[int, int]]:
        """role -> (processes seen, largest peak of one), in `phase` or over all phases."""
        merged: dict[int, tuple[str, int]] = {}
        for name, pids in self.peaks.items():
            if phase is not None and name != phase:
                continue
            for pid, (role, peak) in pids.items():
                merged[pid] = (role, max(peak, merged.get(pid, (role, 0))[1]))
        roles: dict[str, tuple[int, int]] = {}
        for role, peak in merged.values():
            seen, top = roles.get(role, (0, 0))
            roles[role] = (seen + 1, max(top, peak))
        return roles


def _keys(home: Path, count: int) -> list[str]:
    from api.auth import create_key
    from api.db import make_engine

    engine = make_engine(f"sqlite:///{home / 'harvest.db'}")
    keys = [create_key(f"memory-{k}", engine=engine)[0] for k in range(count)]
    engine.dispose()
    return keys


def _wait_job(client: httpx.Client, base: str, job_id: str, sampler: Sampler, marks: list[tuple[float, int]]) -> dict:
    while True:
        answer = client.get(f"{base}/harvest/{job_id}", params={"wait": 5})
        if answer.status_code == 429:
            time.sleep(float(answer.headers.get("retry-after", 1)))
            continue
        body = answer.json()
        marks.append((time.monotonic(), sampler.now("engine-server")))
        if body["status"] in TERMINAL:
            return body


def phase_shard(base: str, key: str, prompts: int, sampler: Sampler) -> list[str]:
    sampler.phase = "shard"
    rng = random.Random(0)
    at_context = _text(2048 * 8, rng)  # past the context: cut to max_model_len tokens
    body = {"model": "llama-tiny", "prompts": [f"{k} {at_context}" for k in range(prompts)], "layers": "all", "shard_size": 4096}
    lines = []
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        started = time.monotonic()
        answer = client.post(f"{base}/harvest", json=body)
        if answer.status_code != 202:
            raise RuntimeError(f"the shard's submit: {answer.status_code} {answer.text[:300]}")
        marks: list[tuple[float, int]] = []
        job = _wait_job(client, base, answer.json()["job_id"], sampler, marks)
        wall = time.monotonic() - started
        peak_server = sampler.by_role("shard").get("engine-server", (0, 0))[1]
        time.sleep(3)
        after = sampler.now("engine-server")
        if job["status"] != "done":
            raise RuntimeError(f"the shard's job ended {job['status']}: {json.dumps(job)[:500]}")
        shards = job["result"]["shard_urls"] if job.get("result") else []
        manifest = json.loads((Path(sampler.home) / "storage" / "jobs" / job["job_id"] / "manifest.json").read_text())
        (record,) = manifest["shards"]
        tokens = sum(record["token_counts"])
        lines.append(f"shard: {prompts} prompts, {tokens:,} tokens, {record['bytes'] / 1e9:.2f} GB in {len(shards)} shard, "
                     f"{wall:.0f} s; engine server peak {peak_server / MiB:,.0f} MiB, RSS 3 s after the shard "
                     f"{after / MiB:,.0f} MiB")
        # The server's RSS as the job went, at eighths of its time: flat means no growth with the prompts.
        points = [marks[min(len(marks) - 1, int(len(marks) * k / 8))] for k in range(1, 9)]
        lines.append("engine server RSS at eighths of the job (MiB): " + ", ".join(f"{rss / MiB:,.0f}" for _, rss in points))
    return lines


async def _inline(base: str, keys: list[str], count: int, tokens: int) -> list[str]:
    body = {"model": "llama-tiny", "prompt": [7], "max_tokens": tokens, "temperature": 0, "output_residual_stream": True}
    statuses: dict[str, int] = defaultdict(int)

    async def one(client: httpx.AsyncClient, key: str) -> None:
        answer = await client.post(f"{base}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        label = str(answer.status_code)
        if answer.status_code != 200:
            try:
                label += " " + answer.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
        statuses[label] += 1

    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=count + 4)) as client:
        await asyncio.gather(*(one(client, keys[k % len(keys)]) for k in range(count)))
    return [f"inline: {count} completions of 1 + {tokens:,} tokens, every layer: " +
            ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))]


async def _bodies(base: str, keys: list[str], count: int, model: str = "llama-tiny") -> list[str]:
    rng = random.Random(1)
    raw = json.dumps({"model": model, "prompts": [_text(12_000, rng)] * 4000, "layers": "all"}).encode()
    statuses: dict[str, int] = defaultdict(int)

    async def one(client: httpx.AsyncClient, key: str) -> None:
        answer = await client.post(f"{base}/harvest", content=raw,
                                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        label = str(answer.status_code)
        try:
            label += " " + answer.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
        statuses[label] += 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, keys[k // 2 % len(keys)]) for k in range(count)))
    return [f"bodies: {count} submits of {len(raw) / MiB:.1f} MiB, two per key: " +
            ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))]


def _reads(base: str, key: str, job_id: str, stop, out) -> None:
    """Another key's reads (`GET /v1/harvest/{id}`, one every 150 ms: within the key's 10 reads a
    second) until `stop` is set: their (start, seconds, status) in `out`. A process of its own (spawned), so the flood's client, which
    encodes 46 MiB bodies, never delays them."""
    times = []
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        while not stop.is_set():
            started = time.monotonic()
            answer = client.get(f"{base}/harvest/{job_id}")
            times.append((started, time.monotonic() - started, answer.status_code))
            time.sleep(0.15)
    out.put(times)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def phase_bodies(base: str, reader_key: str, keys: list[str], count: int, model: str, idle_s: float) -> list[str]:
    """The body flood, with another key reading its (cancelled) job's status every 150 ms for
    `idle_s` before the flood and all through it: read latency idle vs during, side by side.
    The reader's job is of the bodies' model, so a model built on first use (smollm2-135m) is
    built by its submit, before the reads begin: the flood is measured with the model ready."""
    import multiprocessing

    with httpx.Client(headers={"Authorization": f"Bearer {reader_key}"}, timeout=600) as client:
        started = time.monotonic()
        answer = client.post(f"{base}/harvest", json={"model": model, "prompts": ["The sky is"], "layers": [1]})
        first = time.monotonic() - started
        if answer.status_code != 202:
            raise RuntimeError(f"the reader's submit: {answer.status_code} {answer.text[:300]}")
        job_id = answer.json()["job_id"]
        client.delete(f"{base}/harvest/{job_id}")  # no run of its own competes with the reads
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    reader = context.Process(target=_reads, args=(base, reader_key, job_id, stop, out), daemon=True)
    reader.start()
    time.sleep(2 + idle_s)  # the reader's start, then its idle window
    flood_from = time.monotonic()
    lines = [f"the reader's first submit of {model}: {first:.1f} s (a checkpoint built on first use is built then)"]
    lines += asyncio.run(_bodies(base, keys, count, model))
    flood_to = time.monotonic()
    stop.set()
    times = out.get(timeout=60)
    reader.join(10)
    idle = [s for t, s, status in times if flood_from - idle_s <= t < flood_from and status == 200]
    flood = [s for t, s, status in times if flood_from <= t < flood_to and status == 200]
    other = defaultdict(int)
    for t, _, status in times:
        if status != 200 and t >= flood_from - idle_s:
            other[status] += 1
    row = lambda name, v: f"| {name} | {len(v)} | {_p(v, 0.5) * 1e3:.0f} | {_p(v, 0.95) * 1e3:.0f} | {max(v, default=float('nan')) * 1e3:.0f} |"
    lines += [f"another key's reads (GET /v1/harvest/{{id}}, every 150 ms; 200s counted, others: {dict(other) or 'none'}); "
              f"flood {flood_to - flood_from:.1f} s:",
              "| window | reads | p50 ms | p95 ms | max ms |", "|---|---:|---:|---:|---:|",
              row(f"idle ({idle_s:.0f} s before)", idle), row("during the flood", flood),
              f"p95 during / idle: {_p(flood, 0.95) / _p(idle, 0.95):.1f}×"]
    return lines


async def _slow_readers(base: str, keys: list[str], neighbour_key: str, count: int, tokens: int, hold_s: float) -> list[str]:
    """`count` inline completions with every layer's residual stream, each sent on a socket of
    a 4 KiB receive buffer that never reads a byte for `hold_s` (past two of the server's
    `send_timeout_s`, so its cuts show), spread over `keys`; meanwhile another key's own
    completion, read as usual. The replica holds what its clients have not taken: the sampler
    gives its RSS; here, what the slow sockets saw at the end and what the neighbour got."""
    url = httpx.URL(f"{base}/completions")
    body = json.dumps({"model": "llama-tiny", "prompt": [7], "max_tokens": tokens, "temperature": 0,
                       "output_residual_stream": True}).encode()

    async def open_one(key: str):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (url.host, url.port))
        head = (f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        await asyncio.get_running_loop().sock_sendall(sock, head + body)
        return sock

    socks = [await open_one(keys[k % len(keys)]) for k in range(count)]
    await asyncio.sleep(min(15.0, hold_s / 3))
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:
        answer = await client.post(f"{base}/completions", content=body,
                                   headers={"Authorization": f"Bearer {neighbour_key}", "Content-Type": "application/json"})
    neighbour = f"{answer.status_code} in {time.monotonic() - started:.1f} s ({len(answer.content) / MiB:.1f} MiB)"
    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - started) - min(15.0, hold_s / 3)))
    ends: dict[str, int] = defaultdict(int)
    taken: list[int] = []
    for sock in socks:  # what each slow client finds when it finally reads
        sock.setblocking(True)
        sock.settimeout(2)
        got, first = 0, b""
        try:
            while chunk := sock.recv(1 << 20):
                first, got = first or chunk[:64], got + len(chunk)
            end = "closed"
        except ConnectionResetError:
            end = "reset"
        except TimeoutError:
            end = "still open"
        finally:
            sock.close()
        ends[f"{first.split(b' ', 2)[1].decode(errors='replace') if first else 'nothing'}, {end}"] += 1
        taken.append(got)
    full = f"{len(answer.content) / MiB:.2f} MiB" if answer.status_code == 200 else "not known, the neighbour was refused"
    return [f"slow readers: {count} inline completions of 1 + {tokens:,} tokens, every layer, never read for {hold_s:.0f} s: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(ends.items()))
            + f"; bytes they found waiting: {min(taken) / MiB:.2f}-{max(taken) / MiB:.2f} MiB (a whole body: {full})",
            f"another key's completion meanwhile (read as usual): {neighbour}"]


def _table(sampler: Sampler, phase: str | None) -> list[str]:
    lines = ["| process (role) | processes | peak RSS of one |", "|---|---:|---:|"]
    for role, (seen, peak) in sorted(sampler.by_role(phase).items()):
        lines.append(f"| {role} | {seen} | {peak / MiB:,.0f} MiB |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts of 2,048 tokens in the one shard (976 reach the token cap)")
    parser.add_argument("--inline", type=int, default=64, help="concurrent inline completions (64: the replica's budget)")
    parser.add_argument("--inline-tokens", type=int, default=2047, help="tokens each completion generates (2,047: the context)")
    parser.add_argument("--bodies", type=int, default=8, help="concurrent 48 MiB submits")
    parser.add_argument("--bodies-model", default="llama-tiny", help="the bodies' model")
    parser.add_argument("--idle-reads", type=float, default=10, help="seconds of another key's reads before the flood")
    parser.add_argument("--slow-readers", type=int, default=64, help="inline completions opened and never read")
    parser.add_argument("--slow-hold", type=float, default=75, help="seconds the slow readers read nothing "
                        "(past two of the server's 30 s send timeout)")
    parser.add_argument("--only", default="shard,inline,slowread,bodies", help="phases to run (comma-separated)")
    args = parser.parse_args(argv)
    phases = {name.strip() for name in args.only.split(",")}
    home = Path(tempfile.mkdtemp(prefix="harvest-memory-"))
    report: list[str] = []
    started = time.monotonic()
    with harvest_up(home) as (base, dev_key):
        sampler = Sampler(home)
        sampler.start()
        keys = [dev_key, *_keys(home, 4)]
        time.sleep(2)
        sampler.phase = "idle"
        time.sleep(2)
        report += [f"idle stack: {args.only}", *_table(sampler, "idle"), ""]
        if "shard" in phases:
            report += phase_shard(base, dev_key, args.prompts, sampler)
            print("\n".join(report[-2:]), flush=True)
        if "inline" in phases:
            sampler.phase = "inline"
            report += asyncio.run(_inline(base, keys, args.inline, args.inline_tokens))
            print(report[-1], flush=True)
        if "slowread" in phases:
            sampler.phase = "slowread"
            report += asyncio.run(_slow_readers(base, keys[1:], dev_key, args.slow_readers, args.inline_tokens, args.slow_hold))
            print("\n".join(report[-2:]), flush=True)
        if "bodies" in phases:
            sampler.phase = "bodies"
            report += phase_bodies(base, dev_key, keys[1:], args.bodies, args.bodies_model, args.idle_reads)
            print("\n".join(report[-8:]), flush=True)
        sampler.phase = "end"
        time.sleep(1)
        sampler.stop.set()
        sampler.join()
        for phase in ("shard", "inline", "slowread", "bodies"):
            if phase in phases:
                report += ["", f"phase {phase}:", *_table(sampler, phase)]
        report += ["", "all phases:", *_table(sampler, None)]
    report.append(f"\n{time.monotonic() - started:.0f} s in all; llama-tiny, `harvest up` defaults, 2-core box")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
