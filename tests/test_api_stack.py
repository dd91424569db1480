"""Against a live `harvest up` stack (what `make run` runs): the documented curl and Python
examples, unchanged but for `"model": "llama-tiny"` and its layers; then the API killed and
restarted mid-job while its Prefect flow run goes on, re-attached and charged once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testbed import http_calls
from tests.api_fixtures import PRODUCTION_APP, ApiServer, harvest_up

REPO = Path(__file__).resolve().parent.parent

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


@pytest.fixture(scope="module")
def stack(tmp_path_factory, harvest_home, tiny):
    with harvest_up(tmp_path_factory.mktemp("stack-home"), harvest_home / "models", {"HARVEST_ENGINE": "hf"}) as info:
        yield info


def _curl(*args: str) -> dict:
    out = subprocess.run(["curl", "-s", *args], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_seed_examples_against_make_run(stack, tmp_path):
    base, key = stack["ACS_API_BASE"], stack["ACS_API_KEY"]
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

    tokenizer = load_tokenizer(Path(stack["home"]) / "models" / "llama-tiny")
    assert ids == tokenizer("The sky is")["input_ids"]  # BOS included, the ids that ran
    assert int(match.group(2)) == json.loads((Path(stack["home"]) / "models" / "llama-tiny" / "config.json").read_text())["hidden_size"]

    out = subprocess.run([sys.executable, "-c", MANIFEST_PROGRAM], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[2, 4, 6] Layer k is the output of decoder block k")
    assert "torch.Size([3," in out.stdout


def test_api_killed_mid_job_follows_the_same_flow_run(stack):
    """A second API on the stack's Prefect (own job store): kill -9 it right after a submit,
    restart it, and the job ends done through the same flow run, charged once."""
    from sqlalchemy import text

    home = Path(stack["home"])
    server = ApiServer(home, f"restart-{uuid.uuid4().hex[:6]}", {
        "PREFECT_API_URL": stack["prefect_api_url"],
        "PREFECT_API_AUTH_STRING": stack["prefect_auth"],
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

    with temporary_settings({PREFECT_API_URL: stack["prefect_api_url"], PREFECT_API_AUTH_STRING: stack["prefect_auth"]}):
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
