"""Warm engines (`harvest.warm`) through real flow runs on a worker host of a fresh home.

The host runs its flow runs with a slot table, so each run asks the host's engine server
(started by the first run, detached, kept between jobs) for its model. What is checked, and
against what:

- load once: the engine server's own counters (loads, evictions) and its pid, beside each
  manifest's `timings.load_s` and `engine.warm`;
- sharing: two jobs on one engine, their shards in shared engine calls (the engine's own
  record of its calls), one cancelled, the other's values against each prompt run alone
  through HF (`hidden_states`) within one bf16 rounding;
- an engine server killed mid-job: the job ends done, every shard's sha256 against the bytes
  on disk and its values against HF;
- each engine (`HARVEST_ENGINE=hf` and `vllm`) through the host and through `/v1/completions`;
  the run's own environment choosing the engine, though its process is forked from the
  host's run starter (`fleet.run_starter`), whose environment says `hf`;
- runs forked from the run starter: the process tree (psutil), and a launcher killed taking
  its run along.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load as load_tensors

from harvest.jobfiles import MANIFEST, JobFiles
from harvest.request import HarvestRequest
from harvest.tokenize import load_tokenizer
from harvest.warm.client import engine_status
from harvest.warm.protocol import GroupFiles, unix_socket_path
from harvest.storage import open_storage
from harvest.settings import get_settings
from tests.api_fixtures import SECOND_SMALL_MODEL
from tests.prefect_fixtures import REPO, WORKER_ENV, deploy_pool
from testbed.reference import bf16_tolerance, hf_reference_layers
from tests.slow_engine import recorded_calls, slow_shards

POOL = "warm-host"


class Host:
    """One worker host (its own HARVEST_HOME, two CPU slots) on the pool `warm-host`."""

    def __init__(self, home: Path, worker):
        self.home = home
        self.worker = worker

    def status(self) -> dict | None:
        return engine_status(self.home)

    def submit(self, prompts: list[str], *, model: str = "llama-tiny", env: dict | None = None, **request) -> tuple[str, JobFiles]:
        from flows.submit import start_harvest_run

        job_id = str(uuid.uuid4())
        files = JobFiles.for_job(job_id, open_storage(get_settings()))
        url = files.write_request(HarvestRequest.model_validate({"model": model, "prompts": prompts, **request}))
        return start_harvest_run(job_id, url, model, POOL, "test", workers=1, env=env), files


@pytest.fixture(scope="module")
def host(prefect_deployments, prefect_server, tmp_path_factory):
    from fleet.processes import start_worker

    home = tmp_path_factory.mktemp("warm-host")
    models = home / "models.toml"
    models.write_text((REPO / "infra" / "models.toml").read_text() + SECOND_SMALL_MODEL)
    deploy_pool(POOL)
    env = {
        **WORKER_ENV,
        "HARVEST_HOME": str(home),
        "HARVEST_MODELS_FILE": str(models),
        "HARVEST_SLOTS": json.dumps([[], []]),
        "HARVEST_ENGINE_MODELS_PER_GROUP": "1",  # one model per group: another one evicts
        "HARVEST_ENGINE_COBATCH_SHARDS": "4",  # co-batched calls (the default is 1: each shard alone)
        "HARVEST_ENGINE_COBATCH_WAIT_S": "1",  # a run's turnaround between shards on a loaded CI box
    }
    worker = start_worker(POOL, prefect_server.api_url, home / "worker.log", env, name=f"warm-{uuid.uuid4().hex[:6]}",
                          run_starter=unix_socket_path(home / "engines", "runs"))
    try:
        yield Host(home, worker)
    finally:
        worker.stop()


def _wait(run_id: str, timeout: float = 240):
    from flows.submit import read_harvest_run

    deadline = time.monotonic() + timeout
    while True:
        status = read_harvest_run(run_id)
        if status.status in ("done", "failed", "cancelled"):
            return status
        assert time.monotonic() < deadline, f"run {run_id} still {status.state_name}"
        time.sleep(0.3)


def _check_against_hf(files: JobFiles, hf_model, tokenizer, prompts: list[str], layers: list[int]) -> None:
    """Every shard's sha256 against its bytes, and every prompt's values against HF alone."""
    manifest = json.loads(files.storage.read_bytes(MANIFEST))
    for shard in manifest["shards"]:
        data = files.storage.read_bytes(shard["file"])
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]
        tensors = load_tensors(data)
        first, last = shard["prompt_range"]
        for i in range(first, last + 1):
            ids = tokenizer(prompts[i])["input_ids"]
            assert tensors[f"tokens_{i}"].tolist() == ids
            reference = hf_reference_layers(hf_model, ids, layers)
            got = tensors[f"prompt_{i}"].float().numpy()
            assert got.shape == reference.shape
            assert (np.abs(got - reference) <= 2 * bf16_tolerance(reference)).all(), f"prompt {i}"


def test_three_jobs_in_a_row_load_the_model_once_and_another_model_evicts_it(host):
    loads = []
    for n in range(3):
        run_id, files = host.submit([f"job {n} says hello", "and goodbye"], layers=[1, 3])
        assert _wait(run_id).status == "done"
        manifest = json.loads(files.storage.read_bytes(MANIFEST))
        loads.append((manifest["timings"]["load_s"], manifest["engine"]["warm"], manifest["engine"]["loaded"]))
        if n == 0:
            first_pid = host.status()["pid"]
    status = host.status()
    # The engine server's own record: one load, nothing evicted, the same process throughout.
    assert (status["loads"], status["evictions"], status["pid"]) == (1, 0, first_pid), status
    import psutil

    # It outlives the run that started it, so it does not carry that run's identity; its
    # OpenMP threads sleep when idle (`harvest.cpu_share.with_passive_waits`).
    environ = psutil.Process(first_pid).environ()
    assert not [k for k in environ if k.startswith("PREFECT__")]
    assert environ.get("OMP_WAIT_POLICY") == "PASSIVE"
    assert [w for _, w, _ in loads] == ["false", "true", "true"], loads
    assert all(load_s < 0.5 for load_s, _, _ in loads[1:]), loads
    assert loads[0][0] > loads[1][0] and all(where == "engine server cpu" for _, _, where in loads)

    run_id, files = host.submit(["another model"], model="llama-tiny-b", layers=[1])
    assert _wait(run_id).status == "done"
    status = host.status()
    assert (status["loads"], status["evictions"]) == (2, 1), status
    assert [entry["key"][0] for entry in status["loaded"]] == ["llama-tiny-b"]
    assert json.loads(files.storage.read_bytes(MANIFEST))["engine"]["warm"] == "false"


def test_two_jobs_share_one_engine_and_cancelling_one_leaves_the_other(host, hf_engine, tiny):
    from flows.submit import cancel_harvest_run, read_harvest_run

    tokenizer = load_tokenizer(tiny.path)
    slow = slow_shards(1)
    kept_prompts = [f"kept prompt {k} about rivers" for k in range(12)]
    cancelled, cancelled_files = host.submit([f"cancelled prompt {k}" for k in range(16)], env=slow, shard_size=1, layers=[2, 5])
    kept, kept_files = host.submit(kept_prompts, env=slow, shard_size=2, layers=[2, 5])
    # Both runs on the one engine, at once: the server's own count of who holds it, while
    # each job is writing (on a loaded box one run may start seconds after the other).
    deadline, users = time.monotonic() + 240, None
    while not (cancelled_files.shards_done() >= 1 and kept_files.shards_done() >= 1 and users == [2]):
        assert time.monotonic() < deadline, f"both jobs writing on one engine; its users: {users}"
        assert read_harvest_run(kept).status in ("pending", "running"), "the kept job ended before both held the engine"
        users = [entry["users"] for entry in (host.status() or {"loaded": []})["loaded"]]
        time.sleep(0.2)
    started = time.monotonic()
    assert cancel_harvest_run(cancelled) == "cancelled"
    while read_harvest_run(cancelled).state_name != "Cancelled":
        assert time.monotonic() - started < 5, "cancel took 5 s"
        time.sleep(0.1)
    assert _wait(kept).status == "done"
    assert not cancelled_files.storage.exists(MANIFEST) and cancelled_files.shards_done() < 16
    _check_against_hf(kept_files, hf_engine.hf_model, tokenizer, kept_prompts, [2, 5])
    # While both ran, their waiting shards went through the engine together: the engine's own
    # record of its calls holds calls with a shard of each job.
    kept_ids = {tuple(tokenizer(p)["input_ids"]) for p in kept_prompts}
    jobs_per_call = [{tuple(shard[0]) in kept_ids for shard in call} for call in recorded_calls(host.home)]
    assert {True, False} in jobs_per_call, jobs_per_call


def test_an_engine_server_killed_mid_job_is_started_again_and_the_job_ends_done(host, hf_engine, tiny):
    tokenizer = load_tokenizer(tiny.path)
    prompts = [f"prompt {k} survives a crash" for k in range(6)]
    run_id, files = host.submit(prompts, env=slow_shards(1), shard_size=1, layers=[0, 7])
    deadline = time.monotonic() + 240
    while files.shards_done() < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    killed = GroupFiles(host.home, "cpu").server_pid()
    os.kill(killed, signal.SIGKILL)
    status = _wait(run_id)
    assert status.status == "done", status
    assert host.status()["pid"] != killed  # a new server took over
    _check_against_hf(files, hf_engine.hf_model, tokenizer, prompts, [0, 7])


def _run_processes(host) -> tuple[list, list]:
    """The host's launchers (children of its Prefect worker) and the runs its run starter forked."""
    import psutil

    def cmdline(process) -> list[str]:
        try:
            return process.cmdline()
        except psutil.Error:  # ended (a zombie not yet reaped): not running anything
            return []

    starter = psutil.Process(host.worker.pid)
    # The forked runs keep the starter's command line; the worker has its own.
    worker = next(p for p in starter.children() if "fleet.run_starter" not in cmdline(p))
    forked = [p for p in starter.children() if p.pid != worker.pid and cmdline(p)]
    launchers = [p for p in worker.children(recursive=True) if cmdline(p)[-2:] == ["-m", "fleet.run_starter"]]
    return launchers, forked


