"""Lanes as data (infra/lanes.toml): a lane added in the config only gets its work pool and
deployment from the control plane's deploy step, shows in /v1/models for a model assigned to
it, caps each key at its default (existing keys included) with a 429 naming it; and
`harvest keys list --json` reports usage that matches the jobs' own records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed import http_calls
from tests.api_fixtures import TEST_LANES, finish_run, set_run

REPO = Path(__file__).resolve().parent.parent


def test_a_bad_lanes_file_is_refused_clearly(tmp_path):
    from harvest.lanes import load_lanes
    from harvest.settings import Settings

    cases = {
        "[lanes.Big]\npool_limit = 1\n": "lowercase",
        "[lanes.xl]\nkey_limit = -1\n": "key_limit",
        "[lanes.xl]\nwat = 1\n": None,  # unknown keys are ignored only if pydantic says so
        "": "declares no lanes",
    }
    for n, (text, needle) in enumerate(cases.items()):
        path = tmp_path / f"lanes-{n}.toml"
        path.write_text(text)
        if needle is None:
            assert "xl" in load_lanes(Settings(lanes_file=path))
            continue
        with pytest.raises(ValueError) as refused:
            load_lanes(Settings(lanes_file=path))
        assert needle in str(refused.value) and str(path) in str(refused.value)


def test_the_control_plane_creates_an_added_lanes_pool_and_deployment(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    from fleet.processes import RUN_COMMAND
    from flows.deploy import apply_sync
    from harvest.lanes import load_lanes
    from harvest.settings import Settings

    lanes_file = tmp_path / "lanes.toml"
    lanes_file.write_text((REPO / "infra" / "lanes.toml").read_text() + TEST_LANES)
    names = apply_sync(load_lanes(Settings(lanes_file=lanes_file)), run_command=RUN_COMMAND)
    assert "harvest/harvest-xl" in names
    apply_sync(load_lanes(Settings(lanes_file=lanes_file)), run_command=RUN_COMMAND)  # idempotent
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("xl")
        deployment = client.read_deployment_by_name("harvest/harvest-xl")
    assert (pool.type, pool.concurrency_limit) == ("process", 1)
    assert deployment.work_pool_name == "xl" and deployment.entrypoint == "flows.harvest.harvest"


def _cli(harvest_api, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, **{k: v for k, v in harvest_api.env.items() if k.startswith("HARVEST_")}}
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def _keys_json(harvest_api) -> dict[str, dict]:
    out = _cli(harvest_api, "keys", "list", "--json")
    assert out.returncode == 0, out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)}


def test_an_added_lane_in_models_caps_and_usage(harvest_api, hf_engine):
    models = http_calls.get(f"{harvest_api.base_url}/models", headers={"Authorization": f"Bearer {harvest_api.make_key(name='m')}"}).json()
    lanes = {m["id"]: m["capabilities"]["lane"] for m in models["data"]}
    assert lanes["llama-tiny-xl"] == "xl" and lanes["llama-tiny"] == "small"

    key = harvest_api.make_key(name="xl-user")  # no xl cap of its own: the lane's default, 2
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "llama-tiny-xl", "prompts": ["an xl prompt"]}
    held = [http_calls.post(f"{harvest_api.base_url}/harvest", json=body, headers=auth, timeout=60) for _ in range(2)]
    assert [r.status_code for r in held] == [202, 202]
    refused = http_calls.post(f"{harvest_api.base_url}/harvest", json=body, headers=auth, timeout=60)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "harvest_concurrency_exceeded" and "on xl models" in error["message"]
    row = _keys_json(harvest_api)["xl-user"]
    assert row["active"]["xl"] == 2 and row["caps"]["lanes"]["xl"] == 2 and row["caps"]["lanes"]["small"] == 3

    # Usage against the jobs' own records: two small jobs run to done, one xl cancelled
    # after its run started (charged its reservation), one before (charged nothing).
    from tests.test_api_jobs import _until

    xl_started, xl_pending = (r.json()["job_id"] for r in held)
    set_run(harvest_api, xl_started, "running")
    _until(harvest_api, key, xl_started, "running")
    small = [http_calls.post(f"{harvest_api.base_url}/harvest", json={"model": "llama-tiny", "prompts": [f"usage {i}", "two"]},
                             headers=auth, timeout=60).json()["job_id"] for i in range(2)]
    for job in small:
        finish_run(harvest_api, job, hf_engine)
    ended = [_until(harvest_api, key, job, "done") for job in small]
    for job in (xl_started, xl_pending):
        assert http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=auth, timeout=60).status_code == 200
    time.sleep(0.5)
    jobs = [http_calls.get(f"{harvest_api.base_url}/harvest/{j}", headers=auth).json() for j in (*small, xl_started, xl_pending)]
    row = _keys_json(harvest_api)["xl-user"]
    # Each done job's tokens are what its manifest says ran (the API's result echoes it).
    assert [j["tokens"] for j in ended] == [j["result"]["tokens"] for j in ended]
    assert row["tokens_charged"] == sum(j["tokens"] for j in jobs) == sum(j["tokens"] for j in ended) + jobs[2]["reserved_tokens"]
    assert jobs[3]["tokens"] == 0
    assert row["jobs_this_month"] == 4 and row["active"] == {"small": 0, "large": 0, "xl": 0}
