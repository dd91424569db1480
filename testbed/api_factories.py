"""The API app of the test servers: the production factory (`api.app.create_app`) handed the
run store a test swaps, for `uvicorn --factory testbed.api_factories:<name>` (`ApiServer`).

``file_runs_app``: runs as JSON files under ``HARVEST_TEST_RUNS_DIR`` (``testbed.api_server.FileRuns``).
``flow_env_app``: real Prefect runs given the environment in ``HARVEST_TEST_FLOW_ENV_FILE``
(``testbed.flow_env_runs.FlowEnvRuns``).
A server on real Prefect runs with nothing swapped runs ``api.app:create_app`` itself.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from api.app import create_app

__all__ = ["file_runs_app", "flow_env_app"]


def file_runs_app() -> FastAPI:
    from api.settings import ApiSettings
    from harvest.settings import get_settings
    from harvest.storage import StorageOptions
    from testbed.api_server import FileRuns

    settings = get_settings(ApiSettings)  # the replica's process: its own environment
    return create_app(settings=settings, runs=FileRuns(os.environ["HARVEST_TEST_RUNS_DIR"], StorageOptions.of(settings)))


def flow_env_app() -> FastAPI:
    from api.settings import ApiSettings
    from harvest.settings import get_settings
    from testbed.flow_env_runs import FlowEnvRuns

    settings = get_settings(ApiSettings)  # the replica's process: its own environment
    return create_app(settings=settings, runs=FlowEnvRuns(settings))
