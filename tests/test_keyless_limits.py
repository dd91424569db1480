"""Requests without a valid key are limited per client address, and can neither lock a valid
key out nor dodge the limit by naming their own address (issue #36, item 2); `/health` tells
nothing about the host without a key (item 6), nor to a tenant's key: only the operator's
metrics token learns the replica's host and pid (issue #44, item 6).

Against the real app under uvicorn on loopback, started the way every role starts it
(`fleet.roles.start_api_replica`, with its uvicorn flags), with the Prefect-free run store of
the API tests. Each server's address limit is 5 requests at once, then one per 100 s, so a few
requests empty it. Measured before: 102 × 401 then 48 × 429 for keyless requests, then the
same address's valid key 429; a fresh X-Forwarded-For per request was never limited.
"""

from __future__ import annotations

import secrets
import socket
import uuid
from pathlib import Path

import pytest

from testbed import http_calls
from tests.api_fixtures import FILE_RUNS_APP, REPO, free_port

BURST = 5


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


class Replica:
    """One API replica started by the fleet's own launcher, with `trusted` proxies."""

    def __init__(self, home: Path, trusted: str):
        self.home, self.trusted = home, trusted
        self.dir = home / "api" / f"keyless-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)
        self.database_url = f"sqlite:///{self.dir / 'harvest.db'}"
        self.metrics_token = secrets.token_urlsafe(24)  # the operator's
        self.managed = None

    def __enter__(self) -> "Replica":
        from fleet.roles import start_api_replica

        env = {
            "HARVEST_DATABASE_URL": self.database_url,
            "HARVEST_STORAGE_URL": f"file://{self.dir / 'storage'}",
            "HARVEST_TEST_RUNS_DIR": str(self.dir / "runs"),
            "HARVEST_RATE_ANONYMOUS_BURST": str(BURST),
            "HARVEST_RATE_ANONYMOUS_PER_S": "0.01",
            "HARVEST_TRUSTED_PROXIES": self.trusted,
            "HARVEST_METRICS_TOKEN": self.metrics_token,
            # The control plane's secrets, as a one-box launcher holds them: never the replica's.
            "PREFECT_SERVER_API_AUTH_STRING": "harvest:server-side",
            "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect:pw@127.0.0.1:9/prefect",
            "PYTHONPATH": str(REPO),
        }
        # The launcher hands the replica the operator's setting, as `harvest api` does.
        self.managed, base = start_api_replica(self.home, "127.0.0.1", free_port(), env, timeout=180, app=FILE_RUNS_APP,
                                               trusted_proxies=self.trusted)
        self.base_url = base
        self.root = self.base_url.removesuffix("/v1")
        return self

    def __exit__(self, *exc) -> None:
        if self.managed is not None:
            self.managed.stop()

    def make_key(self, name: str) -> str:
        from api.auth import create_key
        from api.db import make_engine, upgrade

        engine = make_engine(self.database_url)
        try:
            upgrade(engine)
            return create_key(name, engine=engine)[0]
        finally:
            engine.dispose()

    def models(self, headers: dict | None = None) -> int:
        return http_calls.get(f"{self.base_url}/models", headers=headers or {}, timeout=30).status_code


@pytest.fixture(scope="module")
def untrusted(harvest_home, tiny):
    """A replica with HARVEST_TRUSTED_PROXIES empty (the default)."""
    with Replica(harvest_home, "") as replica:
        yield replica


@pytest.fixture(scope="module")
def behind_proxy(harvest_home, tiny):
    """A replica whose proxy is on loopback: HARVEST_TRUSTED_PROXIES=127.0.0.1."""
    with Replica(harvest_home, "127.0.0.1") as replica:
        yield replica


def test_a_valid_key_is_never_refused_after_a_keyless_flood_from_its_address(untrusted):
    seen = untrusted.make_key("seen-before")
    assert untrusted.models(_auth(seen)) == 200  # this replica has met it
    flood = [untrusted.models() for _ in range(3 * BURST)]
    assert flood.count(401) <= BURST and flood[-BURST:] == [429] * BURST, flood
    made_now = untrusted.make_key("made-after-the-flood")  # never seen by the replica
    for _ in range(3):
        assert untrusted.models(_auth(seen)) == 200
        assert untrusted.models(_auth(made_now)) == 200
    # The address stays limited for everything else: no key, a made-up key, a malformed one.
    assert untrusted.models() == 429
    assert untrusted.models(_auth("acs_" + "q" * 43)) == 429
    assert untrusted.models(_auth("not-a-key")) == 429


