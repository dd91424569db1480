"""Hosts that die, on a real Prefect server: its own heartbeat automations (`flows.liveness`)
mark the run of a SIGKILLed host Crashed, finish a cancel whose host is gone, and leave runs
on live hosts, and runs of pools they do not watch, alone.

The runs go to pools of their own (deployments `harvest/harvest-<pool>` of the same flow, made
here as `flows.deploy` makes a lane's), so the session's `small` worker never takes one first and
the test knows which worker holds which run without asking Prefect (one pool per worker):

    liveness-dead-1     a throwaway worker, SIGKILLed with its flow-run process (a host
                        lost): its run is left alone (→ Crashed)
    liveness-dead-2     another, killed at the same moment: its run is cancelled just after
                        (→ Cancelled, not Crashed, not stuck Cancelling)
    liveness-live       one throwaway worker that lives: a run longer than the crash window
                        completes, and a run cancelled on it ends Cancelled in seconds
    liveness-unwatched  one throwaway worker, killed too, on a pool the automations do not
                        name: its run stays Running (Prefect alone cannot tell)

All workers send heartbeats (`HEARTBEAT_ENV`). Everything runs concurrently: ~2 minutes, most
of it waiting out Prefect's windows. So the scenario runs in the background (`tests.background`),
started once the automations test has left the automations as the session keeps them, while this
test process runs the modules this one runs with (tests/conftest.py, RUN_TOGETHER); its verdict
comes after them.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone

import pytest

from flows.liveness import (
    CANCEL_AFTER_S,
    CANCEL_AUTOMATION,
    CANCEL_MESSAGE,
    CRASH_AFTER_S,
    CRASH_AUTOMATION,
    CRASH_MESSAGE,
    HEARTBEAT_ENV,
    PENDING_AUTOMATION,
    apply_automations_sync,
)
from harvest.storage import open_storage
from harvest.settings import get_settings
from testbed import http_calls
from tests.background import Background, start_if_awaited
from tests.prefect_fixtures import deploy_pool
from tests.slow_engine import slow_shards

DEAD_1, DEAD_2, LIVE, UNWATCHED = "liveness-dead-1", "liveness-dead-2", "liveness-live", "liveness-unwatched"
POOLS = (DEAD_1, DEAD_2, LIVE, UNWATCHED)


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _run(flow_run_id):
    with _client() as client:
        return client.read_flow_run(flow_run_id)


def _history(flow_run_id) -> list:
    with _client() as client:
        return client.read_flow_run_states(flow_run_id)


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _heartbeats(api_url: str, flow_run_id) -> list[datetime]:
    """When the run's `prefect.flow-run.heartbeat` events occurred, as Prefect recorded them."""
    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
            "order": "ASC",
        },
        "limit": 50,
    }
    # The control plane is closed: the session's server takes its password (prefect_fixtures).
    user, password = os.environ["PREFECT_API_AUTH_STRING"].split(":", 1)
    answer = http_calls.post(f"{api_url}/events/filter", json=body, timeout=10, auth=(user, password))
    answer.raise_for_status()
    return [datetime.fromisoformat(e["occurred"].replace("Z", "+00:00")) for e in answer.json()["events"]]


def _when(flow_run_id, kind) -> datetime:
    """When the run first entered a state of type `kind`."""
    return min(s.timestamp for s in _history(flow_run_id) if s.type == kind)


@pytest.fixture(scope="session")
def liveness(prefect_deployments):
    """This test's pools and deployments (none on a lane's pool), and the automations applied
    for the lanes' pools and the watched ones of this test (they stay for the session, as in
    production). Returns the watched pools."""
    for pool in POOLS:
        deploy_pool(pool)
    pools = ["small", "large", DEAD_1, DEAD_2, LIVE]
    apply_automations_sync(pools)
    return pools


