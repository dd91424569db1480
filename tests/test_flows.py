"""The harvest flow through the real stack: a Prefect server, the `small` pool's deployment and
a process worker, the embedded model on the HF engine. Jobs are started exactly as the API
starts them (`flows.submit.start_harvest_run`) and read back from storage."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from safetensors.torch import load as load_tensors

from harvest.jobfiles import MANIFEST, STATS, JobFiles
from harvest.shard.layout import shard_name
from harvest.settings import get_settings
from harvest.storage import open_storage
from tests.prefect_fixtures import recorded_task_runs

REQUEST = {"model": "llama-tiny", "prompts": [f"Prompt number {i} says hello to the world." for i in range(10)], "shard_size": 4, "layers": [1, 3, 7]}


def _files(storage) -> dict[str, bytes]:
    return {name: storage.read_bytes(name) for name in storage.listdir() if name.startswith("shard_")}


@pytest.fixture(scope="module")
def single_job(harvest_stack):
    job = harvest_stack.submit(REQUEST, key_id="key-1")
    status = harvest_stack.wait(job.flow_run_id, timeout=180)
    return job, status


def test_job_end_to_end_on_the_small_pool(single_job, harvest_stack):
    from prefect.client.orchestration import get_client

    job, status = single_job
    assert status.status == "done", status
    manifest = job.files.read_manifest()
    assert manifest["job_id"] == job.job_id
    assert [s["file"] for s in manifest["shards"]] == [f"shard_0000{k}.safetensors" for k in range(3)]  # the documented names
    assert job.files.read_result()["n_shards"] == 3 and job.files.shards_done() == 3
    assert manifest["layer_indices"] == [1, 3, 7]
    assert set(manifest["timings"]) == {"load_s", "forward_s", "save_s", "upload_s", "real_tokens", "padded_tokens"}
    # The forward passes ran every prompt's tokens (the shards' token counts say how many).
    assert manifest["timings"]["real_tokens"] == sum(n for s in manifest["shards"] for n in s["token_counts"])
    assert manifest["timings"]["load_s"] > 0 and manifest["bytes_written"] > 0
    shard = load_tensors(job.storage.read_bytes(shard_name(2)))
    assert set(shard) == {"prompt_8", "prompt_9", "tokens_8", "tokens_9"}
    assert shard["prompt_8"].shape[0] == 3

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(job.flow_run_id)
        assert run.name == job.job_id
        assert {"model:llama-tiny", "lane:small", "key:key-1"} <= set(run.tags)
        assert run.work_pool_name == "small"
        # Prefect's database holds the job id and a URL, never the prompts.
        # (and how many runs to use: this test asks for one; the API leaves it to the run)
        assert run.parameters == {"job_id": job.job_id, "request_url": job.request_url, "workers": 1}
        forwards, writes = ["forward-0", "forward-1", "forward-2"], ["write-0", "write-1", "write-2"]

        def shard_tasks(tasks) -> list[str]:
            return sorted(t.name for t in tasks if t.name.startswith(("forward-", "write-")))

        # Read until every task run's name and end are recorded (Prefect records them late under
        # load; a task run may be recorded before its first state is).
        tasks = recorded_task_runs(run.id, lambda found: shard_tasks(found) == forwards + writes
                                   and all(t.state is not None and t.state.is_completed() for t in found))
        names = shard_tasks(tasks)
        # Each shard: its forward pass, then its write (behind the next forward pass).
        assert [n for n in names if n.startswith("forward-")] == forwards
        assert [n for n in names if n.startswith("write-")] == writes
        assert all(t.state.is_completed() for t in tasks)
        # The progress bar's last write comes once the run's end is recorded (`flows.progress`).
        deadline = time.monotonic() + 30
        while True:
            progress = [a.data for a in client.read_artifacts() if a.flow_run_id == run.id and a.type == "progress"]
            if progress == [100.0] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert progress == [100.0]
    assert job.files.read_progress()["stage"] == "done"  # the manifest says so: nothing is written after it


def test_scale_out_over_two_runs_gives_identical_files_and_stats(single_job, harvest_stack):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    reference, _ = single_job
    job = harvest_stack.submit(REQUEST, workers=2)
    status = harvest_stack.wait(job.flow_run_id, timeout=180)
    assert status.status == "done", status

    with get_client(sync_client=True) as client:
        helpers = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job.job_id}"])))
    # The second range really ran in a flow run of its own (not taken over by the parent).
    assert [h.parameters["shard_range"] for h in helpers] == [[2, 3]]
    assert helpers[0].state.is_completed() and helpers[0].work_pool_name == "small"

    assert _files(job.storage) == _files(reference.storage)
    ours, theirs = load_tensors(job.storage.read_bytes(STATS)), load_tensors(reference.storage.read_bytes(STATS))
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].equal(theirs[name]), name
    a, b = json.loads(job.storage.read_bytes(MANIFEST)), json.loads(reference.storage.read_bytes(MANIFEST))
    assert a["shards"] == b["shards"] and a["mean_token_norm"] == b["mean_token_norm"]


def test_a_helper_stuck_pending_is_taken_over_after_the_grace(single_job, harvest_stack):
    # A helper a worker "picked up" whose process never got to Running: created Pending under
    # the idempotency key the parent uses, so the parent attaches to it instead of starting one.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Pending

    from flows.scale_out import HELPER_TAG

    reference, _ = single_job
    job_id = str(uuid.uuid4())
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("harvest/harvest-small")
        stuck = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"job_id": job_id, "request_url": JobFiles.for_job(job_id, open_storage(get_settings())).request_url, "shard_range": [2, 3]},
            state=Pending(),
            idempotency_key=f"{job_id}:shards-2-3",
            tags=[HELPER_TAG, f"job:{job_id}"],
        )
    job = harvest_stack.submit(REQUEST, workers=2, env={"HARVEST_HELPER_GRACE_S": "1"}, job_id=job_id)
    status = harvest_stack.wait(job.flow_run_id, timeout=180)
    assert status.status == "done", status

    with get_client(sync_client=True) as client:
        helper = client.read_flow_run(stuck.id)
    assert helper.state.type == StateType.CANCELLED and helper.run_count == 0  # never ran: taken over
    assert _files(job.storage) == _files(reference.storage)
    assert job.files.read_manifest()["shards"] == reference.files.read_manifest()["shards"]


def test_a_failing_job_ends_failed_with_a_reason_and_no_manifest(harvest_stack):
    # A request the model cannot run (the API would refuse it; pydantic alone does not): the
    # flow must fail saying why, before loading anything, and leave no manifest.
    job = harvest_stack.submit({**REQUEST, "layers": [40]})
    status = harvest_stack.wait(job.flow_run_id, timeout=180)
    assert status.status == "failed"
    assert "has no layer 40" in status.message and len(status.message) < 300
    assert not job.storage.exists(MANIFEST)


def test_scheduled_corpus_refresh_from_parquet(harvest_stack, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from flows.corpus_refresh import refresh_prefix
    from flows.schedule import main as schedule
    from harvest.storage import open_storage

    corpus = tmp_path / "nightly.parquet"
    pq.write_table(pa.table({"text": [f"corpus line {i}" for i in range(5)], "other": list(range(5))}), corpus)
    argv = ["schedule", "create", "--corpus", str(corpus), "--model", "llama-tiny", "--layers", "1,3", "--shard-size", "2", "--cron", "0 3 * * *"]
    assert schedule(argv) == 0
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("corpus-refresh/nightly")
    assert deployment.work_pool_name == "small"  # the model's lane: the refresh uses its GPU
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    assert deployment.parameters["corpus_url"] == str(corpus) and deployment.parameters["layers"] == [1, 3]
    assert schedule(argv[:-1] + ["30 2 * * *"]) == 0  # again: the schedule is replaced, not added
    with get_client(sync_client=True) as client:
        assert [s.schedule.cron for s in client.read_deployment_by_name("corpus-refresh/nightly").schedules] == ["30 2 * * *"]

    run = run_deployment("corpus-refresh/nightly", timeout=0)
    status = harvest_stack.wait(str(run.id), timeout=180)
    assert status.status == "done", status
    part = open_storage(get_settings()).child(refresh_prefix("nightly")).child("part-0000")
    manifest = json.loads(part.read_bytes(MANIFEST))
    assert manifest["n_prompts"] == 5 and len(manifest["shards"]) == 3 and manifest["layer_indices"] == [1, 3]
