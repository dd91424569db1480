"""GPU placement and automatic scale-out, on real hosts: `harvest worker` hosts (real `prefect
worker` processes started by `fleet.roles.start_worker_host`, each with its own HARVEST_HOME)
on work pools of this module's own (the session's `small`/`large` workers would take the runs),
with the tiny model on the HF engine. Jobs are started as the API starts them
(`flows.submit.start_harvest_run`: no `workers`, so the flow chooses).

The pools are lanes of a test lanes file, and a test registry puts the tiny model on them; both
reach the hosts' flow runs through HARVEST_LANES_FILE / HARVEST_MODELS_FILE. A CPU machine has
no GPUs to hand out, so the "GPU" host declares two (`--gpus 0,1`): what is under test is what
each run is given and sees (CUDA_VISIBLE_DEVICES), not the devices themselves.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from safetensors.torch import load as load_tensors

from harvest.errors import ModelUnavailable
from harvest.jobfiles import MANIFEST, STATS, JobFiles
from harvest.placement import auto_workers, check_fits, free_slots, host_slots, parse_gpus, visible_gpus
from harvest.request import HarvestRequest
from harvest.settings import get_settings
from harvest.storage import open_storage
from tests.prefect_fixtures import WORKER_ENV, deploy_pool, recorded_task_runs
from tests.slow_engine import slow_shards

MODEL = "llama-tiny-placed"
REPO = Path(__file__).resolve().parent.parent


# --- the pure parts ---------------------------------------------------------------------------


def test_slot_tables_from_gpus_groups_and_counts():
    assert host_slots(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert host_slots(["0", "1", "2"], 2) == [["0", "1"]]  # a leftover GPU stays unused
    assert host_slots(["0"], 8) == [["0"]]  # fewer than a group: one slot of all of them
    assert host_slots([], 1) == [[]] and host_slots(None, 1, slots=3) == [[], [], []]
    with pytest.raises(ValueError):
        host_slots(["0"], 1, slots=2)
    assert parse_gpus(" 0, 1 ") == ["0", "1"] and parse_gpus("") is None and parse_gpus("-1") == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"] and visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_a_model_that_needs_more_gpus_than_a_slot_fails_clearly():
    check_fits("llama-8b", 1, [["0"], ["1"]])
    check_fits("llama-405b", 8, [[], []])  # CPU slots take anything
    with pytest.raises(ModelUnavailable, match=r"llama-405b runs on 8 GPUs .* --gpus-per-run 8"):
        check_fits("llama-405b", 8, [["0", "1"], ["2", "3"]])


def test_the_scale_out_policy():
    # 16 shards, two idle one-slot hosts, this run holding one slot → one free → 2 runs.
    assert auto_workers(16, free_slots(None, [1, 1], busy=1), 8) == 2
    assert auto_workers(16, free_slots(None, [4], busy=1), 8) == 2  # capped by the shards
    assert auto_workers(64, free_slots(3, [4, 4], busy=1), 8) == 3  # capped by the pool's limit
    assert auto_workers(7, 5, 8) == 1 and auto_workers(100, 0, 8) == 1 and auto_workers(0, 3, 8) == 1


def test_registry_gives_each_model_its_tensor_parallel_size(registry):
    sizes = {info.name: info.tensor_parallel_size for info in registry.all()}
    assert sizes["llama-tiny"] == 1 and sizes["llama-8b"] == 1 and sizes["llama-405b"] == 8


_CLAIMER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from harvest.placement import try_claim
    order = [int(k) for k in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
    held = try_claim([["0"], ["1"]], Path(sys.argv[1]), "lane", order)
    print(held.slot if held else "none", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def test_slot_claims_are_exclusive_and_die_with_their_process(tmp_path):
    def claimer(hold_s: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _CLAIMER, str(tmp_path), str(hold_s)], cwd=REPO, stdout=subprocess.PIPE, text=True)

    first = claimer(60)
    assert first.stdout.readline().strip() == "0"
    second = claimer(60)
    assert second.stdout.readline().strip() == "1"
    third = claimer(0)
    assert third.stdout.readline().strip() == "none"  # both taken: no third run at once
    third.wait()
    first.kill()  # SIGKILL: no cleanup ran, and still the slot is free again
    first.wait()
    again = claimer(0)
    assert again.stdout.readline().strip() == "0"
    again.wait()
    second.kill()
    second.wait()


# --- real hosts -------------------------------------------------------------------------------


@dataclass
class Lanes:
    """This module's lanes (work pools with a `harvest` deployment each) and the hosts' env."""

    api_url: str
    home: Path
    env: dict[str, str]
    pools: dict[str, str] = field(default_factory=dict)
    hosts: list = field(default_factory=list)

    def host(self, pool: str, name: str, **slots):
        from fleet.roles import start_worker_host

        worker = start_worker_host(self.home / name, pool, self.api_url, env=self.env, name=name, **slots)
        self.hosts.append(worker)
        return worker


@pytest.fixture(scope="module")
def lanes(prefect_server, harvest_home: Path, tiny):
    from harvest.settings import get_settings

    tag = uuid.uuid4().hex[:6]
    root = harvest_home / f"placement-{tag}"
    root.mkdir()
    pools = {"gpu": f"placement-gpu-{tag}", "cpu": f"placement-cpu-{tag}"}
    lanes_file, models_file = root / "lanes.toml", root / "models.toml"
    lanes_file.write_text("".join(f'[lanes.{p}]\ndescription = "placement tests"\n\n' for p in pools.values()))
    models_file.write_text("".join(
        f'[models.{MODEL}-{kind}]\nweights = "{tiny.path}"\nbuiltin = true\nlane = "{pool}"\n'
        f"max_model_len = 2048\nmax_activation_prompt_tokens = 512\ntensor_parallel_size = 1\n\n"
        for kind, pool in pools.items()
    ))
    for pool in pools.values():
        deploy_pool(pool)
    deploy_pool(pools["cpu"], "flows.corpus_refresh.corpus_refresh", f"corpus-{pools['cpu']}")
    env = {
        **WORKER_ENV,
        "HARVEST_LANES_FILE": str(lanes_file),
        "HARVEST_MODELS_FILE": str(models_file),
        "HARVEST_STORAGE_URL": get_settings().resolved_storage_url,  # all hosts share the storage
    }
    found = Lanes(api_url=prefect_server.api_url, home=root, env=env, pools=pools)
    try:
        yield found
    finally:
        for worker in found.hosts:
            if worker.alive():
                worker.stop()


def _submit(lanes: Lanes, kind: str, prompts: list[str], *, env: dict | None = None, **parameters) -> tuple[str, JobFiles, str]:
    """Write the request and start the job's flow run as the API does; `parameters` (e.g.
    workers=1) go in as flow parameters, which the API never sends."""
    from prefect.client.orchestration import get_client

    from flows.submit import start_harvest_run

    job_id = str(uuid.uuid4())
    files = JobFiles.for_job(job_id, open_storage(get_settings()))
    request = HarvestRequest(model=f"{MODEL}-{kind}", prompts=prompts, shard_size=1, layers=[1, 3, 7])
    url = files.write_request(request)
    pool = lanes.pools[kind]
    if not parameters:
        return job_id, files, start_harvest_run(job_id, url, request.model, pool, "test", env=env)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"harvest/harvest-{pool}")
        run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"job_id": job_id, "request_url": url, **parameters}, name=job_id,
            job_variables={"env": env} if env else None,
        )
    return job_id, files, str(run.id)


def _wait(run_id: str, timeout: float = 150):
    from flows.submit import read_harvest_run

    deadline = time.monotonic() + timeout
    while (status := read_harvest_run(run_id)).status not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
    return status


def _read_runs(**filters):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(**filters))


def _shard_tasks(run_id, expected: int) -> list[str]:
    """The run's `write-k` task runs, in shard order, once `expected` of them are recorded."""
    def writes(tasks) -> list[str]:
        return sorted((t.name for t in tasks if re.fullmatch(r"write-\d+", t.name)), key=lambda n: int(n.split("-")[1]))

    return writes(recorded_task_runs(run_id, lambda found: len(writes(found)) >= expected))


