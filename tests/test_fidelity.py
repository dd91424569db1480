"""Data-fidelity paths no other test reaches, each checked against an independent source:
a shard corrupted in place (same size) caught by its sha256 and rewritten on resume;
`stats.safetensors` dtypes and shapes as documented, read with safetensors' numpy loader;
a projection job through the API against numpy float64 projections of HF `hidden_states`;
a link to a swept file; a job on the `large` lane end to end.

API jobs run on `tests.faults_fixtures`'s API (real Prefect runs, PostgreSQL store); their files
are fetched over the presigned links with no key, as a researcher would.
"""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np
from safetensors.numpy import load as load_numpy
from safetensors.torch import load as load_torch

from harvest.jobfiles import MANIFEST, STATS
from harvest.shard.layout import shard_name
from harvest.pipeline import run_job
from harvest.request import HarvestRequest, resolve_job
from harvest.storage import Storage
from harvest.tokenize import load_tokenizer
from testbed import http_calls
from testbed.reference import hf_reference_layers
from tests.test_pipeline import RecordingStorage

pytest_plugins = ["tests.faults_fixtures"]

PROMPTS = ["The sky is", "Grass is green and the sky is blue.", "A shard is a file.", "Bread needs flour.", "Stop."]


def test_a_shard_corrupted_without_changing_its_size_is_caught_by_sha256_and_rewritten(registry, hf_engine):
    storage = RecordingStorage("memory:///tests/fidelity-bitflip")
    storage.delete_all()
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=PROMPTS, shard_size=2), registry)
    run_job(job, storage, hf_engine, "job-bitflip")
    good = storage.read_bytes(shard_name(1))
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF  # inside the tensor data: the file still parses, its size is the same
    storage.write_bytes(shard_name(1), bytes(flipped))
    assert storage.size(shard_name(1)) == len(good) and storage.read_bytes(shard_name(1)) != good
    storage.delete(MANIFEST)  # an interrupted job, resumed
    storage.writes.clear()

    summary = run_job(job, storage, hf_engine, "job-bitflip")
    assert summary.shards_skipped == 2  # shards 0 and 2 verified by their hashes
    assert shard_name(1) in storage.writes and shard_name(0) not in storage.writes and shard_name(2) not in storage.writes
    assert storage.read_bytes(shard_name(1)) == good
    recorded = {s["file"]: s["sha256"] for s in json.loads(storage.read_bytes(MANIFEST))["shards"]}
    assert recorded[shard_name(1)] == hashlib.sha256(good).hexdigest()


def _assert_stats_layout(stats: dict[str, np.ndarray], layers: list[int], width: int, count: int) -> None:
    """stats.safetensors: mean, std float32 [n_layers_kept, width]; layer_indices int32; count int64."""
    assert stats["mean"].dtype == np.float32 and stats["mean"].shape == (len(layers), width)
    assert stats["std"].dtype == np.float32 and stats["std"].shape == (len(layers), width)
    assert stats["layer_indices"].dtype == np.int32 and stats["layer_indices"].tolist() == layers
    assert stats["count"].dtype == np.int64 and int(stats["count"].reshape(-1)[0]) == count


def test_stats_file_dtypes_as_the_spec_says(registry, hf_engine, tiny):
    storage = Storage("memory:///tests/fidelity-stats")
    storage.delete_all()
    job = resolve_job(HarvestRequest(model="llama-tiny", prompts=PROMPTS, shard_size=2, layers=[1, 6]), registry)
    run_job(job, storage, hf_engine, "job-stats-dtypes")
    tokenizer = load_tokenizer(tiny.path)
    positions = sum(len(tokenizer(p)["input_ids"]) - 1 for p in PROMPTS)  # all but each prompt's first
    _assert_stats_layout(load_numpy(storage.read_bytes(STATS)), [1, 6], tiny.hidden_size, positions)


def _get(url: str) -> bytes:
    answer = http_calls.get(url, timeout=60)  # presigned: no key
    assert answer.status_code == 200, (url, answer.text[:300])
    return answer.content


