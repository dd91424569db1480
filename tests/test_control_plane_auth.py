"""The control plane is closed: the test session's Prefect server runs with basic auth on, as
every role runs it (`flows.prefect_auth`), so the whole suite's flows, workers and API
replicas run through it with the password. Without it, or with a wrong one, the Prefect API
answers 401; health checks stay open.
"""

from __future__ import annotations

import pytest

from flows.prefect_auth import basic_header, client_auth, server_auth

from testbed import http_calls


def test_the_session_prefect_api_answers_401_without_its_password(prefect_server):
    url = f"{prefect_server.api_url}/flow_runs/filter"
    assert http_calls.post(url, json={}, timeout=10).status_code == 401
    assert http_calls.post(url, json={}, headers=basic_header("harvest-test:wrong"), timeout=10).status_code == 401
    answer = http_calls.post(url, json={}, headers=basic_header(prefect_server.auth), timeout=10)
    assert answer.status_code == 200, answer.text
    assert http_calls.get(f"{prefect_server.api_url}/health", timeout=5).status_code == 200


def test_a_password_is_generated_once_owner_only_and_found_by_clients(tmp_path, monkeypatch):
    for name in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"):
        monkeypatch.delenv(name, raising=False)
    assert client_auth(tmp_path) is None
    first = server_auth(tmp_path)
    user, _, password = first.partition(":")
    assert user == "harvest" and len(password) >= 32
    assert (tmp_path / "prefect-auth").stat().st_mode & 0o777 == 0o600
    assert server_auth(tmp_path) == first == client_auth(tmp_path)  # kept, and found on this host
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "ops:given")
    assert server_auth(tmp_path) == client_auth(tmp_path) == "ops:given"  # the environment wins
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "no-password")
    with pytest.raises(SystemExit, match="user:password"):
        client_auth(tmp_path)