def test_a_host_with_two_slots_never_runs_a_third_job_and_each_run_sees_only_its_gpus(lanes):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    host = lanes.host(lanes.pools["gpu"], "gpu-host", gpus=["0", "1"], gpus_per_run=1)
    slowed = slow_shards(1)
    jobs = [_submit(lanes, "gpu", [f"job {j} prompt {k}" for k in range(3)], env=slowed) for j in range(3)]
    ids = [run_id for _, _, run_id in jobs]

    most, together = 0, 0
    holding = FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING])
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 180
        while True:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            live = client.count_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids), state=FlowRunFilterState(type=holding)))
            most = max(most, live)
            together = max(together, sum(1 for r in runs if r.state.type == StateType.RUNNING))
            if all(r.state.is_final() for r in runs):
                break
            assert time.monotonic() < deadline, [r.state.name for r in runs]
            time.sleep(0.2)
    assert all(r.state.is_completed() for r in runs), [(r.state.name, r.state.message) for r in runs]
    assert most <= 2, most  # never a third job at once on a host of two slots
    assert together == 2  # ... and two at once: it does use both

    seen = {}
    for run in runs:
        labels = run.labels
        assert labels["prefect.worker.name"] == "gpu-host"
        seen[run.id] = labels["harvest.cuda_visible_devices"]
        assert seen[run.id] == labels["harvest.devices"] == str(labels["harvest.slot"]) in ("0", "1")
        assert labels["harvest.gpus_seen"] == "0"  # a CPU machine: the ids are declared, not present
    for a in runs:  # any two runs that overlapped in time saw different GPUs
        for b in runs:
            if a.id != b.id and a.start_time < b.end_time and b.start_time < a.end_time:
                assert seen[a.id] != seen[b.id], (seen[a.id], a.start_time, a.end_time, b.start_time, b.end_time)
    assert len(set(seen.values())) == 2
    by_id = {str(run_id): value for run_id, value in seen.items()}
    for _, files, run_id in jobs:  # the run's own record agrees with its labels
        progress = files.read_progress()  # the file last said "finalizing"; the manifest says done
        assert progress["stage"] == "done" and progress["placement"]["cuda_visible_devices"] == by_id[run_id]
    host.stop()


