"""Prefect's clients share one TLS context (`flows.prefect_clients`), in an API replica and in
the runs a worker host's starter forks.

Against the session's real Prefect server (basic auth on), counting where Python's `ssl` loads
a CA bundle: a run created with Prefect's own client is read by the API's run store 20 times
with at most one load (before: one per read); a process that preloads as a run starter does,
then makes clients the ways Prefect's own services do (sync and async, a caller's own `verify`
kept), loads none, and those clients read the run.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scheduled_run(prefect_server) -> str:
    """A flow run of no deployment (no worker runs it), made with Prefect's own client."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="tls-context-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        return str(client.create_flow_run(probe).id)


def test_the_api_reads_runs_with_clients_that_share_one_tls_context(scheduled_run, monkeypatch):
    from api.runs import PrefectRuns
    from harvest.settings import get_settings

    loads = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(args or kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    runs = PrefectRuns(get_settings())
    states = [runs.read([scheduled_run]) for _ in range(20)]
    assert all(state[scheduled_run].status == "pending" for state in states), states[-1]
    assert len(loads) <= 1, f"the CA bundle was loaded {len(loads)} times for 20 reads"


_AFTER_PRELOAD = """
import asyncio, ssl, sys
from fleet.run_fork import preload
preload()
loads = []
original = ssl.SSLContext.load_verify_locations
def counted(self, *args, **kwargs):
    loads.append(1)
    return original(self, *args, **kwargs)
ssl.SSLContext.load_verify_locations = counted
from prefect.client.orchestration import get_client
run_id = sys.argv[1]
with get_client(sync_client=True) as client:
    sync_state = client.read_flow_run(run_id).state.type.value
async def read():
    async with get_client() as client:
        return (await client.read_flow_run(run_id)).state.type.value
async_state = asyncio.run(read())
shared = len(loads)
with get_client(httpx_settings={"verify": True}, sync_client=True) as client:  # its own choice
    client.read_flow_run(run_id)
print(sync_state, async_state, shared, len(loads) - shared)
"""


def test_a_preloaded_run_starters_prefect_clients_build_no_tls_context(scheduled_run):
    from prefect.client.orchestration import get_client

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _AFTER_PRELOAD, scheduled_run], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sync_state, async_state, shared, own = done.stdout.split()[-4:]
    with get_client(sync_client=True) as client:  # Prefect's own client, in this process
        assert sync_state == async_state == client.read_flow_run(scheduled_run).state.type.value
    assert int(shared) == 0, f"{shared} CA bundles loaded by clients after the preload"
    assert int(own) >= 1  # a client that chose its own verification builds its own (Prefect and httpx do)
