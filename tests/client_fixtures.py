"""The live stack for the client's tests and the notebooks: the session's real Prefect server
and lane workers (`harvest_stack`, tests/prefect_fixtures.py) behind one more uvicorn API whose
runs go to Prefect for real (the production app, `api.app:create_app`), on the storage the workers write.

Loaded by the test modules that need it through `pytest_plugins = ["tests.client_fixtures"]`,
which registers it once for the session, so the API starts once however many modules ask.

``client_api`` → ``ApiServer``: ``.base_url`` is what a researcher puts in ACS_API_BASE;
    ``.make_key(**limits)`` makes a key (small 3 by default, as the service's default).
``client_env`` → ``client_env(key) -> dict``: os.environ plus ACS_API_BASE/ACS_API_KEY (for
    subprocesses: the CLI, notebook kernels).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.api_fixtures import PRODUCTION_APP, ApiServer

__all__ = ["client_api", "client_env"]


@pytest.fixture(scope="session")
def client_api(harvest_home: Path, harvest_stack, tiny):
    server = ApiServer(harvest_home, "client", {
        "PREFECT_API_URL": harvest_stack.server.api_url,
        # the workers' storage: the default of the session's HARVEST_HOME
        "HARVEST_STORAGE_URL": f"file://{harvest_home / 'storage'}",
        "HARVEST_WATCH_INTERVAL_S": "0.5",
    }, app=PRODUCTION_APP).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client_env(client_api):
    def env(key: str) -> dict[str, str]:
        return {**os.environ, "ACS_API_BASE": client_api.base_url, "ACS_API_KEY": key}

    return env