@pytest.fixture(scope="module")
def two_hosts(lanes):
    pool = lanes.pools["cpu"]
    with ThreadPoolExecutor(2) as pool_of_threads:
        hosts = list(pool_of_threads.map(lambda name: lanes.host(pool, name, slots=1), ["cpu-host-a", "cpu-host-b"]))
    return hosts


def test_a_16_shard_job_spreads_over_two_idle_hosts_with_identical_results(lanes, two_hosts):
    from prefect.client.schemas.filters import FlowRunFilterTags

    from flows.scale_out import HELPER_TAG

    prompts = [f"Prompt {i} of the spread job says hello." for i in range(16)]
    job_id, files, run_id = _submit(lanes, "cpu", prompts)  # as the API: no workers given
    assert _wait(run_id).status == "done"

    (parent,) = _read_runs(id={"any_": [run_id]})
    helpers = _read_runs(tags=FlowRunFilterTags(all_=[f"job:{job_id}", HELPER_TAG]))
    assert parent.labels["harvest.workers"] == "2" and "workers" not in parent.parameters
    assert [h.parameters["shard_range"] for h in helpers] == [[8, 16]]
    helper = helpers[0]
    assert helper.state.is_completed() and helper.run_count == 1  # ran itself, not taken over
    assert {parent.labels["prefect.worker.name"], helper.labels["prefect.worker.name"]} == {"cpu-host-a", "cpu-host-b"}
    assert _shard_tasks(parent.id, 8) == [f"write-{k}" for k in range(8)]
    assert _shard_tasks(helper.id, 8) == [f"write-{k}" for k in range(8, 16)]

    ref_id, ref_files, ref_run = _submit(lanes, "cpu", prompts, workers=1)  # one run, one host
    assert _wait(ref_run).status == "done"
    assert not _read_runs(tags=FlowRunFilterTags(all_=[f"job:{ref_id}", HELPER_TAG]))
    assert _shard_tasks(ref_run, 16) == [f"write-{k}" for k in range(16)]

    names = sorted(n for n in files.storage.listdir() if n.startswith("shard_"))
    assert names == sorted(n for n in ref_files.storage.listdir() if n.startswith("shard_")) and len(names) == 16
    for name in names + [STATS]:
        assert files.storage.read_bytes(name) == ref_files.storage.read_bytes(name), name
    ours, theirs = json.loads(files.storage.read_bytes(MANIFEST)), json.loads(ref_files.storage.read_bytes(MANIFEST))
    assert ours["shards"] == theirs["shards"], [(a, b) for a, b in zip(ours["shards"], theirs["shards"]) if a != b][:2]
    assert ours["mean_token_norm"] == theirs["mean_token_norm"], (ours["mean_token_norm"], theirs["mean_token_norm"])
    ours_stats, ref_stats = load_tensors(files.storage.read_bytes(STATS)), load_tensors(ref_files.storage.read_bytes(STATS))
    assert all(ours_stats[k].equal(ref_stats[k]) for k in ref_stats)


