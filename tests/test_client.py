"""The researcher client (`client/`, `harvest_client`) against the live stack: the session's
Prefect server and process workers running real harvests of `llama-tiny`, behind a real API
on loopback (tests/client_fixtures.py).

Everything is checked against a source the client did not produce: the manifests' sha256 and
token counts, the shards read directly with safetensors, the API's own list of jobs, and numpy
float64 over every vector.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from harvest_client import ActivationDataset, Client
from harvest_client.api import ApiError, HarvestApi
from harvest_client.download import FileSpec, download_file
from harvest_client.plan import too_many_tokens

pytest_plugins = ["tests.client_fixtures"]

N_PROMPTS = 10_000
LAYERS = [3, 7]  # two layers and very short prompts: the corpus stays cheap to harvest on CPU
SHARD_SIZE = 1024


def _corpus(path: Path) -> list[str]:
    prompts = [f"p{i}" for i in range(N_PROMPTS)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
    return prompts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifests(out: Path) -> list[tuple[Path, dict]]:
    parts = sorted(p for p in out.iterdir() if p.is_dir())
    return [(p, json.loads((p / "manifest.json").read_text())) for p in parts]


def _finished_files(out: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file of every complete part: a re-download changes both."""
    found = {}
    for part in out.glob("part-*"):
        if (part / "manifest.json").exists():
            for f in part.iterdir():
                found[str(f)] = (f.stat().st_ino, f.stat().st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def refresh_run(harvest_stack, tmp_path_factory):
    """A corpus-refresh flow run of 25 prompts in 2 parts, started (not awaited) before the big
    harvest so that its Prefect run overlaps the harvest's instead of adding to the suite's time."""
    import uuid

    import pyarrow as pa
    from prefect.deployments import run_deployment

    texts = [("a refreshed line " * (1 + i % 3)) + str(i) for i in range(25)]
    corpus = tmp_path_factory.mktemp("refresh") / "refresh.parquet"
    pq.write_table(pa.table({"text": texts}), corpus)
    name = f"client-{uuid.uuid4().hex[:8]}"
    run = run_deployment("corpus-refresh/corpus-refresh", timeout=0, parameters={
        "corpus_url": str(corpus), "model": "llama-tiny", "layers": [1, 3], "shard_size": 4, "name": name, "part_size": 13})
    return str(run.id), name, texts


@pytest.fixture(scope="module")
def big_harvest(refresh_run, client_api, client_env, tmp_path_factory):
    """10,000 prompts through the CLI, SIGKILLed once its first job is downloaded, then the
    same harvest called again in-process. Returns what each step saw."""
    work = tmp_path_factory.mktemp("client-big")
    prompts = _corpus(work / "corpus.jsonl")
    out = work / "dataset"
    key = client_api.make_key(name="client-big")
    argv = [sys.executable, "-m", "harvest_client", "harvest", "--model", "llama-tiny", "--prompts", str(work / "corpus.jsonl"),
            "--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--shard-size", str(SHARD_SIZE), "--quiet"]
    log = open(work / "cli.log", "w")
    proc = subprocess.Popen(argv, env=client_env(key), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 420
    try:
        while not list(out.glob("part-*/manifest.json")):
            assert proc.poll() is None, (work / "cli.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no job finished in 420 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a kill, not a clean stop: no code of the client runs
        proc.wait(30)
        log.close()
    before = _finished_files(out)
    state_before = json.loads((out / "harvest.json").read_text())

    with Client(client_api.base_url, key) as client:
        summary = client.harvest("llama-tiny", str(work / "corpus.jsonl"), out, layers=LAYERS, shard_size=SHARD_SIZE, progress=False)
        jobs = client.jobs()
    return {"out": out, "prompts": prompts, "key": key, "base": client_api.base_url, "before": before,
            "state_before": state_before, "summary": summary, "jobs": jobs}


def test_ten_thousand_prompts_become_verified_jobs_and_resume_after_a_kill(big_harvest):
    out, summary = big_harvest["out"], big_harvest["summary"]
    manifests = _manifests(out)
    assert summary.jobs == len(manifests) >= 3 and summary.n_prompts == N_PROMPTS
    # No job was submitted twice: the service's own list holds exactly the plan's jobs.
    listed = {job["job_id"] for job in big_harvest["jobs"]}
    assert listed == set(summary.job_ids) and len(listed) == summary.jobs
    submitted_before_kill = sum(p["job_id"] is not None for p in big_harvest["state_before"]["parts"])
    assert summary.jobs_submitted == summary.jobs - submitted_before_kill
    # No finished file was fetched again: each is the very file (inode, mtime) the killed run left.
    before = big_harvest["before"]
    assert before and _finished_files(out).items() >= before.items()
    every_file = sum(len(m["shards"]) + 1 for _, m in manifests)
    finished_files = sum(1 for f in before if not f.endswith("manifest.json"))
    assert summary.files_downloaded <= every_file - finished_files
    # Every file verified against its manifest, every prompt where the corpus put it.
    texts = []
    for part, manifest in manifests:
        assert manifest["job_id"] in listed and manifest["layer_indices"] == LAYERS
        for shard in manifest["shards"]:
            assert _sha256(part / shard["file"]) == shard["sha256"] and (part / shard["file"]).stat().st_size == shard["bytes"]
        assert (part / "stats.safetensors").exists() and not list(part.glob("*.partial"))
        texts += [p["text"] for p in manifest["prompts"]]
    assert texts == big_harvest["prompts"]
    assert summary.tokens == sum(m["tokens"] for _, m in manifests)
    # The index: global prompt → part, job, shard, key, as the manifests say.
    index = pq.read_table(out / "index.parquet").to_pylist()
    assert [row["prompt"] for row in index] == list(range(N_PROMPTS))
    offset = 0
    for part, manifest in manifests:
        for shard in manifest["shards"]:
            first, last = shard["prompt_range"]
            for local, n in zip(range(first, last + 1), shard["token_counts"]):
                row = index[offset + local]
                assert (row["part"], row["job_id"], row["shard"], row["key"], row["n_tokens"]) == (
                    part.name, manifest["job_id"], shard["file"], f"prompt_{local}", n)
        offset += manifest["n_prompts"]

    # A third call finds everything finished: nothing submitted, nothing fetched.
    with Client(big_harvest["base"], big_harvest["key"]) as client:
        again = client.harvest("llama-tiny", big_harvest["prompts"], out, layers=LAYERS, shard_size=SHARD_SIZE, progress=False)
        assert len(client.jobs()) == summary.jobs
    assert (again.jobs_submitted, again.files_downloaded, again.bytes_downloaded) == (0, 0, 0)
    assert again.job_ids == summary.job_ids


def _direct_vectors(out: Path, layer: int, skip_bos: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every vector of `layer` in corpus order, read with safetensors itself (no client code)."""
    vectors, tokens, prompts = [], [], []
    offset = 0
    for part, manifest in _manifests(out):
        row = manifest["layer_indices"].index(layer)
        for shard in manifest["shards"]:
            tensors = load_file(str(part / shard["file"]))
            first, last = shard["prompt_range"]
            for local in range(first, last + 1):
                start = 1 if skip_bos else 0
                values = tensors[f"prompt_{local}"][row, start:].float().numpy()
                vectors.append(values)
                tokens.append(tensors[f"tokens_{local}"][start:].numpy())
                prompts.append(np.full(len(values), offset + local))
        offset += manifest["n_prompts"]
    return np.concatenate(vectors), np.concatenate(tokens), np.concatenate(prompts)


def test_dataset_yields_exactly_the_shards_vectors_in_corpus_order(big_harvest):
    out = big_harvest["out"]
    counts = [n for _, m in _manifests(out) for s in m["shards"] for n in s["token_counts"]]
    ds = ActivationDataset(out, layer=7)
    assert len(ds) == sum(n - 1 for n in counts) and ds.n_prompts == N_PROMPTS
    assert len(ActivationDataset(out, layer=7, skip_bos=False)) == sum(counts)
    vectors, tokens, prompts = _direct_vectors(out, 7, skip_bos=True)
    assert np.array_equal(ds[:], vectors)
    assert np.array_equal(ds.token_ids, tokens) and np.array_equal(ds.prompt_index, prompts)
    assert np.array_equal(ds[12345], vectors[12345]) and np.array_equal(ds[[5, 40000, -1]], vectors[[5, 40000, -1]])
    # Batched, in order: the same stream.
    batches = list(ds.batches(4096))
    assert [len(b.vectors) for b in batches[:-1]] == [4096] * (len(batches) - 1)
    assert np.array_equal(np.concatenate([b.vectors for b in batches]), vectors)
    assert np.array_equal(np.concatenate([b.prompt_index for b in batches]), prompts)
    # Shuffled: a permutation of the same vectors, the same for the same seed, not in order.
    def epoch(seed):
        return list(ds.batches(1000, shuffle=True, seed=seed, buffer_size=20000))

    first, again, other = epoch(1), epoch(1), epoch(2)
    order = np.concatenate([b.prompt_index for b in first])
    assert np.array_equal(order, np.concatenate([b.prompt_index for b in again]))
    assert not np.array_equal(order, np.concatenate([b.prompt_index for b in other]))
    assert not np.array_equal(order, prompts) and np.array_equal(np.sort(order), prompts)
    shuffled = np.concatenate([b.vectors for b in first]).astype(np.float64)
    np.testing.assert_allclose(shuffled.sum(0), vectors.astype(np.float64).sum(0), rtol=1e-9, atol=1e-6)
    # A batch mixes shards: the buffer (20,000 vectors) holds about four shards of ~5,000.
    assert len(np.unique(first[0].prompt_index // SHARD_SIZE)) >= 3


def test_merged_statistics_of_activations_against_numpy(big_harvest):
    """The jobs' stats merged (Chan) against numpy float64 over every vector the reader yields:
    the service's statistics describe exactly the stored (bf16) values, so they agree to 1e-6."""
    out = big_harvest["out"]
    for layer in LAYERS:
        ds = ActivationDataset(out, layer=layer)
        x = ds[:].astype(np.float64)
        assert ds.moments.count == len(x)
        np.testing.assert_allclose(ds.mean, x.mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(ds.std, x.std(axis=0), rtol=1e-6)
        normalized = ActivationDataset(out, layer=layer, normalize=True)[:].astype(np.float64)
        np.testing.assert_allclose(normalized, (x - ds.mean) / ds.std, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def projection_harvest(client_api, tmp_path_factory):
    """Prompts of varied length projected onto 4 directions, in 2 jobs, under a key that may
    run only one job at a time: the client waits out the 429 for the second."""
    out = tmp_path_factory.mktemp("client-proj") / "dataset"
    prompts = [("The residual stream " * (1 + i % 7)) + f"number {i}" for i in range(150)]
    directions = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    key = client_api.make_key(name="client-proj", small=1)
    with Client(client_api.base_url, key) as client:
        summary = client.harvest("llama-tiny", prompts, out, layers=[2, 5], project_onto=directions, shard_size=16,
                                 max_prompts_per_job=75, poll_s=2, progress=False)
        jobs = client.jobs()
    return {"out": out, "summary": summary, "jobs": jobs, "directions": directions}


def test_caps_are_waited_out_and_projections_merge_exactly(projection_harvest):
    out, summary = projection_harvest["out"], projection_harvest["summary"]
    assert summary.jobs == 2 and len(projection_harvest["jobs"]) == 2  # one at a time, none twice
    assert {j["status"] for j in projection_harvest["jobs"]} == {"done"}
    for layer in (2, 5):
        ds = ActivationDataset(out, layer=layer)
        assert ds.contents == "projections" and ds.n_features == 4
        vectors, _, _ = _direct_vectors(out, layer, skip_bos=True)
        assert np.array_equal(ds[:], vectors)
        x = vectors.astype(np.float64)
        np.testing.assert_allclose(ds.mean, x.mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(ds.std, x.std(axis=0), rtol=1e-6)
        assert ds.moments.count == len(x)


def test_a_refused_token_total_is_recognised_as_the_split_signal(client_api):
    """The service's real 400 for over 2,000,000 tokens is what makes the client split a job."""
    key = client_api.make_key(name="client-tokens")
    api = HarvestApi(client_api.base_url, key)
    try:
        with pytest.raises(ApiError) as refused:
            api.submit({"model": "llama-tiny", "prompts": ["word " * 520] * 4096, "layers": [1]})
    finally:
        api.close()
    error = refused.value
    assert too_many_tokens(error.status, error.param, error.message), error
    assert not too_many_tokens(400, "layers", "llama-tiny has layers 0 to 7: it has no layer 40.")


def test_cli_download_and_a_partial_file_resumed_with_a_range(big_harvest, client_env, tmp_path):
    job_id = big_harvest["summary"].job_ids[1]
    part, manifest = _manifests(big_harvest["out"])[1]
    out = tmp_path / "job"
    run = subprocess.run([sys.executable, "-m", "harvest_client", "download", job_id, "--out", str(out)],
                         env=client_env(big_harvest["key"]), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for name in [s["file"] for s in manifest["shards"]] + ["stats.safetensors", "manifest.json"]:
        assert _sha256(out / name) == _sha256(part / name), name

    # Half a shard left as .partial: only the rest comes over the wire, and it verifies.
    shard = manifest["shards"][0]
    target = tmp_path / "resume" / shard["file"]
    target.parent.mkdir()
    half = shard["bytes"] // 2
    (target.parent / (shard["file"] + ".partial")).write_bytes((part / shard["file"]).read_bytes()[:half])
    with Client(big_harvest["base"], big_harvest["key"]) as client:
        link = client.api.get(job_id)["result"]["shard_urls"][0]
    with httpx.Client() as http:
        fetched = download_file(http, link, target, FileSpec(shard["file"], 0, shard["bytes"], shard["sha256"]))
    assert fetched == shard["bytes"] - half and _sha256(target) == shard["sha256"]



S3_OPTIONS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server in its own process (as tests/test_api_s3.py runs it), with a bucket."""
    import boto3
    import s3fs

    from tests.api_fixtures import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(**S3_OPTIONS, client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
    boto = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            boto.create_bucket(Bucket="refresh")
            break
        except Exception:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.3)
    yield endpoint, fs
    server.terminate()
    server.wait(timeout=10)


def test_a_scheduled_corpus_refresh_is_training_data_locally_and_on_s3(refresh_run, harvest_stack, harvest_home, s3_endpoint):
    """A real corpus-refresh flow run writes its dated prefix; the dataset reads it in corpus
    order from the storage folder itself, and from S3 after the prefix is copied there."""
    run_id, name, texts = refresh_run
    status = harvest_stack.wait(run_id, timeout=300)
    assert status.status == "done", status

    root = harvest_home / "storage" / "corpus" / name
    (dated,) = list(root.iterdir())  # corpus/<name>/<YYYY-MM-DD>
    manifests = _manifests(dated)
    assert [p.name for p, _ in manifests] == ["part-0000", "part-0001"]  # 25 prompts, 13 a part
    assert [p["text"] for _, m in manifests for p in m["prompts"]] == texts
    local = ActivationDataset(root, layer=3)  # the newest dated prefix under the corpus's name
    counts = [n for _, m in manifests for s in m["shards"] for n in s["token_counts"]]
    assert len(local) == sum(n - 1 for n in counts) and local.n_prompts == len(texts)
    vectors, tokens, prompts = _direct_vectors(dated, 3, skip_bos=True)
    assert np.array_equal(local[:], vectors) and np.array_equal(local.token_ids, tokens)
    assert np.array_equal(local.prompt_index, prompts)

    endpoint, fs = s3_endpoint
    fs.put(str(dated), f"refresh/corpus/{name}/{dated.name}", recursive=True)
    remote = ActivationDataset(f"s3://refresh/corpus/{name}", layer=3, normalize=True,
                               storage_options={**S3_OPTIONS, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}})
    assert len(remote) == len(local) and remote.moments.count == local.moments.count
    normalized = (vectors.astype(np.float64) - local.mean) / local.std
    np.testing.assert_allclose(remote[:], normalized, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.concatenate([b.token_ids for b in remote.batches(50)]), tokens)