def test_runs_fork_from_the_run_starter_and_a_killed_launcher_takes_its_run_along(host):
    import psutil

    run_id, files = host.submit([f"prompt {k}" for k in range(12)], env=slow_shards(1), shard_size=1, layers=[1])
    deadline = time.monotonic() + 240
    while files.shards_done() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # The process tree, as the kernel has it: one launcher under the worker, and the run it
    # asked for forked from the starter (not started by the worker). The previous test's run
    # may still be on its way out (its final state is written before its process ends).
    deadline = time.monotonic() + 15
    while tuple(map(len, _run_processes(host))) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    launchers, runs = _run_processes(host)
    assert len(launchers) == 1 and len(runs) == 1, (launchers, runs)
    assert runs[0].cmdline() == psutil.Process(host.worker.pid).cmdline()
    assert runs[0].environ().get("OMP_WAIT_POLICY") == "PASSIVE"  # its statistics' threads sleep when idle

    launchers[0].kill()  # what the worker does to a run past its cancel grace
    psutil.wait_procs(runs, timeout=5)
    assert not runs[0].is_running() or runs[0].status() == psutil.STATUS_ZOMBIE
    assert not files.storage.exists(MANIFEST)
    _wait(run_id)  # whatever Prefect makes of it (crashed), it ends before the next test
    assert _run_processes(host) == ([], [])


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_each_engine_through_the_host_and_inline(engine, host, hf_engine, tiny, harvest_home):
    from tests.api_fixtures import ApiServer
    from tests.test_inline_engine import assert_within_one_bf16_rounding, hf_reference
    from tests.test_residual_codec import decode_residual_stream

    tokenizer = load_tokenizer(tiny.path)
    prompts = ["The capital of France is", "Rivers run to the sea " * 5]
    run_id, files = host.submit(prompts, env={"HARVEST_ENGINE": engine}, layers=[1, 6])
    assert _wait(run_id, 300).status == "done"
    manifest = json.loads(files.storage.read_bytes(MANIFEST))
    assert manifest["engine"]["engine"] == engine and manifest["engine"]["reason"] == f"HARVEST_ENGINE={engine}"
    _check_against_hf(files, hf_engine.hf_model, tokenizer, prompts, [1, 6])

    server = ApiServer(harvest_home, f"inline-{engine}", {"HARVEST_ENGINE": engine}).start()
    try:
        headers = {"Authorization": f"Bearer {server.make_key()}"}
        body = {"model": "llama-tiny", "prompt": prompts[0], "max_tokens": 1, "temperature": 0, "output_residual_stream": [1, 6]}
        answer = requests.post(f"{server.base_url}/completions", headers=headers, json=body, timeout=600)
        assert answer.status_code == 200, answer.text
        x = decode_residual_stream(answer.json())
        ids = tokenizer(prompts[0])["input_ids"]
        reference, _ = hf_reference(hf_engine.hf_model, ids, [1, 6])
        assert_within_one_bf16_rounding(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16), reference)
    finally:
        server.stop()
