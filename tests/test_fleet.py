"""The production topology, end to end (`testbed.topology`): a control plane on PostgreSQL, two API
replicas on one PostgreSQL job store, two worker hosts of the `small` lane in network
namespaces of their own, files on moto's S3 server, nothing else shared.

- Jobs submitted through one replica are read, long-polled and cancelled through the other;
  no status ever goes back; each job is charged once (checked against the manifest the worker
  host wrote and the tokenizer run here, not the column the API charged); the presigned S3
  links download with no key and match the manifest's sha256.
- Progress on S3: two jobs at once, one per host, read through both replicas mid-run, rise
  through every shard count (each job's run reports its count on its flow run as each shard
  lands, and the lease holder's watcher reads it on the run's progress event).
- Host death: every process of the host running a job is SIGKILLed mid-job; Prefect's
  heartbeat automation marks the run Crashed, the lease-holding replica reschedules it, the
  other host resumes it: done, the shards written before the kill untouched (S3
  LastModified), charged once.
- Replica death: the replica holding the watcher lease is SIGKILLed; the other takes the lease
  over within seconds, and a long-poll already waiting on it wakes on the job's next change.
- The control plane is closed: from a worker host's namespace, a call to the Prefect API
  without the password answers 401 (with it, 200); every job above runs with auth on.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import psutil
import psycopg
import pytest

from testbed import http_calls
from tests.api_fixtures import wait_for_longpoll_waiters
from tests.background import Background, start_if_awaited
from tests.slow_engine import slow_shards
from testbed.topology import Fleet

ORDER = {"pending": 0, "running": 1, "done": 2, "failed": 2, "cancelled": 2}


@pytest.fixture(scope="session")  # up while the modules this one runs with run (conftest RUN_TOGETHER)
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    with Fleet(
        root, replicas_n=2, hosts_n=2,
        host_env=slow_shards(1),  # each shard a second longer: tests act mid-job
        replica_env={"HARVEST_WATCH_INTERVAL_S": "0.5", "HARVEST_WATCHER_LEASE_S": "3"},
    ) as fleet:
        yield fleet


def _auth(fleet) -> dict:
    return {"Authorization": f"Bearer {fleet.key}"}


def _submit(fleet, replica, prompts, **fields) -> dict:
    body = {"model": "llama-tiny", "prompts": prompts, "layers": [2, 5], "shard_size": 1, **fields}
    response = http_calls.post(f"{replica.base_url}/harvest", json=body, headers=_auth(fleet), timeout=120)
    assert response.status_code == 202, response.text
    return response.json()


def _get(fleet, replica, job_id, wait: float = 0) -> dict:
    response = http_calls.get(f"{replica.base_url}/harvest/{job_id}", params={"wait": wait} if wait else None,
                              headers=_auth(fleet), timeout=wait + 30)
    assert response.status_code == 200, response.text
    return response.json()


def _until(fleet, replica, job_id, statuses, timeout=240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = _get(fleet, replica, job_id, wait=min(30, max(1, deadline - time.monotonic())))
        if body["status"] in statuses:
            return body
        assert time.monotonic() < deadline, f"job {job_id} still {body['status']} after {timeout} s"


class StatusRecorder:
    """Reads each job through every replica in turn, every 0.2 s, and keeps what it saw."""

    def __init__(self, fleet, job_ids):
        self.fleet, self.seen = fleet, {job: [] for job in job_ids}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for replica in self.fleet.replicas:
                for job in self.seen:
                    try:
                        self.seen[job].append(_get(self.fleet, replica, job)["status"])
                    except Exception:
                        pass  # a replica killed by a test
            time.sleep(0.2)

    def finish(self) -> dict[str, list[str]]:
        self.stop.set()
        self.thread.join()
        return self.seen


def _alive(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _never_back(statuses: list[str]) -> bool:
    return all(ORDER[a] <= ORDER[b] for a, b in zip(statuses, statuses[1:]))


def _charged(fleet, job_id) -> int | None:
    with psycopg.connect(fleet.jobs_url.replace("+psycopg", "")) as conn:
        return conn.execute("SELECT tokens FROM jobs WHERE id = %s", (job_id,)).fetchone()[0]


def _expected_tokens(prompts) -> int:
    """Tokens of the prompts, counted here with the model's own tokenizer (BOS included)."""
    from harvest.registry import load_registry
    from harvest.settings import get_settings
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(load_registry(get_settings()).get("llama-tiny").require_path())
    return sum(len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts)


