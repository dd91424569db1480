"""Operating the flows on a real Prefect server: cancellation (during forward passes and while
the model loads), a worker lost mid-job (the reaper reschedules, a new worker resumes without
recomputing shards), a run stuck CANCELLING after its worker died, and the pool limit."""

from __future__ import annotations

import json
import time

import psutil

from harvest.manifest import MANIFEST

PAUSE = "HARVEST_FLOW_SHARD_PAUSE_S"
LOAD_PAUSE = "HARVEST_FLOW_LOAD_PAUSE_S"


def _progress(job) -> dict:
    try:
        return json.loads(job.storage.read_bytes("_progress.json"))
    except FileNotFoundError:
        return {}


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def _state_name(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.name


def _shards(job) -> list[str]:
    return sorted(n for n in job.storage.listdir() if n.startswith("shard_"))


def _cancelled_within(job, seconds: float) -> float:
    """Cancel the job's run as the API does; returns how long until it is Cancelled."""
    from flows.submit import cancel_harvest_run

    started = time.monotonic()
    assert cancel_harvest_run(job.flow_run_id) == "cancelled"
    _wait_for(lambda: _state_name(job.flow_run_id) == "Cancelled", 30, "Cancelled")
    return time.monotonic() - started


def test_cancel_during_forward_passes_lands_within_5_s(harvest_stack):
    # ~1000-token prompts through every layer: one shard's forward pass takes seconds here,
    # so the cancel lands inside one, not between shards.
    job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["word " * 500] * 40, "shard_size": 4, "layers": "all"})
    _wait_for(lambda: _progress(job).get("shards_done", 0) >= 1, 240, "the first shard")
    latency = _cancelled_within(job, 5)
    assert latency < 5, f"cancel took {latency:.1f} s"
    assert harvest_stack.status(job.flow_run_id).status == "cancelled"
    written = _shards(job)
    time.sleep(2)
    assert _shards(job) == written and len(written) < 10  # nothing after the cancel
    assert not job.storage.exists(MANIFEST)


def test_cancel_while_the_model_loads(harvest_stack):
    job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["hello"] * 4, "shard_size": 2}, env={LOAD_PAUSE: "120"})
    _wait_for(lambda: _progress(job).get("stage") == "loading", 240, "the loading stage")
    assert harvest_stack.status(job.flow_run_id).status == "running"
    latency = _cancelled_within(job, 5)
    assert latency < 5, f"cancel took {latency:.1f} s"
    assert _shards(job) == [] and not job.storage.exists(MANIFEST)


def test_cancel_before_start_never_runs(harvest_stack):
    from flows.submit import cancel_harvest_run

    job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["hello"], "shard_size": 1})
    assert cancel_harvest_run(job.flow_run_id) == "cancelled"  # still Scheduled: cancelled outright
    assert _state_name(job.flow_run_id) == "Cancelled"
    time.sleep(3)
    status = harvest_stack.status(job.flow_run_id)
    assert status.status == "cancelled" and status.run_count == 0 and status.started_at is None


def _worker_of(flow_run_id, workers):
    """Our worker process whose child runs this flow run (from its infrastructure_pid)."""
    from prefect.client.orchestration import get_client

    from flows.reaper import local_pid

    with get_client(sync_client=True) as client:
        pid = _wait_for(lambda: local_pid(client.read_flow_run(flow_run_id)), 60, "infrastructure_pid")
    parent = psutil.Process(pid).parent().pid
    return pid, next(w for w in workers.workers if w.pid == parent)


def test_lost_worker_resumes_on_a_new_worker_without_recomputing(harvest_stack):
    from flows.reaper import reap_once_sync

    workers = harvest_stack.workers
    job = harvest_stack.submit({"model": "llama-tiny", "prompts": [f"text {i}" for i in range(8)], "shard_size": 1}, env={PAUSE: "0.4"})
    _wait_for(lambda: _progress(job).get("shards_done", 0) >= 3, 240, "three shards")
    pid, worker = _worker_of(job.flow_run_id, workers)
    workers.kill(worker)  # the worker and its flow-run process, at once: a lost machine
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    done_before = {name: job.storage.fs.modified(job.storage.path(name)) for name in _shards(job)}
    assert len(done_before) >= 3
    assert _state_name(job.flow_run_id) == "Running"  # Prefect alone would leave it so for ever

    workers.small = workers.start("small")
    actions = reap_once_sync(pools=("small",))
    assert [(a.flow_run_id, a.what) for a in actions] == [(job.flow_run_id, "rescheduled")]
    status = harvest_stack.wait(job.flow_run_id, timeout=240)
    assert status.status == "done" and status.run_count == 2
    for name, modified in done_before.items():  # written once, never again
        assert job.storage.fs.modified(job.storage.path(name)) == modified, name
    assert _progress(job)["shards_skipped"] == len(done_before)
    assert len(json.loads(job.storage.read_bytes(MANIFEST))["shards"]) == 8


def test_reaper_finishes_a_cancel_whose_worker_died(harvest_stack):
    from flows.reaper import reap_once_sync
    from flows.submit import cancel_harvest_run

    workers = harvest_stack.workers
    job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["hello"] * 2, "shard_size": 1}, env={LOAD_PAUSE: "120"})
    _wait_for(lambda: _progress(job).get("stage") == "loading", 240, "the loading stage")
    pid, worker = _worker_of(job.flow_run_id, workers)
    worker.proc.kill()  # only the worker: its flow-run process lives on, orphaned
    worker.proc.wait()
    workers.small = workers.start("small")
    cancel_harvest_run(job.flow_run_id)
    time.sleep(3)
    assert _state_name(job.flow_run_id) == "Cancelling"  # nobody left to finish it
    assert psutil.pid_exists(pid)

    actions = reap_once_sync(pools=("small",))
    assert (job.flow_run_id, "cancelled") in [(a.flow_run_id, a.what) for a in actions]
    assert _state_name(job.flow_run_id) == "Cancelled"
    _wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, "the process to die")


def test_pool_limit_3_holds_the_fourth_job_back(harvest_stack):
    from prefect.client.orchestration import get_client

    jobs = [
        harvest_stack.submit({"model": "llama-tiny", "prompts": [f"job {i} prompt {k}" for k in range(3)], "shard_size": 1}, env={PAUSE: "1"})
        for i in range(4)
    ]
    ids = [j.flow_run_id for j in jobs]
    most_active = 0
    held_back = False
    deadline = time.monotonic() + 300
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = [client.read_flow_run(i) for i in ids]
            active = [r for r in runs if r.state.type.value in ("PENDING", "RUNNING")]
            most_active = max(most_active, len(active))
            waiting = [r for r in runs if r.state.type.value == "SCHEDULED"]
            held_back |= len(active) == 3 and len(waiting) == 1
            if all(r.state.is_final() for r in runs):
                break
            time.sleep(0.3)
        runs = [client.read_flow_run(i) for i in ids]
    assert all(r.state.is_completed() for r in runs), [r.state.name for r in runs]
    assert most_active == 3 and held_back
    first_end = min(r.end_time for r in runs)
    last = max(runs, key=lambda r: r.start_time)
    assert last.start_time >= first_end  # the fourth started only once one of the three ended
