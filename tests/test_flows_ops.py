"""Operating the flows on a real Prefect server: cancellation (during forward passes and while
the model loads) and the pool limit. Hosts that die are in tests/test_liveness.py (Prefect's
own machinery) and tests/test_fleet.py (resumed on another host, end to end)."""

from __future__ import annotations

import json
import math
import os
import time
import uuid


from harvest.jobfiles import MANIFEST, PROGRESS
from harvest.settings import get_settings
from tests.proc_threads import thread_stats
from tests.slow_engine import gate_file, gated_shards, slow_load, slow_shards


def _progress(job) -> dict:
    try:
        return json.loads(job.storage.read_bytes(PROGRESS))
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
    job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["hello"] * 4, "shard_size": 2}, env=slow_load())
    _wait_for(lambda: _progress(job).get("stage") == "loading", 240, "the loading stage")
    assert harvest_stack.status(job.flow_run_id).status == "running"
    latency = _cancelled_within(job, 5)
    assert latency < 5, f"cancel took {latency:.1f} s"
    assert _shards(job) == [] and not job.storage.exists(MANIFEST)


def test_cancel_before_start_never_runs(harvest_stack):
    from prefect.client.orchestration import get_client

    from flows.key_queues import key_queue_name
    from flows.submit import cancel_harvest_run
    from harvest.registry import load_registry

    # The key's queue made paused before the submit, so no worker can claim the run first.
    lane, key = load_registry(get_settings()).get("llama-tiny").lane, "cancel-before-start"
    with get_client(sync_client=True) as client:
        queue = client.create_work_queue(name=key_queue_name(key), work_pool_name=lane, is_paused=True)
        job = harvest_stack.submit({"model": "llama-tiny", "prompts": ["hello"], "shard_size": 1}, key_id=key)
        assert cancel_harvest_run(job.flow_run_id) == "cancelled"  # still Scheduled: cancelled outright
        assert _state_name(job.flow_run_id) == "Cancelled"
        client.update_work_queue(queue.id, is_paused=False)
    time.sleep(3)  # the queue open again: a worker would claim the run now if it could
    status = harvest_stack.status(job.flow_run_id)
    assert status.status == "cancelled" and status.run_count == 0 and status.started_at is None


def test_pool_limit_3_holds_the_fourth_job_back(harvest_stack):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    # The runs' shards wait on a gate this test opens: three runs stay active, however slowly a
    # loaded box submits and starts them, until the fourth is seen held back.
    gate = uuid.uuid4().hex[:12]
    jobs = [
        # One key each: a key's own runs stop at the lane's key_run_limit (2) before the pool's.
        harvest_stack.submit(
            {"model": "llama-tiny", "prompts": [f"job {i} prompt {k}" for k in range(2)], "shard_size": 1},
            env=gated_shards(gate), key_id=f"pool-limit-{i}",
        )
        for i in range(4)
    ]
    ids = [j.flow_run_id for j in jobs]
    most_active = 0
    held_since = None
    deadline = time.monotonic() + 300
    with get_client(sync_client=True) as client:
        def read() -> list:
            # One read, so one moment: reading the runs one by one can count both a run that
            # ended between two reads and the run that took its place (4 active, never true).
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            assert len(runs) == len(ids)
            return runs

        def active(runs) -> int:
            return sum(r.state.type.value in ("PENDING", "RUNNING") for r in runs)

        # Held back: three active and the fourth scheduled, for 3 s of samples on end.
        while time.monotonic() < deadline:
            runs = read()
            most_active = max(most_active, active(runs))
            held = active(runs) == 3 and sum(r.state.type.value == "SCHEDULED" for r in runs) == 1
            held_since = (held_since or time.monotonic()) if held else None
            if held_since is not None and time.monotonic() - held_since >= 3:
                break
            time.sleep(0.3)
        assert held_since is not None, (most_active, [r.state.name for r in runs])
        gate_file(get_settings().home, gate).touch()
        while time.monotonic() < deadline:
            runs = read()
            most_active = max(most_active, active(runs))
            if all(r.state.is_final() for r in runs):
                break
            time.sleep(0.3)
    assert all(r.state.is_completed() for r in runs), [(r.state.name, r.state.message) for r in runs]
    assert most_active == 3
    first_end = min(r.end_time for r in runs)
    last = max(runs, key=lambda r: r.start_time)
    assert last.start_time >= first_end  # the fourth started only once one of the three ended