_PROBE = """
import base64, sys, httpx
headers = {"Authorization": "Basic " + base64.b64encode(sys.argv[2].encode()).decode()} if len(sys.argv) > 2 else {}
print(httpx.post(sys.argv[1] + "/flow_runs/filter", json={}, headers=headers, timeout=10).status_code)
"""


def test_the_control_plane_refuses_a_worker_host_without_its_password(fleet):
    host = fleet.hosts[0].host

    def status(*auth: str) -> int:
        argv = host.argv([sys.executable, "-c", _PROBE, fleet.prefect_api_url, *auth])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=str(fleet.root))
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip())

    assert status() == 401
    assert status("harvest:wrong") == 401
    assert status(fleet.prefect_auth) == 200
    assert (fleet.root / "control-plane" / "prefect-auth").stat().st_mode & 0o777 == 0o600


def test_jobs_cross_replicas_and_hosts_with_status_forward_charges_once_and_s3_links(fleet):
    a, b = fleet.replicas
    assert sorted(r.health()["watcher"] for r in fleet.replicas) == [False, True]  # one follows Prefect
    prompts = [f"The fleet harvests prompt number {i}." for i in range(4)]
    done_job = _submit(fleet, a, prompts)["job_id"]
    cancel_job = _submit(fleet, a, [f"cancel me {i}" for i in range(30)])["job_id"]
    recorder = StatusRecorder(fleet, [done_job, cancel_job])

    running = _until(fleet, b, cancel_job, ("running",))  # long-polled through the other replica
    assert running["started_at"]
    cancelled = http_calls.delete(f"{b.base_url}/harvest/{cancel_job}", headers=_auth(fleet), timeout=60).json()
    assert cancelled["status"] == "cancelled" and cancelled["tokens"] == cancelled["reserved_tokens"]
    assert _get(fleet, a, cancel_job)["status"] == "cancelled"

    body = _until(fleet, b, done_job, ("done", "failed", "cancelled"))
    assert body["status"] == "done", body
    time.sleep(2)  # more watcher ticks: nothing may change any more
    seen = recorder.finish()
    for job, statuses in seen.items():
        assert _never_back(statuses), (job, statuses)
    assert "running" in seen[done_job] or seen[done_job][0] == "done"

    # Presigned links from replica A, fetched with no key at all, match the manifest.
    links = _get(fleet, a, done_job)["result"]
    manifest = http_calls.get(links["manifest_url"], timeout=30)
    assert manifest.status_code == 200
    manifest = manifest.json()
    assert [s["file"] for s in manifest["shards"]] == [f"shard_{k:05d}.safetensors" for k in range(4)]
    for url, shard in zip(links["shard_urls"], manifest["shards"]):
        assert "X-Amz-Signature" in url
        data = http_calls.get(url, timeout=30).content
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]

    # Charged once: what the host's manifest says ran, which is what the tokenizer counts here.
    assert _charged(fleet, done_job) == manifest["tokens"] == _expected_tokens(prompts)
    assert _charged(fleet, cancel_job) == cancelled["reserved_tokens"] == _expected_tokens([f"cancel me {i}" for i in range(30)])