def _submit(pool: str, n_prompts: int, pause_s: float):
    """A harvest job on `pool`, started as the API starts one; returns (flow run id, JobFiles)."""
    from flows.submit import start_harvest_run
    from harvest.jobfiles import JobFiles
    from harvest.request import HarvestRequest

    job_id = str(uuid.uuid4())
    files = JobFiles.for_job(job_id, open_storage(get_settings()))
    request = HarvestRequest.model_validate(
        {"model": "llama-tiny", "prompts": [f"prompt {k} of job {job_id[:8]}" for k in range(n_prompts)], "shard_size": 2}
    )
    url = files.write_request(request)
    return start_harvest_run(job_id, url, "llama-tiny", pool, "test", env=slow_shards(pause_s)), files


VERDICT = "test_dead_hosts_runs_end_crashed_or_cancelled_live_ones_untouched"


@pytest.fixture(scope="session")
def dead_hosts(liveness, lane_workers, prefect_server) -> Background:
    """The hosts scenario (`_kill_hosts_and_watch`), under way in the background."""
    return Background("dead hosts", lambda: _kill_hosts_and_watch(lane_workers, prefect_server))


def test_apply_automations_is_idempotent_by_name(liveness, request):
    names = [CRASH_AUTOMATION, PENDING_AUTOMATION, CANCEL_AUTOMATION]
    assert apply_automations_sync(liveness) == names
    assert apply_automations_sync(liveness + ["elsewhere"]) == names  # re-applied: updated in place
    with _client() as client:
        found = [a for a in client.read_automations() if a.name in names]
        assert sorted(a.name for a in found) == sorted(names)  # exactly one of each
        crash = next(a for a in found if a.name == CRASH_AUTOMATION)
        assert "elsewhere" in crash.trigger.match_related.root["prefect.resource.name"]
    assert apply_automations_sync(liveness) == names
    with _client() as client:
        crash = next(a for a in client.read_automations() if a.name == CRASH_AUTOMATION)
        assert sorted(crash.trigger.match_related.root["prefect.resource.name"]) == sorted(liveness)
        assert crash.trigger.within.total_seconds() == CRASH_AFTER_S and crash.enabled
    # The automations are as the session keeps them again: the hosts scenario may start (it
    # waits out its windows while the next modules run).
    start_if_awaited(request, "dead_hosts", VERDICT)


@pytest.mark.after_its_partners
def test_dead_hosts_runs_end_crashed_or_cancelled_live_ones_untouched(dead_hosts):
    print(dead_hosts.outcome(timeout=900))