def _thread_nices(pid: int) -> list[int]:
    """The nices of `pid`'s threads, each once and in order. (A list, not a set: lists sort by
    their values, sets only by inclusion.)"""
    return sorted({nice for nice, _ in thread_stats(pid).values()})


def test_a_large_jobs_run_yields_the_cpu_to_a_small_jobs_run(harvest_stack, tiny):
    """Runs forked on one host share its session: a large job's run lowers its own priority by
    its output's size, a small one's keeps the default (`harvest.cpu_share`)."""
    import psutil

    from harvest.tokenize import load_tokenizer

    large = {"model": "llama-tiny", "prompts": [f"prompt {i} " + "many words in a row " * 60 for i in range(6)],
             "shard_size": 1, "layers": "all"}
    small = {"model": "llama-tiny", "prompts": [f"small prompt {i}" for i in range(8)], "shard_size": 1, "layers": [2]}
    # The large job's output from its tokens, counted here: a bf16 value per layer and feature
    # and an int32 id per token; one nice step per doubling past 1 MiB.
    tokens = sum(len(ids) for ids in load_tokenizer(tiny.path)(large["prompts"])["input_ids"])
    large_bytes = tokens * (8 * 256 * 2 + 4)
    expected = math.ceil(math.log2(large_bytes / 2**20))
    assert 1 <= expected <= 19, large_bytes
    starter = psutil.Process(harvest_stack.workers.small.pid)

    def forked_runs() -> list[int]:
        # The host's runs: children of its run starter, forked (the starter's command line) or
        # forked and started afresh (Prefect's engine: a run whose environment asked for that).
        runs = []
        for child in starter.children():
            try:
                if child.cmdline() == starter.cmdline() or child.cmdline()[1:3] == ["-m", "prefect.engine"]:
                    runs.append(child.pid)
            except psutil.Error:  # ended (a zombie until the starter collects it)
                pass
        return runs

    _wait_for(lambda: not forked_runs(), 120, "the host's earlier runs to end")  # the runs below are these jobs'
    # Runs inherit the starter's priority: the default one, as `harvest worker` starts it. (This
    # session's own process may have been lowered by an in-process CPU decode before it started
    # the host, which keeps its decode thread's nice; root may put it back, and CI runs as root.)
    for tid in os.listdir(f"/proc/{starter.pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except PermissionError:
            pass
    base = max(_thread_nices(starter.pid))
    assert base < expected, f"the host's runs start at nice {base}: nothing lower to see"
    jobs = [harvest_stack.submit(body, env=slow_shards(1), key_id=f"cpu-share-{i}") for i, body in enumerate((large, small))]

    def both_running():
        statuses = [harvest_stack.status(job.flow_run_id).status for job in jobs]
        runs = forked_runs()
        return statuses == ["running", "running"] and len(runs) == 2 and runs

    runs = _wait_for(both_running, 120, "both jobs running on the small host")
    # Once past tokenizing (each job has six or eight shards of a second at least):
    # the large job's run, every thread of it, one step lower per doubling; the small one's not.
    seen = []

    def lowered():
        try:
            seen.append(sorted(_thread_nices(pid) for pid in runs))
        except FileNotFoundError:  # a run ended first: say what was seen while both ran
            raise AssertionError(f"a run ended before its threads were at nice {base} and {expected}; seen: {seen[-3:]}")
        return seen[-1] == [[base], [expected]]

    try:
        _wait_for(lowered, 60, f"the runs' threads at nice {base} and {expected}")
    except TimeoutError as late:
        raise AssertionError(f"{late}; seen: {seen[-3:]}") from None
    for job in jobs:
        assert harvest_stack.wait(job.flow_run_id, timeout=180).status == "done"
