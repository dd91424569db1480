"""Session-wide test set-up: one HARVEST_HOME (so the embedded model is built once), quiet
Prefect, and the fixture plugins of each layer (Prefect server, API server)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Set before anything imports harvest.settings (it is cached) or Prefect (it reads env at import).
_SESSION_HOME = Path(os.environ.get("HARVEST_TEST_HOME") or tempfile.mkdtemp(prefix="harvest-test-"))
os.environ["HARVEST_HOME"] = str(_SESSION_HOME)
# Test processes (pytest-xdist) each have a session of their own, but share the checkpoints the
# project builds: the first to need one builds it and the others wait for it
# (`harvest.built_checkpoints`: a lock beside it, renamed into place whole). The controlling
# process, which starts them, names the folder.
_SHARED_MODELS = "HARVEST_TEST_MODELS"
# Likewise the empty, migrated Prefect database the session servers start from
# (`tests.prefect_fixtures.with_migrated_database`).
_SHARED_PREFECT_DATABASE = "HARVEST_TEST_PREFECT_DATABASE"
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault(_SHARED_MODELS, tempfile.mkdtemp(prefix="harvest-test-models-"))
    os.environ.setdefault(_SHARED_PREFECT_DATABASE, tempfile.mkdtemp(prefix="harvest-test-prefect-db-"))
elif not (_SESSION_HOME / "models").exists():
    (_SESSION_HOME / "models").symlink_to(os.environ[_SHARED_MODELS], target_is_directory=True)
os.environ.setdefault("PREFECT_HOME", str(_SESSION_HOME / "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from harvest.settings import get_settings

pytest_plugins = ["tests.prefect_fixtures", "tests.api_fixtures", "tests.s3_fixtures"]


@pytest.fixture(scope="session")
def harvest_home() -> Path:
    return _SESSION_HOME


def _engine_servers_of_this_session(roots: list[Path]) -> list[int]:
    """Pids of warm-engine servers (`harvest.warm.server`) whose HARVEST_HOME lies under one
    of `roots`: runs of this session's worker hosts started them, detached."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"harvest.warm.server" not in (proc / "cmdline").read_bytes():
                continue
            env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        home = env.get(b"HARVEST_HOME", b"").decode()
        if any(home.startswith(str(root)) for root in roots):
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="session", autouse=True)
def stop_engine_servers_at_the_end(tmp_path_factory):
    """Engine servers outlive the runs that started them (that is their point); the session
    stops the ones its hosts started, wherever their home was."""
    yield
    import signal

    for pid in _engine_servers_of_this_session([_SESSION_HOME, tmp_path_factory.getbasetemp()]):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


# The slowest modules, slowest first, as a full two-process run measured them (its
# `--durations`, summed by module). Test processes take whole modules in collection order
# (`make test`: `--dist loadfile --no-loadscope-reorder`), so the longest start first and
# the short ones fill the ends: no process is left running one long module while the others
# idle. A stale order only costs balance, never a result.
SLOWEST_MODULES = [
    "test_fleet.py", "test_liveness.py", "test_warm_engines.py", "test_stack.py", "test_placement.py",
    "test_client_manners.py", "test_storage_fresh.py", "test_up_s3.py", "test_scaled_control_plane.py",
    "test_api_hardening.py",
    "test_keyless_limits.py", "test_notebooks.py", "test_architectures.py", "test_faults_stack.py", "test_openai_client.py",
    "test_submit_overload.py", "test_fidelity.py", "test_flows_ops.py", "test_storage_quota.py",
    "test_watcher_events.py", "test_api_jobs.py",
]

# Modules one test process takes as one unit, in this order. The first of each waits out
# Prefect's windows (heartbeats, crash and cancel automations: minutes, with the CPU idle) in a
# thread of its own (`tests.background`); the others, which touch nothing the waiting scenario
# uses, keep the CPU busy meanwhile, and the tests marked `after_its_partners` (the scenario's
# verdict and what must follow it) run after them.
RUN_TOGETHER = [
    ["test_fleet.py", "test_client.py", "test_inline_e2e.py"],
    # The real model's modules together: its checkpoint build and its GGUF reference (~70 s)
    # are session fixtures, paid once by one process instead of once by each.
    ["test_liveness.py", "test_smollm2.py", "test_smollm2_client.py", "test_openai_client.py", "test_openapi_fuzz.py"],
]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "after_its_partners: runs after the modules its module runs with (tests/conftest.py, RUN_TOGETHER)")


def _unit_of(module: str) -> str:
    """The unit of work a test process takes `module` in: its RUN_TOGETHER group, else itself."""
    return next((group[0] for group in RUN_TOGETHER if module in group), module)


def pytest_collection_modifyitems(items):
    """The slowest modules first (`SLOWEST_MODULES`), the rest after them in file order; a
    RUN_TOGETHER group's modules together where its first module ranks, in the group's order,
    its `after_its_partners` tests last; otherwise the tests of a module keep their order."""
    rank = {name: place for place, name in enumerate(SLOWEST_MODULES)}
    in_group = {name: place for group in RUN_TOGETHER for place, name in enumerate(group)}

    def place(item):
        module = item.path.name
        late = item.get_closest_marker("after_its_partners") is not None
        return rank.get(_unit_of(module), len(rank)), late, in_group.get(module, 0)

    items.sort(key=place)  # stable: a module's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with each RUN_TOGETHER group one unit of work instead of one per module."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TogetherScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(Path(super()._split_scope(nodeid)).name)

    return TogetherScheduling(config, log)


@pytest.fixture(autouse=True)
def runner_keeps_its_priority():
    """In-process generation lowers its thread for good (`harvest.engines.hf_generate`: an
    engine's thread is never raised back). Here that thread is the test runner's, and every
    process a later test starts from it would inherit the lowered nice (a test of lowering to
    7 then found 10): each test hands the runner's thread back as it found it (on Linux the
    nice is per thread; raising it back needs root, which the suite has)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    yield
    if os.getpriority(os.PRIO_PROCESS, 0) != before:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except PermissionError:
            pass


@pytest.fixture(scope="session")
def registry():
    from harvest.registry import load_registry

    return load_registry(get_settings())


@pytest.fixture(scope="session")
def tiny(registry):
    """The embedded model's registry entry (built on first use)."""
    return registry.get("llama-tiny")


@pytest.fixture(scope="session")
def hf_engine(tiny):
    """One warm HF reference engine for the whole session."""
    from harvest.engines.hf import HFEngine

    return HFEngine(tiny)