def _kill_hosts_and_watch(lane_workers, prefect_server) -> str:
    """The scenario of the module docstring, its checks included; returns its timings."""
    from flows.submit import cancel_harvest_run
    from prefect.client.schemas.objects import StateType

    began = _now()
    workers = [lane_workers.start(pool, env=HEARTBEAT_ENV) for pool in POOLS]
    dead, live, unwatched = workers[:2], workers[2], workers[3]
    # The doomed runs are killed after their second shard, so they cost nothing by being long;
    # long enough (400 s of shards) that none can end before the slowest of them has started on
    # a loaded host: the kill must find all three mid-run.
    crashing, crashing_files = _submit(DEAD_1, 400, 2)
    cancelled, cancelled_files = _submit(DEAD_2, 400, 2)
    orphan, orphan_files = _submit(UNWATCHED, 400, 2)
    # Longer than the crash window on a live host: two heartbeat windows roll over meanwhile.
    normal, _ = _submit(LIVE, 2 * 20, CRASH_AFTER_S / 20 + 0.2)
    runs = [crashing, cancelled, orphan, normal]
    try:
        doomed = [(crashing, crashing_files), (cancelled, cancelled_files), (orphan, orphan_files)]
        def where_they_are() -> str:
            return "; ".join(f"{_run(r).state.name} with {f.shards_done()} shards" for r, f in doomed)

        try:
            _wait_for(
                lambda: all(_run(r).state.type == StateType.RUNNING and f.shards_done() >= 2 for r, f in doomed),
                300,
                "the three doomed runs Running with 2 shards written",
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {where_they_are()}") from None
        for worker in [*dead, unwatched]:
            lane_workers.kill(worker)  # the worker and its flow-run processes at once: a lost host
        killed_at = _now()
        assert not any(w.alive() for w in [*dead, unwatched]) and live.alive()
        shards_at_kill = crashing_files.shards_done()
        assert cancel_harvest_run(cancelled) == "cancelled"  # Cancelling: nobody left to finish it
        cancel_at = _now()

        # A cancel on a live host: the host finishes it in seconds, not the automation.
        quick, quick_files = _submit(LIVE, 40, 2)
        runs.append(quick)
        _wait_for(lambda: quick_files.shards_done() >= 1, 180, "the live run's first shard")
        quick_cancel_at = _now()
        assert cancel_harvest_run(quick) == "cancelled"
        _wait_for(lambda: _run(quick).state.type == StateType.CANCELLED, 20, "the live cancel")

        def final(run_id):
            return _run(run_id).state.is_final()

        _wait_for(lambda: all(final(r) for r in (crashing, cancelled, normal)), 240, "the runs to end", poll=1)
        # The unwatched run: past the moment the crash automation would have fired for it.
        time.sleep(max(0.0, CRASH_AFTER_S + 10 - (_now() - killed_at).total_seconds()))

        crashed = _run(crashing)
        assert crashed.state.type == StateType.CRASHED, crashed.state
        assert crashed.state.message == CRASH_MESSAGE
        crash_s = (crashed.state.timestamp - killed_at).total_seconds()
        # Crashed one window after its last heartbeat (sent before the kill, a heartbeat
        # interval or so earlier: later on a loaded host), plus the server's evaluation tick.
        beats = _heartbeats(prefect_server.api_url, crashing)
        assert beats and beats[-1] <= killed_at, beats
        silent_s = (crashed.state.timestamp - beats[-1]).total_seconds()
        assert CRASH_AFTER_S - 1 <= silent_s <= CRASH_AFTER_S + 30, silent_s
        assert 0 < crash_s <= CRASH_AFTER_S + 30, crash_s
        assert crashing_files.shards_done() == shards_at_kill  # nothing ran after the kill

        ended = _run(cancelled)
        assert ended.state.type == StateType.CANCELLED, ended.state
        assert ended.state.message == CANCEL_MESSAGE
        cancel_s = (ended.state.timestamp - cancel_at).total_seconds()
        cancelling_s = (ended.state.timestamp - _when(cancelled, StateType.CANCELLING)).total_seconds()
        assert CANCEL_AFTER_S - 1 <= cancelling_s <= CANCEL_AFTER_S + 30, cancelling_s
        assert StateType.CRASHED not in [s.type for s in _history(cancelled)]

        done = _run(normal)
        assert done.state.type == StateType.COMPLETED, done.state
        assert StateType.CRASHED not in [s.type for s in _history(normal)]
        assert (done.end_time - done.start_time).total_seconds() > CRASH_AFTER_S  # it did outlive a window
        beats = _heartbeats(prefect_server.api_url, normal)
        gaps = [(b - a).total_seconds() for a, b in zip(beats, beats[1:])]
        assert len(beats) >= 3 and max(gaps) < CRASH_AFTER_S, gaps

        stopped = _run(quick)
        assert stopped.state.type == StateType.CANCELLED and stopped.state.message != CANCEL_MESSAGE, stopped.state
        quick_s = (_when(quick, StateType.CANCELLED) - quick_cancel_at).total_seconds()
        assert quick_s < 10, quick_s

        assert _run(orphan).state.type == StateType.RUNNING  # not a watched pool: left alone
        return (
            f"kill at +{(killed_at - began).total_seconds():.1f} s; kill → Crashed {crash_s:.1f} s (last heartbeat → "
            f"Crashed {silent_s:.1f} s); cancel → Cancelled {cancel_s:.1f} s; live cancel {quick_s:.1f} s; live run "
            f"{(done.end_time - done.start_time).total_seconds():.0f} s, heartbeat gaps {[round(g, 1) for g in gaps]}"
        )
    finally:
        with _client() as client:  # leave nothing running in the session's server
            from prefect.states import Crashed

            for run_id in runs:
                if not client.read_flow_run(run_id).state.is_final():
                    client.set_flow_run_state(run_id, Crashed(message="test_liveness teardown"), force=True)
        for worker in workers:
            if worker.alive():
                worker.stop()
