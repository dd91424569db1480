"""One API for the fault and fidelity tests, on the production parts: the session's Prefect
server and lane workers (`harvest_stack`), a PostgreSQL job store (a schema of its own in the
`test` database at 127.0.0.1:5432), and its Prefect traffic through a `tests.fault_proxy`
(pass-through until a test adds a rule). Loaded with `pytest_plugins = ["tests.faults_fixtures"]`
by the modules that use it, so it starts once per session.

``faults_api`` → ``FaultsApi``: ``.server`` (``ApiServer``; ``.kill()``/``.start()`` on the
same port, store and storage), ``.proxy`` (the Prefect proxy), ``.key`` and ``.auth``,
``.pg_url`` (SQLAlchemy URL of its store), ``.flow_env(**extra)`` (the next runs'
environment: the test registry plus `extra`), ``.wait(job_id)``, ``.ledger(job_id)``.
The registry is `tests.api_fixtures`'s test registry (`llama-tiny-large` on the `large` lane);
the watcher ticks every 0.5 s and starts orphans after 1 s; request rates are high enough
for the tests, the waiter limit is 2 (as `harvest_api`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed import http_calls
from tests.api_fixtures import FLOW_ENV_APP, ApiServer, drop_pg_schema, harvest_api_env, pg_schema_url
from tests.fault_proxy import FaultProxy
from testbed.flow_env_runs import write_flow_env

__all__ = ["FaultsApi", "faults_api"]


@dataclass
class FaultsApi:
    server: ApiServer
    proxy: FaultProxy
    key: str
    pg_url: str
    env_file: Path
    registry_env: dict[str, str]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def flow_env(self, **extra: str) -> None:
        write_flow_env(self.env_file, {**self.registry_env, **extra})

    def read(self, job_id: str, **params) -> dict:
        answer = http_calls.get(f"{self.base_url}/harvest/{job_id}", headers=self.auth, params=params, timeout=90)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def wait(self, job_id: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        body = self.read(job_id)
        while body["status"] not in ("done", "failed", "cancelled"):
            assert time.monotonic() < deadline, body
            body = self.read(job_id, wait=20)
        return body

    def ledger(self, job_id: str) -> list[dict]:
        """The job's rows in the charge ledger, read with SQL (not through the API)."""
        from sqlalchemy import create_engine, text

        engine = create_engine(self.pg_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT * FROM charge_ledger WHERE job_id = :j"), {"j": job_id}).mappings().all()
        finally:
            engine.dispose()
        return [dict(r) for r in rows]


@pytest.fixture(scope="session")
def faults_api(harvest_home: Path, harvest_stack, tiny):
    schema = f"harvest_faults_{uuid.uuid4().hex[:10]}"
    pg_url = pg_schema_url(schema)
    upstream = harvest_stack.server.api_url.rsplit("/api", 1)[0]
    proxy = FaultProxy(upstream).start()
    registry_env = {k: v for k, v in harvest_api_env(harvest_home).items() if k in ("HARVEST_MODELS_FILE", "HARVEST_LANES_FILE")}
    env_file = harvest_home / "api" / "faults-flow-env.json"
    env_file.parent.mkdir(parents=True, exist_ok=True)
    write_flow_env(env_file, registry_env)
    server = ApiServer(harvest_home, "faults", {
        **harvest_api_env(harvest_home),
        "HARVEST_DATABASE_URL": pg_url,
        "HARVEST_TEST_FLOW_ENV_FILE": str(env_file),
        "PREFECT_API_URL": f"{proxy.url}/api",
        "HARVEST_WATCH_INTERVAL_S": "0.5",
        "HARVEST_RATE_SUBMIT_PER_S": "100",
        "HARVEST_RATE_READ_PER_S": "1000",
    }, app=FLOW_ENV_APP)
    try:
        server.start()
        key = server.make_key(name="faults", small=3, large=1)
        yield FaultsApi(server, proxy, key, pg_url, env_file, registry_env)
    finally:
        server.stop()
        proxy.stop()
        drop_pg_schema(pg_url, schema)
