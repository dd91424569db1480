"""The API's Prefect clients (`flows.prefect_clients`): one TLS context for every client.

Against the session's real Prefect server (basic auth on): a run created with Prefect's own
client is read by the API's run store many times, and the CA bundle is loaded at most once
(counted where Python's `ssl` loads it); before, every read built a context of its own.
"""

from __future__ import annotations

import ssl


def test_the_api_reads_runs_with_clients_that_share_one_tls_context(prefect_server, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from api.runs import PrefectRuns

    @flow(name="tls-context-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:  # Prefect's own: a run that stays Scheduled
        run_id = str(client.create_flow_run(probe).id)

    loads = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(args or kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    runs = PrefectRuns()
    states = [runs.read([run_id]) for _ in range(20)]
    assert all(state[run_id].status == "pending" for state in states), states[-1]
    assert len(loads) <= 1, f"the CA bundle was loaded {len(loads)} times for 20 reads"