def test_a_revoked_key_is_refused_and_charged_to_its_address(untrusted):
    from api.auth import revoke_key
    from api.db import make_engine

    key = untrusted.make_key("to-revoke")
    assert untrusted.models(_auth(key)) == 200
    engine = make_engine(untrusted.database_url)
    try:
        assert revoke_key("to-revoke", engine=engine) == 1
    finally:
        engine.dispose()
    assert untrusted.models(_auth(key)) in (401, 429)
    assert untrusted.models(_auth(key)) == 429  # the address was empty already: refused before the store


def test_a_fresh_forwarded_for_per_request_is_limited_from_an_untrusted_peer(untrusted):
    answers = [
        untrusted.models({"X-Forwarded-For": f"198.51.100.{i}"}) for i in range(3 * BURST)
    ]
    assert answers.count(401) <= BURST and answers.count(429) >= 2 * BURST, answers


def test_the_forwarded_address_is_the_clients_behind_a_trusted_proxy(behind_proxy):
    # Each forwarded client has its own bucket: twice the burst from fresh addresses, all 401.
    fresh = [behind_proxy.models({"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(2 * BURST)]
    assert fresh == [401] * (2 * BURST), fresh
    # One forwarded client over its burst is limited, and only it.
    same = [behind_proxy.models({"X-Forwarded-For": "192.0.2.7"}) for _ in range(2 * BURST)]
    assert same[:BURST] == [401] * BURST and same[BURST:] == [429] * BURST, same
    assert behind_proxy.models({"X-Forwarded-For": "192.0.2.8"}) == 401
    assert behind_proxy.models() == 401  # the proxy's own address (no header) is its own bucket


def test_health_tells_the_host_to_the_operator_only(untrusted):
    # The server's own pid and host name, from outside it: the uvicorn process the launcher started.
    pid, host = str(untrusted.managed.pid), socket.gethostname()
    plain = http_calls.get(f"{untrusted.root}/health", timeout=10)
    assert plain.status_code == 200 and plain.json() == {"status": "ok"}, plain.text
    wrong = http_calls.get(f"{untrusted.root}/health", headers=_auth("acs_" + "z" * 43), timeout=10)
    assert wrong.status_code == 200 and wrong.json() == {"status": "ok"}, wrong.text
    tenant = http_calls.get(f"{untrusted.root}/health", headers=_auth(untrusted.make_key("health")), timeout=10)
    assert tenant.status_code == 200 and tenant.json() == {"status": "ok"}, tenant.text
    assert pid not in tenant.text and host not in tenant.text, tenant.text
    detail = http_calls.get(f"{untrusted.root}/health", headers=_auth(untrusted.metrics_token), timeout=10).json()
    assert detail["status"] == "ok" and set(detail) == {"status", "replica", "watcher"}, detail
    assert detail["replica"].split(":")[:2] == [host, pid], detail
    assert isinstance(detail["watcher"], bool)


def test_the_replica_is_handed_only_its_own_secrets(untrusted):
    """Its uvicorn, read from /proc: the job store, the links' key and its /metrics token, but
    not what only the control plane uses (`fleet.processes.API_NEEDS`)."""
    import psutil

    env = psutil.Process(untrusted.managed.pid).environ()
    assert env["HARVEST_DATABASE_URL"] == untrusted.database_url and env["HARVEST_METRICS_TOKEN"] == untrusted.metrics_token
    assert "PREFECT_SERVER_API_AUTH_STRING" not in env and "PREFECT_API_DATABASE_CONNECTION_URL" not in env


def test_trusted_proxies_must_be_addresses_or_networks(monkeypatch):
    from pydantic import ValidationError

    from fleet.proxies import uvicorn_proxy_args
    from api.settings import ApiSettings

    monkeypatch.setenv("HARVEST_TRUSTED_PROXIES", " 10.0.0.5, 10.1.0.0/16 ")
    assert ApiSettings().trusted_proxies == "10.0.0.5,10.1.0.0/16"
    assert uvicorn_proxy_args(ApiSettings().trusted_proxies) == ["--proxy-headers", "--forwarded-allow-ips", "10.0.0.5,10.1.0.0/16"]
    assert uvicorn_proxy_args(ApiSettings(trusted_proxies="").trusted_proxies) == ["--no-proxy-headers"]
    monkeypatch.setenv("HARVEST_TRUSTED_PROXIES", "lb.example.internal")
    with pytest.raises(ValidationError, match="not an IP address or network"):
        ApiSettings()