def test_progress_read_mid_run_on_s3_rises_shard_by_shard_through_both_replicas_on_both_hosts(fleet, request):
    """Two jobs at once, one on each worker host (a host runs one job at a time), read through
    both replicas while they run: each job's `shards_done` passes through every count from the
    first shard to the last. Each job's run reports its count on its flow run as each shard
    lands (`flows.progress`), from the worker host's namespace; the replica holding the watcher
    lease reads it on the run's progress event and records it; the other reads what it
    recorded."""
    n = 8  # below twice the scale-out minimum: each job is one run, whose shards land one by one
    deadline = time.monotonic() + 120
    while any(h.flow_run_ids() for h in fleet.hosts):  # the hosts are free, so each takes a job
        assert time.monotonic() < deadline, "the worker hosts stayed busy"
        time.sleep(0.5)
    a, b = fleet.replicas
    submitted = [_submit(fleet, a, [f"progress {j} prompt {i}" for i in range(n)]) for j in range(2)]
    jobs = {job["job_id"]: job["run_id"] for job in submitted}
    seen = {job: {replica.base_url: [] for replica in fleet.replicas} for job in jobs}
    ran_on: dict[str, str] = {}

    deadline = time.monotonic() + 240
    while True:
        ended = 0
        for job in jobs:
            for replica in (a, b):
                body = _get(fleet, replica, job)
                if body["status"] == "running":
                    seen[job][replica.base_url].append(body["progress"]["shards_done"])
                ended += body["status"] in ("done", "failed", "cancelled")
        if len(ran_on) < len(jobs):  # where each run's process lives (once found, no more looks)
            for host in fleet.hosts:
                for run_id in host.flow_run_ids() & set(jobs.values()):
                    ran_on[run_id] = host.host.name
        if ended == 2 * len(jobs):
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)

    for job, run_id in jobs.items():
        body = _get(fleet, b, job)
        assert body["status"] == "done" and body["progress"] == {"shards_done": n, "n_shards": n}, body
        for replica, values in seen[job].items():
            assert values == sorted(values), (replica, values)
            # The count before the last lasts only until the run's end (tests/test_watcher_events.py).
            assert set(range(1, n - 1)) <= set(values), f"{replica} read {values} mid-run"
    assert sorted(ran_on) == sorted(jobs.values()) and len(set(ran_on.values())) == 2, ran_on
    for job, run_id in jobs.items():
        print(f"progress of {job} on {ran_on[run_id]}: " + "; ".join(
            f"{replica}: {sorted(set(values))}" for replica, values in seen[job].items()))
    # The last test needing both hosts: one of them may die now (in the background, while the
    # next modules run).
    start_if_awaited(request, "host_death", HOST_DEATH)


def _objects(fleet, prefix) -> dict[str, object]:
    listing = fleet.s3.client.list_objects_v2(Bucket=fleet.s3.bucket, Prefix=prefix)
    return {o["Key"].rsplit("/", 1)[-1]: o["LastModified"] for o in listing.get("Contents", [])}


HOST_DEATH = "test_a_host_that_dies_mid_job_loses_nothing"


@pytest.fixture(scope="session")
def host_death(fleet) -> Background:
    """The host-death scenario (`_kill_a_host_mid_job`), under way in the background: most of it
    is Prefect's crash window, so this test process runs the modules this one runs with
    meanwhile (tests/conftest.py, RUN_TOGETHER); its verdict and the tests after it come after them."""
    return Background("host death", lambda: _kill_a_host_mid_job(fleet))


@pytest.mark.after_its_partners
def test_a_host_that_dies_mid_job_loses_nothing(host_death):
    print(host_death.outcome(timeout=600))


