"""Session-wide test set-up: one HARVEST_HOME (so the embedded model is built once), quiet
Prefect, and the fixture plugins of each layer (Prefect server, API server)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Set before anything imports harvest.settings (it is cached) or Prefect (it reads env at import).
_SESSION_HOME = Path(os.environ.get("HARVEST_TEST_HOME") or tempfile.mkdtemp(prefix="harvest-test-"))
os.environ["HARVEST_HOME"] = str(_SESSION_HOME)
os.environ.setdefault("PREFECT_HOME", str(_SESSION_HOME / "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

pytest_plugins = ["tests.prefect_fixtures", "tests.api_fixtures"]


@pytest.fixture(scope="session")
def harvest_home() -> Path:
    return _SESSION_HOME


@pytest.fixture(scope="session")
def registry():
    from harvest.registry import load_registry

    return load_registry()


@pytest.fixture(scope="session")
def tiny(registry):
    """The embedded model's registry entry (built on first use)."""
    return registry.get("llama-tiny")


@pytest.fixture(scope="session")
def hf_engine(tiny):
    """One warm HF reference engine for the whole session."""
    from harvest.engines.hf import HFEngine

    return HFEngine(tiny)
