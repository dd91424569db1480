"""The API servers' session fixtures (`conftest.pytest_plugins`); the servers, run stores and
helpers they are made of live in `testbed.api_server`, which its docstring describes and the
benches use too. The names below are re-exported for the test modules that import them here."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.api_server import (  # noqa: F401 (re-exported)
    FILE_RUNS_APP, FLOW_ENV_APP, PRODUCTION_APP, REPO, SECOND_SMALL_MODEL, TEST_LANES, TEST_MODELS, ApiServer, FileRuns,
    PortInUse, _server, drop_pg_schema, finish_run, free_port, harvest_api_env, harvest_up, longpoll_waiters, pg_api_server,
    pg_schema_url, serve_in_thread, set_run, wait_for_longpoll_waiters,
)


@pytest.fixture(scope="session")
def api_server(harvest_home: Path, tiny):
    yield from _server(harvest_home, "plain")


@pytest.fixture(scope="session")
def job_store():
    """The session's job store, migrated (`testbed.api_server`'s docstring)."""
    from api.db import JobStore
    from api.settings import ApiSettings
    from harvest.settings import get_settings

    store = JobStore.from_settings(get_settings(ApiSettings)).migrate()
    yield store
    store.dispose()


@pytest.fixture(scope="session")
def api_base_url(api_server: ApiServer) -> str:
    return api_server.base_url


@pytest.fixture(scope="session")
def make_key(api_server: ApiServer):
    return api_server.make_key


@pytest.fixture(scope="session")
def harvest_api(harvest_home: Path, tiny):
    yield from _server(harvest_home, "harvest", harvest_api_env(harvest_home))