def test_a_corpus_refresh_spreads_its_parts_over_the_lanes_hosts(lanes, two_hosts, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilterTags
    from prefect.deployments import run_deployment

    from flows.corpus_refresh import PART_TAG, refresh_prefix
    from harvest.storage import open_storage

    name = f"spread-{uuid.uuid4().hex[:6]}"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"corpus line {i}"}) + "\n" for i in range(8)))
    pool = lanes.pools["cpu"]
    run = run_deployment(
        f"corpus-refresh/corpus-{pool}", timeout=0,
        parameters={"corpus_url": str(corpus), "model": f"{MODEL}-cpu", "layers": [1, 3], "shard_size": 2, "name": name, "part_size": 4},
    )
    assert _wait(str(run.id)).status == "done"

    (refresh,) = _read_runs(id={"any_": [run.id]})
    handed = _read_runs(tags=FlowRunFilterTags(all_=[PART_TAG, f"corpus:{name}"]))
    # Part 0 ran here, in the refresh's own run; part 1, at the same time, on the other host.
    assert [r.name for r in handed] == [f"{name}-{refresh_prefix(name).rsplit('/', 1)[-1]}-part-0001"]
    assert handed[0].state.is_completed() and handed[0].run_count == 1
    assert handed[0].labels["prefect.worker.name"] != refresh.labels["prefect.worker.name"]
    folder = open_storage(get_settings()).child(refresh_prefix(name))
    for i in range(2):
        manifest = json.loads(folder.child(f"part-{i:04d}").read_bytes(MANIFEST))
        assert manifest["n_prompts"] == 4 and len(manifest["shards"]) == 2 and manifest["layer_indices"] == [1, 3]


def test_a_slot_whose_gpu_group_holds_the_model_is_claimed_first(tmp_path, tiny):
    """A real engine server of group gpu-1 (on the CPU: the group is only a name here) with
    llama-tiny loaded: the slot on GPU 1 comes first for llama-tiny, and is the one claimed."""
    from harvest.placement import warm_first
    from harvest.settings import Settings
    from harvest.warm.client import open_engine
    from harvest.warm.protocol import stop_engine_servers

    settings = Settings(home=tmp_path, slots=[["0"], ["1"]], engine="hf")
    assert warm_first(tiny, settings) == [0, 1]  # nothing loaded anywhere: the table's order
    engine, load = open_engine(tiny, {"devices": "1"}, settings)
    try:
        assert (load.group, load.warm) == ("gpu-1", False)
        assert warm_first(tiny, settings) == [1, 0]
        other = replace(tiny, name="another-model")
        assert warm_first(other, settings) == [0, 1]
        claimer = subprocess.run([sys.executable, "-c", _CLAIMER, str(tmp_path / "slots"), "0", "1,0"], cwd=REPO,
                                 capture_output=True, text=True, check=True)
        assert claimer.stdout.strip() == "1"
    finally:
        engine.close()
        stop_engine_servers(tmp_path)
