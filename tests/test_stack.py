"""`make run` smoke test: the whole stack starts, says it is ready, keeps its control plane
closed (Prefect's API answers 401 without the password it generated), restarts an API that
was killed without touching the rest, runs a harvest submitted over HTTP, and stops on SIGTERM
leaving no process behind. The tests share one stack, in this order.

It runs `make run` when the install stamp is current (`make -q install`), else the command
`make run` ends in (`.venv/bin/harvest up`), so the test never reinstalls the environment.
Everything lives in a fresh HARVEST_HOME on free ports, apart from the session's stack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import psutil
import pytest

from testbed import http_calls

REPO = Path(__file__).resolve().parent.parent
READY = ("ACS_API_BASE", "ACS_API_KEY", "PREFECT_UI")


def _ours(home: Path) -> list[psutil.Process]:
    """Every process whose environment names this stack's HARVEST_HOME."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("HARVEST_HOME") == str(home) and proc.pid != os.getpid():
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _command() -> list[str]:
    up_to_date = subprocess.run(["make", "-q", "install"], cwd=REPO, capture_output=True).returncode == 0
    return ["make", "run"] if up_to_date else [str(REPO / ".venv" / "bin" / "harvest"), "up"]


@dataclass
class Stack:
    proc: subprocess.Popen
    home: Path
    env: dict[str, str]
    lines: dict[str, str]
    errors: list[str]
    ready_s: float


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from fleet.processes import free_port

    home = tmp_path_factory.mktemp("stack") / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "HARVEST_"))}
    env.update(
        HARVEST_HOME=str(home),
        PREFECT_HOME=str(home / "prefect"),
        HARVEST_PORT=str(free_port()),
        HARVEST_PREFECT_PORT=str(free_port()),
        HARVEST_ENGINE="hf",
    )
    home.mkdir()
    started = time.monotonic()
    proc = subprocess.Popen(
        _command(), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: dict[str, str] = {}
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    try:
        for line in proc.stdout:
            key, _, value = line.strip().partition("=")
            if key in READY:
                lines[key] = value
            if len(lines) == len(READY) or time.monotonic() - started > 240:
                break
        assert set(lines) == set(READY), "".join(errors)[-3000:]
        yield Stack(proc, home, env, lines, errors, time.monotonic() - started)
    finally:
        if proc.poll() is None:  # the last test stops it; a failure before it ends here
            os.killpg(proc.pid, signal.SIGKILL)
            for p in _ours(home):
                p.kill()


def _children(stack: Stack, *words: str) -> list[psutil.Process]:
    """The stack's processes whose command line has all these words."""
    return [p for p in _ours(stack.home) if set(words) <= set(p.cmdline())]


def test_the_control_plane_refuses_calls_without_its_password(stack):
    from flows.prefect_auth import basic_header

    secret = stack.home / "prefect-auth"
    assert secret.stat().st_mode & 0o777 == 0o600
    auth = secret.read_text().strip()
    api = stack.lines["PREFECT_UI"] + "/api"
    assert http_calls.post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
    assert http_calls.post(f"{api}/flow_runs/filter", json={}, headers=basic_header("harvest:wrong"), timeout=10).status_code == 401
    answer = http_calls.post(f"{api}/flow_runs/filter", json={}, headers=basic_header(auth), timeout=10)
    assert answer.status_code == 200, answer.text
    assert http_calls.get(f"{api}/health", timeout=5).status_code == 200  # health checks stay open


def test_a_killed_api_comes_back_alone_on_its_port(stack):
    workers = {p.pid for p in _children(stack, "fleet.run_starter", "--socket")}
    server = {p.pid for p in _children(stack, "fleet.prefect_server")}
    (api,) = _children(stack, "api.app:create_app")
    assert len(workers) == 2 and len(server) == 1
    api.kill()  # as the OOM killer would
    health = stack.lines["ACS_API_BASE"].removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, "".join(stack.errors)[-3000:]
        try:
            if http_calls.get(health, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    (again,) = _children(stack, "api.app:create_app")
    assert again.pid != api.pid
    assert {p.pid for p in _children(stack, "fleet.run_starter", "--socket")} == workers
    assert {p.pid for p in _children(stack, "fleet.prefect_server")} == server
    assert stack.proc.poll() is None
    assert any("api exited with -9; restarted" in line for line in stack.errors), "".join(stack.errors)[-3000:]


def _harvest(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    """The `harvest` CLI, as a user types it beside the running stack (same HARVEST_HOME)."""
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "harvest"), *args], cwd=stack.home, env=stack.env, capture_output=True, text=True, timeout=120
    )


