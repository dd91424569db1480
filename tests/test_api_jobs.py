"""Harvest jobs over HTTP against the real app under uvicorn: the whole life of a job with a
real harvest into storage, links (fresh, expiring, tamper-proof, retention), another key's
job, long-poll both ways and its waiter limit, the charging rules, the submit race, and the
API killed and restarted mid-job.

Runs go through `FileRuns` (tests/api_fixtures.py), the one faked seam; the files are written
by the real core pipeline with the real tiny model, as a worker would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import torch
from safetensors.torch import load as load_tensors

from testbed import http_calls
from tests.api_fixtures import finish_run, set_run

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Interpretability research reads the residual stream.", "Hi"]


@pytest.fixture(scope="module")
def key(harvest_api) -> str:
    return harvest_api.make_key(name="jobs", small=50)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _submit(server, key, **body) -> dict:
    response = http_calls.post(
        f"{server.base_url}/harvest", headers=_auth(key), timeout=60,
        json={"model": "llama-tiny", "prompts": PROMPTS, "layers": [2, 4, 7], "shard_size": 2, **body},
    )
    assert response.status_code == 202, response.text
    return response.json()


def _get(server, key, job_id, **params) -> httpx.Response:
    return http_calls.get(f"{server.base_url}/harvest/{job_id}", headers=_auth(key), params=params, timeout=90)


def _until(server, key, job_id, status, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = _get(server, key, job_id).json()
        if body["status"] == status:
            return body
        time.sleep(0.1)
    raise AssertionError(f"{job_id} never became {status}: {body}")


@pytest.fixture(scope="module")
def done_job(harvest_api, key, hf_engine) -> dict:
    job = _submit(harvest_api, key)
    finish_run(harvest_api, job["job_id"], hf_engine)
    return _until(harvest_api, key, job["job_id"], "done")


def test_submit_answers_202_with_the_pending_harvest(harvest_api, key):
    job = _submit(harvest_api, key)
    uuid.UUID(job["job_id"])
    assert job["status"] == "pending"
    assert job["model"] == "llama-tiny" and job["n_prompts"] == 3 and job["layers"] == [2, 4, 7]
    assert job["shard_size"] == 2 and job["add_special_tokens"] is True and job["contents"] == "activations"
    assert job["reserved_tokens"] > 3 and job["tokens"] is None
    assert job["started_at"] is None and job["completed_at"] is None and job["error"] is None
    assert job["created_at"].endswith("+00:00")
    assert job["progress"] == {"shards_done": 0, "n_shards": 2}
    assert "result" not in job and "urls_expire_at" not in job
    request_file = Path(harvest_api.env["HARVEST_STORAGE_URL"][len("file://"):]) / "jobs" / job["job_id"] / "request.json"
    assert request_file.exists()  # written before the run started
    assert harvest_api.runs.get(f"run-{job['job_id']}")["request_url"].endswith(f"jobs/{job['job_id']}/request.json")
    http_calls.delete(f"{harvest_api.base_url}/harvest/{job['job_id']}", headers=_auth(key))


def test_the_stored_request_names_the_layers_admission_resolved(harvest_api, key):
    """The run reads its layers from the request file: the default (the quartiles of the
    tiny model's 8 blocks) is resolved once, at admission, never again by the run."""
    job = _submit(harvest_api, key, layers=None)
    request_file = Path(harvest_api.env["HARVEST_STORAGE_URL"][len("file://"):]) / "jobs" / job["job_id"] / "request.json"
    assert json.loads(request_file.read_text())["layers"] == job["layers"] == [2, 4, 6]
    http_calls.delete(f"{harvest_api.base_url}/harvest/{job['job_id']}", headers=_auth(key))


def test_a_done_job_has_a_result_with_links_that_need_no_key(harvest_api, key, done_job):
    job = done_job
    assert job["tokens"] == job["result"]["tokens"] > 0
    assert job["started_at"] and job["completed_at"] and job["progress"] == {"shards_done": 2, "n_shards": 2}
    result = job["result"]
    assert result["n_shards"] == 2 and len(result["shard_urls"]) == 2
    assert result["layer_indices"] == [2, 4, 7] and result["contents"] == "activations"
    assert set(result["timings"]) == {"load_s", "forward_s", "save_s", "upload_s", "real_tokens", "padded_tokens"}
    # The forward passes' tokens reach the API: those of every prompt (the job's own count).
    assert result["timings"]["real_tokens"] == job["tokens"] and result["timings"]["padded_tokens"] >= 0
    assert result["bytes_written"] > 0 and job["urls_expired"] is False
    # The documented reading code, with plain HTTP and no key.
    shard = load_tensors(http_calls.get(result["shard_urls"][0], timeout=30).content)
    assert shard["prompt_0"].dtype == torch.bfloat16
    n_tokens = shard["tokens_0"].shape[0]
    assert tuple(shard["prompt_0"].shape) == (3, n_tokens, done_job_hidden(harvest_api))
    second = load_tensors(http_calls.get(result["shard_urls"][1], timeout=30).content)
    assert set(second) == {"prompt_2", "tokens_2"}
    manifest = http_calls.get(result["manifest_url"], timeout=30).json()
    assert manifest["version"] == 2 and manifest["job_id"] == job["job_id"]
    assert manifest["tokens"] == job["tokens"] == result["tokens"]
    stats = load_tensors(http_calls.get(result["stats_url"], timeout=30).content)
    assert stats["layer_indices"].tolist() == [2, 4, 7]


def done_job_hidden(server) -> int:
    from harvest.registry import load_registry
    from harvest.settings import Settings

    return load_registry(Settings(models_file=server.env["HARVEST_MODELS_FILE"], lanes_file=server.env["HARVEST_LANES_FILE"])).get("llama-tiny").hidden_size


def test_each_read_makes_links_fresh_to_within_minutes(harvest_api, key, done_job):
    """A replica hands a job's signed links out again for at most `REUSE_MAX_S` (re-signing
    them is tested in tests/test_link_cache.py): each read's links work for 7 days (the
    default) less that at least, and `urls_expire_at` is their own expiry."""
    from api.links import REUSE_MAX_S

    for _ in range(2):
        read_at = time.time()
        job = _get(harvest_api, key, done_job["job_id"]).json()
        expires = int(parse_qs(urlparse(job["result"]["manifest_url"]).query)["expires"][0])
        assert datetime.fromisoformat(job["urls_expire_at"]).timestamp() == expires
        assert read_at + 7 * 24 * 3600 - REUSE_MAX_S - 60 <= expires <= read_at + 7 * 24 * 3600 + 60


def test_expired_tampered_or_foreign_links_are_403(harvest_api, key, done_job):
    from api.links import LinkSigner
    from api.settings import ApiSettings
    from harvest.settings import get_settings

    sign = LinkSigner.from_settings(get_settings(ApiSettings)).sign  # the replica's secret, in the session's home
    url = done_job["result"]["shard_urls"][0]
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    base = f"{parsed.scheme}://{parsed.netloc}{parsed.path}"
    assert http_calls.get(url).status_code == 200

    tampered_signature = query["signature"][0][:-1] + ("0" if query["signature"][0][-1] != "0" else "1")
    later = int(query["expires"][0]) + 3600
    other_file = base.replace("shard_00000", "shard_00001")
    refused = [
        f"{base}?expires={query['expires'][0]}&signature={tampered_signature}",  # altered signature
        f"{base}?expires={later}&signature={query['signature'][0]}",  # extended expiry
        f"{other_file}?expires={query['expires'][0]}&signature={query['signature'][0]}",  # another file
        base,  # no signature at all
        sign(harvest_api.root, done_job["job_id"], "shard_00000.safetensors", int(time.time()) - 1),  # expired
        sign(harvest_api.root, done_job["job_id"], "request.json", int(time.time()) + 60),  # not a result file
    ]
    for link in refused:
        response = http_calls.get(link)
        assert response.status_code == 403, (link, response.text)
        assert response.json()["error"]["code"] == "link_invalid"


def test_a_validly_signed_link_outside_any_job_is_refused(harvest_api, key, done_job):
    """A link signed by this API for the job id `..` names `<storage>/manifest.json`, outside
    every job. Sent byte for byte (http.client does not fold `..` away as httpx does, which
    is how the old check never reached the route), it must be refused, not served."""
    import http.client

    from api.links import LinkSigner
    from api.settings import ApiSettings
    from harvest.settings import get_settings

    mac = LinkSigner.from_settings(get_settings(ApiSettings)).mac  # the replica's secret, in the session's home

    storage_root = Path(harvest_api.env["HARVEST_STORAGE_URL"][len("file://"):])
    planted = storage_root / "manifest.json"
    planted.write_text('{"secret": "outside every job"}')
    expires = int(time.time()) + 60
    try:
        for job_id in ("..", "%2E%2E"):
            conn = http.client.HTTPConnection("127.0.0.1", harvest_api.port, timeout=30)
            conn.request("GET", f"/v1/files/{job_id}/manifest.json?expires={expires}&signature={mac('..', 'manifest.json', expires)}")
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status == 403, (job_id, response.status, body)
            assert json.loads(body)["error"]["code"] == "link_invalid" and b"secret" not in body
    finally:
        planted.unlink()


def test_links_ignore_the_clients_host_header(harvest_api, key, done_job):
    """Before, links were built from the Host header: a client could make the API hand out
    validly signed links to a host of its choosing."""
    body = _get_with(harvest_api, key, done_job["job_id"], {"Host": "evil.example:666"}).json()
    links = [*body["result"]["shard_urls"], body["result"]["manifest_url"], body["result"]["stats_url"]]
    assert all(link.startswith(f"{harvest_api.root}/v1/files/{done_job['job_id']}/") for link in links), links


def _get_with(server, key, job_id, headers) -> httpx.Response:
    return http_calls.get(f"{server.base_url}/harvest/{job_id}", headers={**_auth(key), **headers}, timeout=90)


def test_after_retention_the_job_says_urls_expired_with_no_links(harvest_api, key, hf_engine):
    from datetime import timedelta

    from sqlalchemy import select, update

    from api.db import jobs

    job = _submit(harvest_api, key, prompts=["short"])
    finish_run(harvest_api, job["job_id"], hf_engine)
    _until(harvest_api, key, job["job_id"], "done")
    engine = harvest_api.engine()
    with engine.begin() as conn:  # completed 31 days ago
        completed = conn.execute(select(jobs.c.completed_at).where(jobs.c.id == job["job_id"])).scalar_one()
        conn.execute(update(jobs).where(jobs.c.id == job["job_id"]).values(completed_at=completed - timedelta(days=31)))
    engine.dispose()
    body = _get(harvest_api, key, job["job_id"]).json()
    assert body["urls_expired"] is True and "urls_expire_at" not in body
    assert "shard_urls" not in body["result"] and "manifest_url" not in body["result"]
    assert body["result"]["n_shards"] == 1  # the numbers stay


def test_swept_files_read_as_urls_expired(harvest_api, key, hf_engine):
    job = _submit(harvest_api, key, prompts=["short"])
    finish_run(harvest_api, job["job_id"], hf_engine)
    _until(harvest_api, key, job["job_id"], "done")
    harvest_api.storage().child(f"jobs/{job['job_id']}").delete_all()  # what the retention sweep does
    body = _get(harvest_api, key, job["job_id"]).json()
    assert body["urls_expired"] is True and "shard_urls" not in body["result"]


def test_another_keys_job_is_404_and_lists_are_per_key(harvest_api, key, done_job):
    other = harvest_api.make_key(name="other")
    for method in ("GET", "DELETE"):
        response = http_calls.request(method, f"{harvest_api.base_url}/harvest/{done_job['job_id']}", headers=_auth(other))
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "harvest_job_not_found"
    assert http_calls.get(f"{harvest_api.base_url}/harvest", headers=_auth(other)).json()["data"] == []
    # and its own list pages newest first
    mine = [_submit(harvest_api, other, prompts=["a"])["job_id"] for _ in range(3)]
    page = http_calls.get(f"{harvest_api.base_url}/harvest", params={"limit": 2}, headers=_auth(other)).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [j["job_id"] for j in page["data"]] == mine[::-1][:2]
    rest = http_calls.get(f"{harvest_api.base_url}/harvest", params={"limit": 2, "after": page["last_id"]},
                          headers=_auth(other)).json()
    assert [j["job_id"] for j in rest["data"]] == [mine[0]] and rest["has_more"] is False
    for job_id in mine:
        http_calls.delete(f"{harvest_api.base_url}/harvest/{job_id}", headers=_auth(other))


def _cancel(server, key, job_id) -> httpx.Response:
    return http_calls.delete(f"{server.base_url}/harvest/{job_id}", headers=_auth(key), timeout=30)


def ledger(server, job_ids) -> dict[str, list[tuple]]:
    """Each job's rows in the charge ledger, (outcome, tokens_charged): the independent record
    of charges, written once in the transaction that ended the job."""
    from sqlalchemy import text

    engine = server.engine()
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT job_id, outcome, tokens_charged FROM charge_ledger")).all()
    finally:
        engine.dispose()
    return {job_id: [(o, t) for j, o, t in rows if j == job_id] for job_id in job_ids}


def manifest_tokens(server, job_id) -> int:
    """The token positions the pipeline wrote, from the job's own manifest (not the API)."""
    return json.loads(server.storage().child(f"jobs/{job_id}").read_bytes("manifest.json"))["tokens"]


def test_charging_rules_over_http(harvest_api, key, done_job):
    # done → the tokens that ran, as the files say
    assert ledger(harvest_api, [done_job["job_id"]])[done_job["job_id"]] == [("done", manifest_tokens(harvest_api, done_job["job_id"]))]
    assert done_job["tokens"] == manifest_tokens(harvest_api, done_job["job_id"]) > 0

    # cancelled before the GPU run started → 0, and the run is stopped
    early = _submit(harvest_api, key)
    response = _cancel(harvest_api, key, early["job_id"])
    assert response.status_code == 200
    assert (response.json()["status"], response.json()["tokens"]) == ("cancelled", 0)
    assert harvest_api.runs.get(f"run-{early['job_id']}")["status"] == "cancelled"
    again = _cancel(harvest_api, key, early["job_id"])  # a second cancel answers it again
    assert again.status_code == 200 and again.json()["status"] == "cancelled" and again.json()["tokens"] == 0

    # cancelled after the GPU run started (e.g. while the model loads) → the reserved tokens
    late = _submit(harvest_api, key)
    set_run(harvest_api, late["job_id"], "running")
    response = _cancel(harvest_api, key, late["job_id"])  # reads the run first: no tick needed
    assert (response.json()["status"], response.json()["tokens"]) == ("cancelled", late["reserved_tokens"])
    assert harvest_api.runs.get(f"run-{late['job_id']}")["cancels"] == 1

    # failed → 0 with the reason
    failed = _submit(harvest_api, key)
    set_run(harvest_api, failed["job_id"], "running")
    set_run(harvest_api, failed["job_id"], "failed", "Worker crashed: out of memory")
    body = _until(harvest_api, key, failed["job_id"], "failed")
    # The run's own words go to the API's log under a reference; the job says the vocabulary's.
    assert body["tokens"] == 0 and body["error"].startswith("internal_error: ") and "(ref " in body["error"]
    assert "out of memory" not in body["error"]
    assert body["completed_at"] and "result" not in body

    # done or failed cannot be cancelled
    for job_id in (done_job["job_id"], failed["job_id"]):
        response = _cancel(harvest_api, key, job_id)
        assert response.status_code == 409 and response.json()["error"]["code"] == "harvest_not_cancellable"

    # The ledger recorded each ending once, whatever the API answered on the way.
    assert ledger(harvest_api, [early["job_id"], late["job_id"], failed["job_id"]]) == {
        early["job_id"]: [("cancelled", 0)],
        late["job_id"]: [("cancelled", late["reserved_tokens"])],
        failed["job_id"]: [("failed", 0)],
    }


def test_twenty_simultaneous_submits_against_a_limit_of_three_admit_three(harvest_api):
    key = harvest_api.make_key(name="race", small=3)
    barrier = threading.Barrier(20)
    answers: list[httpx.Response] = []

    def submit():
        barrier.wait()
        answers.append(http_calls.post(f"{harvest_api.base_url}/harvest", headers=_auth(key), timeout=60,
                                       json={"model": "llama-tiny", "prompts": ["race"]}))

    threads = [threading.Thread(target=submit) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in answers)
    assert codes == [202] * 3 + [429] * 17
    assert {r.json()["error"]["code"] for r in answers if r.status_code == 429} == {"harvest_concurrency_exceeded"}
    listed = http_calls.get(f"{harvest_api.base_url}/harvest", headers=_auth(key)).json()["data"]
    assert len(listed) == 3
    for job in listed:
        _cancel(harvest_api, key, job["job_id"])


def test_the_api_killed_mid_job_follows_on_and_charges_once(harvest_api, hf_engine):
    server = harvest_api  # killed and restarted on the same port, database and storage
    runs_dir = Path(server.env["HARVEST_TEST_RUNS_DIR"])
    name = f"restart-{uuid.uuid4().hex[:6]}"
    key = server.make_key(name=name)
    finishing = _submit(server, key)["job_id"]  # ends while the API is down
    cancelled = _submit(server, key)["job_id"]  # cancelled while Prefect is still away
    for job in (finishing, cancelled):
        set_run(server, job, "running")
        _until(server, key, job, "running")

    server.kill()  # SIGKILL: no shutdown code runs
    (runs_dir / "unreachable").touch()  # and Prefect is not back yet either
    try:
        finish_run(server, finishing, hf_engine)
        server.start()

        # The status is the database's, whichever process reads it: still running (never back
        # to pending), and a cancel now charges what a started GPU run costs.
        for job in (finishing, cancelled):
            assert _get(server, key, job).json()["status"] == "running"
        reserved = _get(server, key, cancelled).json()["reserved_tokens"]
        response = _cancel(server, key, cancelled)
        assert (response.json()["status"], response.json()["tokens"]) == ("cancelled", reserved)
    finally:
        (runs_dir / "unreachable").unlink()
    body = _until(server, key, finishing, "done")
    assert body["tokens"] == body["result"]["tokens"] > 0
    # The same run was followed, never started again.
    assert server.runs.get(f"run-{finishing}")["starts"] == 1

    # Charged exactly once each, by the ledger: the finished job its tokens as its manifest
    # counts them, the cancelled one its reservation; and further watcher ticks add nothing.
    time.sleep(1.0)
    assert ledger(server, [finishing, cancelled]) == {
        finishing: [("done", manifest_tokens(server, finishing))],
        cancelled: [("cancelled", reserved)],
    }
    assert _get(server, key, finishing).json()["tokens"] == manifest_tokens(server, finishing)


def test_a_run_that_cannot_start_is_503_with_the_job_id_and_charged_nothing(harvest_api, key):
    flag = Path(harvest_api.env["HARVEST_TEST_RUNS_DIR"]) / "start-fails"
    flag.touch()
    try:
        response = http_calls.post(f"{harvest_api.base_url}/harvest", headers=_auth(key), timeout=60,
                                   json={"model": "llama-tiny", "prompts": ["x"]})
    finally:
        flag.unlink()
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "harvest_unavailable"
    job_id = error["message"].split("Job ")[1].split(" ")[0]
    body = _get(harvest_api, key, job_id).json()
    assert body["status"] == "failed" and "could not be started" in body["error"]
    assert ledger(harvest_api, [job_id]) == {job_id: [("failed", 0)]}
    assert "refused the connection" not in body["error"]  # the backend's own words stay in the log


def test_a_job_admitted_by_a_process_that_died_before_starting_it_is_started_by_the_watcher(harvest_api):
    from api.auth import create_key
    from api.store import admit
    from harvest.lanes import load_lanes
    from harvest.settings import Settings

    engine = harvest_api.engine()
    small = load_lanes(Settings(lanes_file=harvest_api.env["HARVEST_LANES_FILE"]))["small"]
    try:
        key, record = create_key("orphan", engine=engine)
        job_id = str(uuid.uuid4())
        admit(record, {
            "id": job_id, "model": "llama-tiny", "lane": "small", "n_prompts": 1, "layers": [2], "shard_size": 32,
            "n_shards": 1, "add_special_tokens": True, "contents": "activations", "reserved_tokens": 3,
            "request_url": f"{harvest_api.env['HARVEST_STORAGE_URL']}/jobs/{job_id}/request.json",
        }, declared=small, engine=engine)  # and no run started: its replica died here
    finally:
        engine.dispose()
    deadline = time.monotonic() + 10
    while (run := harvest_api.runs.get(f"run-{job_id}")) is None:
        assert time.monotonic() < deadline, "the watcher never started the orphaned job's run"
        time.sleep(0.1)
    assert run["starts"] == 1
    body = _get(harvest_api, key, job_id).json()
    assert body["run_id"] == f"run-{job_id}" and body["status"] == "pending"
    set_run(harvest_api, job_id, "running")
    assert _until(harvest_api, key, job_id, "running")["started_at"]
    _cancel(harvest_api, key, job_id)


def test_keys_create_prints_the_key_alone_on_the_last_line(harvest_api):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HARVEST_DATABASE_URL": harvest_api.env["HARVEST_DATABASE_URL"]}
    out = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "keys", "create", "--name", "cli", "--limit", "small=1", "--limit", "large=0",
         "--monthly-jobs", "9", "--token-budget", "1000", "--activation-quota", "5"],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
    )
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("acs_") and " " not in key
    one = _submit(harvest_api, key, prompts=["a"])
    refused = http_calls.post(f"{harvest_api.base_url}/harvest", headers=_auth(key), json={"model": "llama-tiny", "prompts": ["b"]})
    assert refused.status_code == 429 and "1 harvest on small models" in refused.json()["error"]["message"]
    _cancel(harvest_api, key, one["job_id"])
    listing = subprocess.run([sys.executable, "-m", "fleet.cli", "keys", "list"], env=env, capture_output=True,
                             text=True, check=True).stdout
    assert "cli" in listing and key not in listing and key[:10] in listing


def test_a_crashed_run_is_rescheduled_within_the_jobs_restart_budget(harvest_api, key):
    """Prefect marks a run Crashed when its host's heartbeats stop (`flows.liveness`); the
    watcher puts it back in its lane's queue, the job staying running, until the budget
    (HARVEST_MAX_RESTARTS, 3) is spent; then the job fails, charged nothing."""
    job = _submit(harvest_api, key)["job_id"]
    set_run(harvest_api, job, "running")
    _until(harvest_api, key, job, "running")
    for n in range(1, 4):
        set_run(harvest_api, job, "crashed", message="heartbeats stopped")
        deadline = time.monotonic() + 10
        while harvest_api.runs.get(f"run-{job}").get("reschedules", 0) < n:
            assert time.monotonic() < deadline, f"crash {n} was never rescheduled"
            time.sleep(0.05)
        assert _get(harvest_api, key, job).json()["status"] == "running"
    set_run(harvest_api, job, "crashed", message="heartbeats stopped")
    body = _until(harvest_api, key, job, "failed")
    assert body["tokens"] == 0 and "died 4 times" in body["error"]
    assert harvest_api.runs.get(f"run-{job}")["reschedules"] == 3
