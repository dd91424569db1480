"""Every documented refusal of a harvest (submit, read, cancel, caps) over HTTP, against the
real app under uvicorn: status, `code`, `param`, message and headers. No run is started by a refused submit."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from testbed import http_calls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def key(harvest_api) -> str:
    return harvest_api.make_key(name="refusals", small=50)


def _post(server, key, body, **kwargs) -> httpx.Response:
    return http_calls.post(f"{server.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60, **kwargs)


def _error(response: httpx.Response, status: int, code: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param), error
    return error


OK = {"model": "llama-tiny", "prompts": ["The sky is"], "layers": [1]}


@pytest.mark.parametrize(
    "change, param, code, message",
    [
        ({"temperature": 0.5}, "temperature", "invalid_request", "Unrecognized request argument supplied: temperature"),
        ({"layer": [1]}, "layer", "invalid_request", "Unrecognized request argument supplied: layer"),
        ({"model": None}, "model", "invalid_request", None),
        ({"model": "gpt-5"}, "model", "model_not_found", "gpt-5"),
        ({"model": "llama-tiny-noharvest"}, "model", "harvest_unsupported", "not for harvests"),
        ({"prompts": []}, "prompts", "invalid_request", None),
        ({"prompts": ["ok", ""]}, "prompts", "invalid_request", "empty"),
        ({"prompts": ["x"] * 4097}, "prompts", "invalid_request", None),
        ({"prompts": "The sky is"}, "prompts", "invalid_request", None),
        ({"model": "llama-8b", "layers": [8, 40]}, "layers", "invalid_request",
         "meta-llama/Llama-3.1-8B has layers 0 to 31: it has no layer 40."),
        ({"layers": [1, 8]}, "layers", "invalid_request", "llama-tiny has layers 0 to 7: it has no layer 8."),
        ({"layers": [-1]}, "layers", "invalid_request", "it has no layer -1."),
        ({"layers": "ALL"}, "layers", "invalid_request", None),
        ({"layers": []}, "layers", "invalid_request", None),
        ({"shard_size": 0}, "shard_size", "invalid_request", None),
        ({"shard_size": 4097}, "shard_size", "invalid_request", None),
        ({"batch_size": 0}, "batch_size", "invalid_request", None),
        ({"add_special_tokens": "maybe"}, "add_special_tokens", "invalid_request", None),
        ({"project_onto": {"data": "!!!", "dtype": "float32", "shape": [1, 64]}}, "project_onto", "invalid_request", None),
        ({"project_onto": {"data": "", "dtype": "float64", "shape": [1, 64]}}, "project_onto", "invalid_request", None),
        ({"project_onto": {"data": "", "dtype": "float32", "shape": [1, 64], "extra": 1}}, "project_onto.extra",
         "invalid_request", "Unrecognized request argument supplied: project_onto.extra"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(harvest_api, key, change, param, code, message):
    error = _error(_post(harvest_api, key, {**OK, **change}), 400, code, param)
    if message:
        assert message in error["message"]


def _directions(n: int, hidden: int, dtype="<f4") -> str:
    return base64.b64encode(np.random.default_rng(0).standard_normal((n, hidden)).astype(dtype).tobytes()).decode()


def test_directions_that_do_not_fit_are_refused_with_the_numbers(harvest_api, key, tiny):
    hidden = tiny.hidden_size
    cases = [
        ({"data": _directions(2, hidden), "dtype": "float32", "shape": [3, hidden]}, "bytes"),
        ({"data": _directions(2, hidden + 1), "dtype": "float32", "shape": [2, hidden + 1]}, str(hidden)),
        ({"data": _directions(65, hidden), "dtype": "float32", "shape": [65, hidden]}, "64"),
        ({"data": base64.b64encode(np.zeros((1, hidden), "<f4").tobytes()).decode(), "dtype": "float32",
          "shape": [1, hidden]}, "norm"),
        ({"data": _directions(1, hidden), "dtype": "float32", "shape": [1, hidden], "compression": "zstd"}, "none"),
    ]
    for project_onto, needle in cases:
        error = _error(_post(harvest_api, key, {**OK, "project_onto": project_onto}), 400, "invalid_request", "project_onto")
        assert needle in error["message"], error


def test_a_model_whose_weights_are_not_here_is_503(harvest_api, key):
    error = _error(_post(harvest_api, key, {**OK, "model": "llama-8b", "layers": [8]}), 503, "harvest_unavailable", None)
    assert "meta-llama/Llama-3.1-8B" in error["message"]
    assert str(harvest_api.home) not in error["message"] and "looked in" not in error["message"]  # no server paths


def test_malformed_json_is_400(harvest_api, key):
    response = http_calls.post(
        f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        content=b'{"model": "llama-tiny", "prompts": [', timeout=30,
    )
    _error(response, 400, "invalid_request", None)
    for body in (b"", b"[1, 2]", b"null"):
        response = http_calls.post(
            f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            content=body, timeout=30,
        )
        assert "JSON object" in _error(response, 400, "invalid_request", None)["message"]


def test_over_two_million_estimated_tokens_is_400_on_prompts(harvest_api, key):
    # ~491 tokens per prompt (the tiny tokenizer makes one token of each "zq " piece) × 4096.
    error = _error(_post(harvest_api, key, {**OK, "prompts": ["zq " * 163 + "z"] * 4096}), 400, "invalid_request", "prompts")
    assert "2,000,000" in error["message"]


def test_body_over_50_mb_is_413(harvest_api, key):
    body = b'{"model": "llama-tiny", "prompts": ["' + b"a" * (50 * 1024 * 1024) + b'"]}'
    response = http_calls.post(
        f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        content=body, timeout=60,
    )
    _error(response, 413, "request_too_large", None)

    def chunks():  # no Content-Length: the cap holds on the stream too
        yield b'{"model": "llama-tiny", "prompts": ["'
        for _ in range(51):
            yield b"a" * (1024 * 1024)
        yield b'"]}'

    response = http_calls.post(
        f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        content=chunks(), timeout=60,
    )
    _error(response, 413, "request_too_large", None)


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer acs_wrong", "Basic abc"])
def test_missing_or_wrong_key_is_401(harvest_api, header):
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("POST", "/harvest"), ("GET", "/harvest"), ("GET", "/harvest/x"), ("DELETE", "/harvest/x")):
        response = http_calls.request(method, f"{harvest_api.base_url}{path}", headers=headers, json=OK, timeout=30)
        _error(response, 401, "invalid_api_key", None)


def test_revoked_key_is_401(harvest_api):
    key = harvest_api.make_key(name="to-revoke")
    assert http_calls.get(f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    env = {**os.environ, "HARVEST_DATABASE_URL": harvest_api.env["HARVEST_DATABASE_URL"]}
    out = subprocess.run([sys.executable, "-m", "fleet.cli", "keys", "revoke", key[:10]], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True)
    assert "revoked 1" in out.stdout
    _error(http_calls.get(f"{harvest_api.base_url}/harvest", headers={"Authorization": f"Bearer {key}"}), 401, "invalid_api_key", None)


def test_unknown_job_and_bad_wait(harvest_api, key):
    auth = {"Authorization": f"Bearer {key}"}
    for method in ("GET", "DELETE"):
        response = http_calls.request(method, f"{harvest_api.base_url}/harvest/5b1c5b1e-0000-4000-8000-000000000000", headers=auth)
        _error(response, 404, "harvest_job_not_found", "job_id")
    job = _post(harvest_api, key, OK).json()["job_id"]
    try:
        for wait in ("61", "-1", "soon"):
            response = http_calls.get(f"{harvest_api.base_url}/harvest/{job}", params={"wait": wait}, headers=auth)
            _error(response, 400, "invalid_request", "wait")
        _error(http_calls.get(f"{harvest_api.base_url}/harvest", params={"limit": 0}, headers=auth), 400, "invalid_request", "limit")
    finally:
        http_calls.delete(f"{harvest_api.base_url}/harvest/{job}", headers=auth)


def _cancel_all(server, key, jobs):
    for job in jobs:
        http_calls.delete(f"{server.base_url}/harvest/{job}", headers={"Authorization": f"Bearer {key}"})


def test_concurrency_cap_names_the_lane(harvest_api):
    key = harvest_api.make_key(name="lanes", small=3, large=1)
    small = [_post(harvest_api, key, OK).json()["job_id"] for _ in range(3)]
    large = [_post(harvest_api, key, {**OK, "model": "llama-tiny-large"}).json()["job_id"]]
    try:
        error = _error(_post(harvest_api, key, OK), 429, "harvest_concurrency_exceeded", None)
        assert error["message"] == (
            "You have 3 harvests on small models queued or running, your most. "
            "Submit another when one ends, or cancel one."
        )
        error = _error(_post(harvest_api, key, {**OK, "model": "llama-tiny-large"}), 429, "harvest_concurrency_exceeded", None)
        assert "on large models" in error["message"]
        _cancel_all(harvest_api, key, small[:1])  # a cancel frees the slot at once
        assert _post(harvest_api, key, OK).status_code == 202
    finally:
        _cancel_all(harvest_api, key, small + large)
        body = http_calls.get(f"{harvest_api.base_url}/harvest?limit=100", headers={"Authorization": f"Bearer {key}"}).json()
        _cancel_all(harvest_api, key, [j["job_id"] for j in body["data"] if j["status"] == "pending"])


def test_monthly_quota_and_token_budget(harvest_api):
    quota_key = harvest_api.make_key(name="quota", monthly_jobs=1)
    first = _post(harvest_api, quota_key, OK).json()["job_id"]
    _cancel_all(harvest_api, quota_key, [first])
    error = _error(_post(harvest_api, quota_key, OK), 429, "harvest_quota_exceeded", None)
    assert "monthly quota of 1" in error["message"]

    budget_key = harvest_api.make_key(name="budget", token_budget=10)
    error = _error(_post(harvest_api, budget_key, {**OK, "prompts": ["zq " * 20]}), 429, "budget_exceeded", None)
    assert "has 10 of its 10 monthly harvest tokens left (0 charged or held)" in error["message"], error
    assert _post(harvest_api, budget_key, OK).status_code == 202  # a small one fits


def test_lane_capacity_is_service_wide(harvest_api):
    # harvest_api allows 2 large-lane jobs across the service; each key may hold 1.
    keys = [harvest_api.make_key(name=f"cap{i}") for i in range(3)]
    held = [(k, _post(harvest_api, k, {**OK, "model": "llama-tiny-large"})) for k in keys[:2]]
    try:
        assert [r.status_code for _, r in held] == [202, 202]
        error = _error(_post(harvest_api, keys[2], {**OK, "model": "llama-tiny-large"}), 429, "harvest_capacity_exceeded", None)
        assert "large lane" in error["message"]
    finally:
        for k, r in held:
            _cancel_all(harvest_api, k, [r.json()["job_id"]])


def test_spend_cap_switch_from_the_admin_command(harvest_api, key):
    env = {**os.environ, "HARVEST_DATABASE_URL": harvest_api.env["HARVEST_DATABASE_URL"]}
    cli = [sys.executable, "-m", "fleet.cli", "spend-cap"]
    subprocess.run([*cli, "on", "--retry-after", "90"], env=env, cwd=REPO, check=True, capture_output=True)
    try:
        response = _post(harvest_api, key, OK)
        _error(response, 429, "spend_cap", None)
        assert response.headers["Retry-After"] == "90"
    finally:
        subprocess.run([*cli, "off"], env=env, cwd=REPO, check=True, capture_output=True)
    job = _post(harvest_api, key, OK)
    assert job.status_code == 202
    _cancel_all(harvest_api, key, [job.json()["job_id"]])


def test_refused_submits_create_nothing(harvest_api):
    key = harvest_api.make_key(name="nothing")
    auth = {"Authorization": f"Bearer {key}"}
    _post(harvest_api, key, {**OK, "layers": [99]})
    _post(harvest_api, key, {**OK, "model": "gpt-5"})
    assert http_calls.get(f"{harvest_api.base_url}/harvest", headers=auth).json()["data"] == []