def test_a_schedule_fires_by_itself_and_its_dated_part_appears(stack):
    """A cron refresh made with `harvest schedule create` runs with nobody starting it: Prefect's
    scheduler makes the run, a worker of the stack runs it, the dated part lands in storage."""
    from flows.prefect_auth import basic_header

    corpus = stack.home.parent / "every-minute.jsonl"
    lines = [f"scheduled line {i} of the corpus" for i in range(5)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    # Every minute, at the second that comes 15 s from now (cron's optional sixth field): the
    # first run is due then, not at the next minute's boundary (up to 60 s of waiting), and the
    # second a minute later, after this test has deleted the schedule. 15 s leaves Prefect's
    # scheduler (a 5 s loop for new deployments) time to make the run before it is due; a run
    # it made late is due a minute later, within the deadline below.
    second = (int(time.time()) + 15) % 60
    made = _harvest(stack, "schedule", "create", "--corpus", str(corpus), "--model", "llama-tiny", "--layers", "1,3",
                    "--shard-size", "2", "--cron", f"* * * * * {second}", "--name", "every-minute")
    assert made.returncode == 0, made.stderr[-3000:]
    api = stack.lines["PREFECT_UI"] + "/api"
    auth = basic_header((stack.home / "prefect-auth").read_text().strip())
    dated = stack.home / "storage" / "corpus" / "every-minute"

    def runs(*states: str) -> list[dict]:
        answer = http_calls.post(f"{api}/flow_runs/filter", headers=auth, timeout=10, json={
            "deployments": {"name": {"any_": ["every-minute"]}}, "flow_runs": {"state": {"type": {"any_": list(states)}}},
        })
        assert answer.status_code == 200, answer.text
        return answer.json()

    try:
        deadline = time.monotonic() + 150  # its second, a minute later at worst, then the run itself
        while not (done := runs("COMPLETED", "FAILED", "CRASHED")):
            assert time.monotonic() < deadline, f"no scheduled run ended: {runs('SCHEDULED', 'PENDING', 'RUNNING')}"
            time.sleep(2)
        started = runs("PENDING", "RUNNING", "COMPLETED", "FAILED", "CRASHED")
    finally:
        gone = _harvest(stack, "schedule", "delete", "every-minute")  # no more runs behind the next tests
    assert gone.returncode == 0, gone.stderr[-3000:]
    assert [run["state_type"] for run in done] == ["COMPLETED"], done
    # Every run that started was made by Prefect's scheduler, none by a call of ours.
    assert started and all(run["auto_scheduled"] for run in started), started
    day = done[0]["start_time"][:10]  # the UTC day the refresh began names its folder
    part = dated / day / "part-0000"
    manifest = json.loads((part / "manifest.json").read_text())
    assert manifest["n_prompts"] == len(lines) and manifest["layer_indices"] == [1, 3]
    shards = sorted(p.name for p in part.glob("shard_*.safetensors"))
    assert shards == [s["file"] for s in manifest["shards"]] and len(shards) == 3  # 5 prompts, 2 a shard
    assert all((part / name).stat().st_size > 0 for name in shards)


def test_make_run_starts_serves_a_harvest_and_stops_clean(stack):
    proc, home, env, lines = stack.proc, stack.home, stack.env, stack.lines
    try:
        base, key = lines["ACS_API_BASE"], lines["ACS_API_KEY"]
        assert base == f"http://127.0.0.1:{env['HARVEST_PORT']}/v1" and key
        assert http_calls.get(lines["PREFECT_UI"] + "/api/health", timeout=5).status_code == 200
        assert (home / "dev-key").read_text().strip() == key  # kept for the next start

        auth = {"Authorization": f"Bearer {key}"}
        answer = http_calls.post(f"{base}/harvest", headers=auth, json={"model": "llama-tiny", "prompts": ["The sky is", "Grass is"], "layers": [1, 3]}, timeout=30)
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["job_id"]
        deadline = time.monotonic() + 180
        while True:
            body = http_calls.get(f"{base}/harvest/{job_id}", params={"wait": 30}, headers=auth, timeout=60).json()
            if body["status"] in ("done", "failed", "cancelled") or time.monotonic() > deadline:
                break
        assert body["status"] == "done", body
        assert body["result"]["n_shards"] == 1 and body["result"]["tokens"] > 0
        link = body["result"]["shard_urls"][0]
        shard = http_calls.get(link, timeout=30)  # presigned: no key needed
        assert shard.status_code == 200 and len(shard.content) > 0
        # Secrets are owner-only, and no log line holds what forges or replays a link.
        for secret in ("dev-key", "stack.json", "signing.key"):
            assert (home / secret).stat().st_mode & 0o777 == 0o600, secret
        signature = parse_qs(urlparse(link).query)["signature"][0]
        logs = "".join(p.read_text(errors="replace") for p in (home / "logs").glob("*.log"))
        assert f"/v1/files/{job_id}/" in logs and signature not in logs
        print(f"ready in {stack.ready_s:.1f} s")
        assert len(_ours(home)) >= 4  # server, two workers, API (and the supervisor)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what a terminal's process group gets
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for p in _ours(home):
                p.kill()
            pytest.fail("harvest up did not stop within 90 s of SIGTERM")
    # Under `make run`, make itself exits on the signal at once while `harvest up` is still
    # stopping its children (a worker needs two signals): give the stop its time, then require
    # that nothing of ours is left.
    deadline = time.monotonic() + 60
    while (left := _ours(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [(p.pid, p.cmdline()) for p in left]