def test_projection_job_through_the_api_matches_numpy_float64(faults_api, hf_engine, tiny):
    rng = np.random.default_rng(12)
    raw = (rng.standard_normal((3, tiny.hidden_size)) * np.array([[0.5], [3.0], [40.0]])).astype("<f4")
    layers = [0, tiny.n_layers - 1]  # the last block is read before the final norm
    prompts = PROMPTS[:3]
    answer = http_calls.post(f"{faults_api.base_url}/harvest", headers=faults_api.auth, timeout=60, json={
        "model": "llama-tiny", "prompts": prompts, "layers": layers, "shard_size": 2,
        "project_onto": {"data": base64.b64encode(raw.tobytes()).decode(), "dtype": "float32", "shape": [3, tiny.hidden_size]},
    })
    assert answer.status_code == 202, answer.text
    assert answer.json()["contents"] == "projections"
    job = faults_api.wait(answer.json()["job_id"])
    assert job["status"] == "done", job
    result = job["result"]
    assert result["contents"] == "projections" and result["layer_indices"] == layers

    manifest = json.loads(_get(result["manifest_url"]))
    assert manifest["contents"] == "projections" and manifest["dtype"] == "float32"
    assert manifest["projection"] == {
        "normalized": True, "n_directions": 3, "dtype": "float32", "sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
    }

    unit = raw.astype(np.float64) / np.linalg.norm(raw.astype(np.float64), axis=1, keepdims=True)
    tokenizer = load_tokenizer(tiny.path)
    expected_rows = []
    for k, url in enumerate(result["shard_urls"]):
        shard = load_numpy(_get(url))
        for i in range(2 * k, min(2 * k + 2, len(prompts))):
            ids = tokenizer(prompts[i])["input_ids"]
            assert shard[f"tokens_{i}"].tolist() == ids
            expected = hf_reference_layers(hf_engine.hf_model, ids, layers).astype(np.float64) @ unit.T
            got = shard[f"prompt_{i}"]
            assert got.dtype == np.float32 and got.shape == (len(layers), len(ids), 3)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
            expected_rows.append(expected[:, 1:])
    data = np.concatenate(expected_rows, axis=1)  # every position but each prompt's first
    stats = load_numpy(_get(result["stats_url"]))
    _assert_stats_layout(stats, layers, 3, data.shape[1])
    np.testing.assert_allclose(stats["mean"], data.mean(axis=1), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(stats["std"], data.std(axis=1), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose([manifest["mean_token_norm"][str(k)] for k in layers],
                               np.linalg.norm(data, axis=2).mean(axis=1), rtol=1e-4)

    # A link handed out before the retention sweep removed the files answers file_not_found.
    from flows.retention import sweep
    from harvest.jobfiles import JobFiles

    storage = faults_api.server.storage()
    assert job["job_id"] in sweep(storage, days=0, dry_run=True)  # the sweep would take it
    JobFiles.for_job(job["job_id"], storage).delete()  # what the sweep does to each job it takes
    gone = http_calls.get(result["shard_urls"][0], timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found", gone.text
    after = faults_api.read(job["job_id"])
    assert after["urls_expired"] is True and "shard_urls" not in after["result"]


def test_a_job_on_the_large_lane_runs_end_to_end(faults_api, tiny):
    from prefect.client.orchestration import get_client

    # `llama-tiny-large` is in the test registry only. A worker host's warm engine server
    # (harvest.warm) reads its registry once, from whichever run started it first, so this run
    # loads its engine in its own process (no slot table: `HARVEST_SLOTS=null`), with the
    # registry its environment names; lane, pool, deployment, caps and charging are the same.
    faults_api.flow_env(HARVEST_SLOTS="null")
    try:
        answer = http_calls.post(f"{faults_api.base_url}/harvest", headers=faults_api.auth, timeout=60,
                                 json={"model": "llama-tiny-large", "prompts": PROMPTS[:2], "layers": [2, 5]})
    finally:
        faults_api.flow_env()
    assert answer.status_code == 202, answer.text
    job = faults_api.wait(answer.json()["job_id"])
    assert job["status"] == "done", job["error"]
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(job["run_id"])
    assert run.work_pool_name == "large" and run.deployment_id is not None
    manifest = json.loads(_get(job["result"]["manifest_url"]))
    assert manifest["model"]["name"] == "llama-tiny-large" and manifest["layer_indices"] == [2, 5]
    shard = _get(job["result"]["shard_urls"][0])
    assert hashlib.sha256(shard).hexdigest() == manifest["shards"][0]["sha256"]
    tensors = load_torch(shard)  # bf16: numpy has no such dtype
    assert str(tensors["prompt_0"].dtype) == "torch.bfloat16"
    assert tuple(tensors["prompt_0"].shape) == (2, manifest["prompts"][0]["n_tokens"], tiny.hidden_size)
    (charge,) = faults_api.ledger(job["job_id"])
    assert charge["lane"] == "large" and charge["tokens_charged"] == job["tokens"] == manifest["tokens"]