def _kill_a_host_mid_job(fleet) -> str:
    """A job's host SIGKILLed after its third shard: the job ends done on the other host, its
    earlier shards untouched, charged once. Returns how long it took."""
    a, b = fleet.replicas
    prompts = [f"host death prompt {i}" for i in range(14)]
    job = _submit(fleet, a, prompts)
    run_id = job["run_id"]
    prefix = f"fleet/jobs/{job['job_id']}/"

    deadline = time.monotonic() + 240
    while sum(1 for n in _objects(fleet, prefix) if n.startswith("shard_")) < 3:
        assert time.monotonic() < deadline, "three shards were never written"
        time.sleep(0.3)
    victim = next(h for h in fleet.hosts if run_id in h.flow_run_ids())
    victim.kill()  # every process of the host at once: worker, flow run, everything
    killed_at = time.monotonic()
    before = {n: t for n, t in _objects(fleet, prefix).items() if n.startswith("shard_")}
    assert len(before) >= 3

    body = _until(fleet, b, job["job_id"], ("done", "failed", "cancelled"), timeout=300)
    assert body["status"] == "done", body
    recovered_s = time.monotonic() - killed_at
    survivor = next(h for h in fleet.hosts if h is not victim)
    after = _objects(fleet, prefix)
    for name, modified in before.items():  # written once, before the kill, never again
        assert after[name] == modified, name
    manifest = json.loads(fleet.s3.client.get_object(Bucket=fleet.s3.bucket, Key=prefix + "manifest.json")["Body"].read())
    assert len(manifest["shards"]) == len(prompts)
    assert _charged(fleet, job["job_id"]) == manifest["tokens"] == _expected_tokens(prompts)

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {PREFECT_API_URL: fleet.prefect_api_url, PREFECT_API_AUTH_STRING: fleet.prefect_auth}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        history = [s.name for s in client.read_flow_run_states(run_id)]
    assert run.run_count == 2 and "Crashed" in history, history
    return f"host death: done {recovered_s:.0f} s after the kill, on {survivor.host.name}"


@pytest.mark.after_its_partners
def test_the_lease_holders_death_hands_over_and_waiters_still_wake(fleet, host_death):
    host_death.outcome(timeout=600)  # one death at a time: the lease holder reschedules the dead host's run
    holder = next(r for r in fleet.replicas if r.health()["watcher"])
    other = next(r for r in fleet.replicas if r is not holder)
    job = _submit(fleet, other, [f"lease {i}" for i in range(6)])["job_id"]
    _until(fleet, other, job, ("running",))

    answer: dict = {}

    def wait_on_other():
        started = time.monotonic()
        answer["body"] = _get(fleet, other, job, wait=60)
        answer["woke"] = datetime.now(timezone.utc)
        answer["after_s"] = time.monotonic() - started

    waiter = threading.Thread(target=wait_on_other)
    waiter.start()
    wait_for_longpoll_waiters(other.base_url.removesuffix("/v1"), other.role.home, 1)
    holder.role.kill()
    killed_at = time.monotonic()
    while not other.health()["watcher"]:
        assert time.monotonic() - killed_at < 15, "no replica took the watcher lease over"
        time.sleep(0.2)
    takeover_s = time.monotonic() - killed_at
    waiter.join(timeout=90)
    assert answer["body"]["status"] == "done" and answer["after_s"] < 55, answer
    # Woken by the change itself (NOTIFY from the new holder), not by the end of its wait.
    with psycopg.connect(fleet.jobs_url.replace("+psycopg", "")) as conn:
        completed = conn.execute("SELECT completed_at FROM jobs WHERE id = %s", (job,)).fetchone()[0]
    wake_s = (answer["woke"] - completed.replace(tzinfo=timezone.utc)).total_seconds()
    assert 0 <= wake_s < 2, wake_s
    print(f"lease taken over {takeover_s:.1f} s after the holder died; the waiter woke {wake_s * 1000:.0f} ms "
          f"after the job was done ({answer['after_s']:.1f} s into its wait)")


@pytest.mark.after_its_partners
def test_every_role_stops_on_sigterm_leaving_no_process(fleet):
    roles = [r for r in fleet.roles if r.proc.poll() is None]  # the ones the tests left alive
    assert {r.name.split("-")[0] for r in roles} >= {"control", "api", "host"}
    trees = {r.name: r.tree() for r in roles}
    for role in sorted(roles, key=lambda r: r.name == "control-plane"):  # the control plane last
        started = time.monotonic()
        role.stop(timeout=60)
        assert role.proc.returncode == 0, (role.name, role.proc.returncode, role.tail())
        assert time.monotonic() - started < 45, role.name
        left = [p for p in trees[role.name] if _alive(p)]
        assert not left, (role.name, [p.cmdline() for p in left])
    for host in fleet.hosts:
        assert host.host.pids() == []
