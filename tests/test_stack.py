"""`make run` as a user meets it, one stack for the whole module: it starts, says it is ready,
keeps its control plane closed (Prefect's API answers 401 without the password it generated),
restarts an API that was killed without touching the rest, serves the documented curl and
Python examples (unchanged but for `"model": "llama-tiny"` and its layers), lets a second API
killed and restarted mid-job follow the same flow run and charge once, finds and cancels a
job's runs by its tag, fires a cron schedule by itself, runs a harvest submitted over HTTP,
and stops on SIGTERM leaving no process behind. The tests run in this order; the last one
stops the stack.

It runs `make run` when the install stamp is current (`make -q install`), else the command
`make run` ends in (`.venv/bin/harvest up`), so the test never reinstalls the environment.
Everything lives in a fresh HARVEST_HOME on free ports, apart from the session's stack.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import psutil
import pytest

from testbed import http_calls
from tests.api_fixtures import PRODUCTION_APP, ApiServer

REPO = Path(__file__).resolve().parent.parent
READY = ("ACS_API_BASE", "ACS_API_KEY", "PREFECT_UI")

# 002_… "Download the files", step 3, verbatim.
DOWNLOAD_PROGRAM = '''
import os

import requests
from safetensors.torch import load_file

API_BASE = os.environ["ACS_API_BASE"]
HEADERS = {"Authorization": f"Bearer {os.environ['ACS_API_KEY']}"}
JOB_ID = os.environ["JOB_ID"]

answer = requests.get(f"{API_BASE}/harvest/{JOB_ID}", headers=HEADERS, timeout=60)
answer.raise_for_status()
result = answer.json()["result"]

for index, url in enumerate(result["shard_urls"]):
    with requests.get(url, stream=True, timeout=600) as shard:
        shard.raise_for_status()
        with open(f"shard_{index:05d}.safetensors", "wb") as file:
            for chunk in shard.iter_content(chunk_size=1 << 20):
                file.write(chunk)

tensors = load_file("shard_00000.safetensors")
print(tensors["prompt_0"].dtype, tuple(tensors["prompt_0"].shape))
print(tensors["tokens_0"].tolist())
'''

# 002_… "Read the manifest and the statistics", verbatim.
MANIFEST_PROGRAM = '''
import os

import requests
from safetensors.torch import load

API_BASE = os.environ["ACS_API_BASE"]
HEADERS = {"Authorization": f"Bearer {os.environ['ACS_API_KEY']}"}
JOB_ID = os.environ["JOB_ID"]

answer = requests.get(f"{API_BASE}/harvest/{JOB_ID}", headers=HEADERS, timeout=60)
answer.raise_for_status()
result = answer.json()["result"]

manifest = requests.get(result["manifest_url"], timeout=60).json()
print(manifest["layer_indices"], manifest["residual_stream_convention"])

stats = load(requests.get(result["stats_url"], timeout=60).content)
print(stats["mean"].shape, stats["std"].shape)
'''


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

    @property
    def base(self) -> str:
        return self.lines["ACS_API_BASE"]

    @property
    def key(self) -> str:
        return self.lines["ACS_API_KEY"]

    @property
    def prefect_api_url(self) -> str:
        return json.loads((self.home / "stack.json").read_text())["prefect_api_url"]

    @property
    def prefect_auth(self) -> str:
        return (self.home / "prefect-auth").read_text().strip()


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


def _curl(*args: str) -> dict:
    out = subprocess.run(["curl", "-s", *args], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_seed_examples_against_make_run(stack, tmp_path):
    base, key = stack.base, stack.key
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base) and key.startswith("acs_")
    # 002_… "Submit a harvest", with the tiny model and layers it has.
    job = _curl(f"{base}/harvest", "-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json",
                "-d", '{"model": "llama-tiny", "prompts": ["The sky is", "Grass is"], "layers": [2, 4, 6]}')
    assert job["status"] == "pending" and job["n_prompts"] == 2 and job["layers"] == [2, 4, 6], job
    deadline = time.monotonic() + 180
    while job["status"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        job = _curl(f"{base}/harvest/{job['job_id']}?wait=60", "-H", f"Authorization: Bearer {key}")
    assert job["status"] == "done", job
    assert job["tokens"] == job["result"]["tokens"] > 0 and job["started_at"] and job["completed_at"]

    env = {**os.environ, "ACS_API_BASE": base, "ACS_API_KEY": key, "JOB_ID": job["job_id"]}
    out = subprocess.run([sys.executable, "-c", DOWNLOAD_PROGRAM], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    match = re.fullmatch(r"torch\.bfloat16 \(3, (\d+), (\d+)\)", first)
    assert match, first
    ids = json.loads(second)
    assert len(ids) == int(match.group(1)) and all(isinstance(i, int) for i in ids)
    from harvest.tokenize import load_tokenizer

    tokenizer = load_tokenizer(stack.home / "models" / "llama-tiny")
    assert ids == tokenizer("The sky is")["input_ids"]  # BOS included, the ids that ran
    assert int(match.group(2)) == json.loads((stack.home / "models" / "llama-tiny" / "config.json").read_text())["hidden_size"]

    out = subprocess.run([sys.executable, "-c", MANIFEST_PROGRAM], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[2, 4, 6] Layer k is the output of decoder block k")
    assert "torch.Size([3," in out.stdout


def test_api_killed_mid_job_follows_the_same_flow_run(stack):
    """A second API on the stack's Prefect (own job store): kill -9 it right after a submit,
    restart it, and the job ends done through the same flow run, charged once."""
    from sqlalchemy import text

    home = stack.home
    server = ApiServer(home, f"restart-{uuid.uuid4().hex[:6]}", {
        "PREFECT_API_URL": stack.prefect_api_url,
        "PREFECT_API_AUTH_STRING": stack.prefect_auth,
        "HARVEST_STORAGE_URL": f"file://{home / 'storage'}",
        "HARVEST_WATCH_INTERVAL_S": "0.5",
    }, app=PRODUCTION_APP).start()
    try:
        key = server.make_key(name="restart")
        auth = {"Authorization": f"Bearer {key}"}
        submitted = http_calls.post(f"{server.base_url}/harvest", headers=auth, timeout=60, json={
            "model": "llama-tiny", "prompts": [f"prompt number {i}" for i in range(40)], "shard_size": 4})
        assert submitted.status_code == 202, submitted.text
        job_id, run_id = submitted.json()["job_id"], submitted.json()["run_id"]
        server.kill()
        server.start()
        first = http_calls.get(f"{server.base_url}/harvest/{job_id}", headers=auth).json()
        assert first["status"] in ("pending", "running", "done"), first
        deadline = time.monotonic() + 180
        body = first
        while body["status"] not in ("done", "failed", "cancelled"):
            assert time.monotonic() < deadline, body
            body = http_calls.get(f"{server.base_url}/harvest/{job_id}", headers=auth, params={"wait": 30}, timeout=60).json()
        assert body["status"] == "done", body
        assert body["run_id"] == run_id  # the same flow run, re-attached, not a new one
        assert body["tokens"] == body["result"]["tokens"] > 0
        assert body["progress"] == {"shards_done": 10, "n_shards": 10}
        # Charged once, by the ledger (one row, ever, for the job), with the tokens the job's own
        # manifest counts: not the jobs.tokens column the same code wrote.
        manifest = json.loads((home / "storage" / "jobs" / job_id / "manifest.json").read_text())
        engine = server.engine()
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT job_id, outcome, tokens_charged FROM charge_ledger")).all()
        engine.dispose()
        assert [tuple(r) for r in rows] == [(job_id, "done", manifest["tokens"])]
        assert body["tokens"] == manifest["tokens"]
    finally:
        server.stop()


def test_a_jobs_runs_are_found_and_cancelled_by_its_tag(stack):
    """What a failed start relies on (`api.routes.harvest._submit`, the watcher's `stop_run`): the
    run Prefect created is found by the job's tag alone, with no run id, and cancelled, within
    seconds even when the cancel comes as its worker takes it (the run's process then exits
    before it runs, and its worker finishes the cancel: `fleet.pool_worker.finish_cancel`;
    without that, 6 of 22 such cancels waited 63-65 s for `flows.liveness`)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.submit import cancel_job_runs, start_harvest_run

    with temporary_settings({PREFECT_API_URL: stack.prefect_api_url, PREFECT_API_AUTH_STRING: stack.prefect_auth}):
        for delay in (0.0, 0.0, 0.1):  # as the worker takes the run (Pending, Submitting)
            job_id = str(uuid.uuid4())
            run_id = start_harvest_run(job_id, "file:///nowhere/request.json", "llama-tiny", "small", "key-tag-test")
            time.sleep(delay)
            assert cancel_job_runs(job_id) == 1
            assert cancel_job_runs(str(uuid.uuid4())) == 0  # another job's tag finds nothing
            deadline = time.monotonic() + 20
            with get_client(sync_client=True) as client:
                while (state := client.read_flow_run(uuid.UUID(run_id)).state).type.value != "CANCELLED":
                    assert state.type.value in ("CANCELLING", "CANCELLED"), state
                    assert time.monotonic() < deadline, state
                    time.sleep(0.5)


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
